"""The WebSocket API: several chat completions at once on one socket, each cancellable.

Protocol (JSON text frames):

- authenticate with ``Authorization: Bearer sk-…`` on the handshake, or send
  ``{"type": "auth", "api_key": "sk-…"}`` first (browsers cannot set headers);
- ``{"type": "chat.completion", "id": "<client id>", "body": {…chat request…}}`` starts one
  (always streamed);
- the server answers ``{"type": "chunk", "id", "data": <chat.completion.chunk>}`` per chunk,
  then exactly one ``{"type": "usage", "id", "request_id", "status", "usage": {…}}``
  (also after a cancel or an error), or ``{"type": "error", "id", "error": {…}}`` when the
  request was refused before it started (nothing was run or metered);
- ``{"type": "cancel", "id": "<client id>"}`` stops one; closing the socket stops all.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import orjson
from channels.generic.websocket import AsyncWebsocketConsumer

from serving.auth import KeyGrant, authenticate
from serving.errors import APIError, AuthenticationFailed, InvalidRequest
from serving.pipeline import CHAT, CLIENT_CLOSED, StreamRelay, admit, prepare

logger = logging.getLogger(__name__)

MAX_CONCURRENT_PER_SOCKET = 32


class ChatCompletionsConsumer(AsyncWebsocketConsumer):
    grant: KeyGrant | None
    authorization: str | None

    async def connect(self) -> None:
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.grant = None
        self.authorization = None
        headers = dict(self.scope.get("headers", []))
        header = headers.get(b"authorization")
        if header:
            try:
                self.authorization = header.decode()
                self.grant = await authenticate(self.authorization)
            except APIError:
                await self.close(code=4401)
                return
        await self.accept()

    async def disconnect(self, code: int) -> None:
        for task in list(getattr(self, "tasks", {}).values()):
            task.cancel()
        if getattr(self, "tasks", None):
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def _send(self, message: dict[str, Any]) -> None:
        await self.send(text_data=orjson.dumps(message).decode())

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            message = orjson.loads(text_data or bytes_data or b"")
        except orjson.JSONDecodeError:
            await self._send({"type": "error", "id": None, "error": InvalidRequest("Frames must be JSON.").detail()})
            return
        if not isinstance(message, dict):
            await self._send({"type": "error", "id": None, "error": InvalidRequest("Frames must be objects.").detail()})
            return
        kind = message.get("type")
        client_id = message.get("id")
        if kind == "auth":
            await self._auth(str(message.get("api_key", "")))
        elif kind == "cancel":
            task = self.tasks.get(str(client_id))
            if task is not None:
                task.cancel()
        elif kind == "chat.completion":
            await self._start(client_id, message.get("body"))
        else:
            error = InvalidRequest(f"Unknown message type {kind!r}.", param="type")
            await self._send({"type": "error", "id": client_id, "error": error.detail()})

    async def _auth(self, secret: str) -> None:
        try:
            self.authorization = f"Bearer {secret}"
            self.grant = await authenticate(self.authorization)
            await self._send({"type": "auth", "ok": True})
        except APIError as exc:
            self.grant = None
            await self._send({"type": "auth", "ok": False, "error": exc.detail()})

    async def _start(self, client_id: Any, body: Any) -> None:
        if not isinstance(client_id, str) or not client_id:
            error = InvalidRequest("Each request needs a string 'id'.", param="id")
            await self._send({"type": "error", "id": client_id, "error": error.detail()})
            return
        if client_id in self.tasks:
            error = InvalidRequest(f"Request id {client_id!r} is already running.", param="id")
            await self._send({"type": "error", "id": client_id, "error": error.detail()})
            return
        if self.grant is None:
            await self._send({"type": "error", "id": client_id, "error": AuthenticationFailed(
                "Authenticate first: an Authorization header on the handshake or an 'auth' message.",
                code="missing_api_key",
            ).detail()})  # fmt: skip
            return
        if len(self.tasks) >= MAX_CONCURRENT_PER_SOCKET:
            error = InvalidRequest(f"At most {MAX_CONCURRENT_PER_SOCKET} requests may run on one socket.")
            await self._send({"type": "error", "id": client_id, "error": error.detail()})
            return
        if not isinstance(body, dict):
            error = InvalidRequest("'body' must be a chat completion request object.", param="body")
            await self._send({"type": "error", "id": client_id, "error": error.detail()})
            return
        task = asyncio.get_running_loop().create_task(self._run(client_id, body))
        self.tasks[client_id] = task
        task.add_done_callback(lambda _t: self.tasks.pop(client_id, None))

    async def _run(self, client_id: str, body: dict[str, Any]) -> None:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            # Checked again per request: a key revoked mid-socket stops working within a second.
            grant = await authenticate(self.authorization)
            prepared = await prepare(CHAT, orjson.dumps(body), grant, request_id=uuid.uuid4())
            await admit(prepared)
        except APIError as exc:  # refused: nothing ran, nothing is metered
            await self._send({"type": "error", "id": client_id, "error": exc.detail()})
            return
        metered = prepared.metered
        relay = StreamRelay(prepared)
        outcome = "completed"
        try:
            await relay.start()
            async for chunk in relay.events():
                if "error" in chunk:
                    outcome = "error"
                    await self._send({"type": "error", "id": client_id, "error": chunk["error"]})
                elif chunk.get("choices"):
                    await self._send({"type": "chunk", "id": client_id, "data": chunk})
        except APIError as exc:  # the engine refused or failed before the first token
            outcome = "error"
            await self._send({"type": "error", "id": client_id, "error": exc.detail()})
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            await metered.finish(CLIENT_CLOSED if outcome == "cancelled" else 200)  # no-op if already written
            usage = {
                "prompt_tokens": metered.prompt_tokens,
                "completion_tokens": metered.completion_tokens,
                "total_tokens": metered.prompt_tokens + metered.completion_tokens,
            }
            message = {
                "type": "usage",
                "id": client_id,
                "request_id": str(metered.request_id),
                "status": outcome,
                "usage": usage,
            }
            try:
                await self._send(message)
            except Exception:  # noqa: BLE001 - the socket may be gone; the usage is metered regardless
                logger.debug("could not send usage for %s", client_id)
