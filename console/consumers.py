"""The console's live overview over a WebSocket: fresh figures every few seconds for platform admins.

Session-authenticated (``AuthMiddlewareStack``) and origin-checked (``AllowedHostsOriginValidator``)
in console/routing.py. Protocol (JSON text frames): the server sends ``{"type": "overview",
"range", "at", "headline", "figures", "rows", "gateway"}`` on connect and every
``CONSOLE_LIVE_INTERVAL_SECONDS``; the client may send ``{"range": "<key>"}`` to switch windows.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import parse_qs

import orjson
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from accounts.permissions import is_platform_admin
from billing.usage_series import DEFAULT_RANGE, TIME_RANGES
from console.pages.overview_data import GatewaySample, dashboard, gateway_rates, gateway_sample

logger = logging.getLogger(__name__)

# Refused before the handshake completes: the browser sees the socket fail, nothing is sent.
FORBIDDEN = 4403


def _still_admin(user: Any) -> bool:
    # Re-read on every push: an admin demoted (or deleted) stops receiving within one interval.
    if not getattr(user, "is_authenticated", False):
        return False
    user.refresh_from_db()
    return user.is_active and is_platform_admin(user)


def _overview(user: Any, range_key: str) -> dict[str, Any] | None:
    if not _still_admin(user):
        return None
    return dashboard(range_key=range_key)


class LiveOverviewConsumer(AsyncWebsocketConsumer):  # type: ignore[misc]  # channels is untyped
    range_key: str
    previous: GatewaySample | None
    pusher: asyncio.Task[None] | None

    async def connect(self) -> None:
        self.pusher = None
        self.previous = None
        user = self.scope.get("user")
        if user is None or not await database_sync_to_async(_still_admin)(user):
            await self.close(code=FORBIDDEN)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode("latin1"))
        wanted = (query.get("range") or [DEFAULT_RANGE])[0]
        self.range_key = wanted if wanted in TIME_RANGES else DEFAULT_RANGE
        await self.accept()
        self.pusher = asyncio.create_task(self._push_forever())

    async def disconnect(self, code: int) -> None:
        if self.pusher is not None:
            self.pusher.cancel()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            message = orjson.loads(text_data or b"{}")
        except orjson.JSONDecodeError:
            return
        wanted = message.get("range") if isinstance(message, dict) else None
        if isinstance(wanted, str) and wanted in TIME_RANGES and wanted != self.range_key:
            self.range_key = wanted
            await self.push()

    async def push(self) -> bool:
        """Send one update; False (and the socket closed) when the user may no longer see it."""
        payload = await database_sync_to_async(_overview)(self.scope["user"], self.range_key)
        if payload is None:
            await self.close(code=FORBIDDEN)
            return False
        sample = gateway_sample()
        payload["gateway"] = gateway_rates(self.previous, sample)
        self.previous = sample
        await self.send(text_data=orjson.dumps({"type": "overview", **payload}).decode())
        return True

    async def _push_forever(self) -> None:
        interval = settings.CONSOLE_LIVE_INTERVAL_SECONDS
        while True:
            try:
                if not await self.push():
                    return
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed read must not end the live view; the next tick retries
                logger.exception("live overview: update failed")
            await asyncio.sleep(interval)
