"""Liveness and readiness endpoints for load balancers and `make run`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from functools import lru_cache
from typing import Any

import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse


@lru_cache(maxsize=1)
def _redis() -> aioredis.Redis:
    return aioredis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=2)


def _database_ok() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        return bool(cursor.fetchone() == (1,))


async def _check(name: str, check: Awaitable[Any]) -> tuple[str, str]:
    try:
        ok = bool(await asyncio.wait_for(check, timeout=3))
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready", reported by name
        return name, f"error: {type(exc).__name__}: {exc}"
    return name, "ok" if ok else "error: unexpected answer"


async def healthz(request: HttpRequest) -> JsonResponse:
    """The process is alive and serving requests; no dependencies are checked."""
    return JsonResponse({"status": "ok"})


async def readyz(request: HttpRequest) -> JsonResponse:
    """The process can do useful work: PostgreSQL and Redis answer."""
    results = dict(
        await asyncio.gather(
            _check("database", sync_to_async(_database_ok)()),
            _check("redis", _redis().ping()),
        )
    )
    ready = all(value == "ok" for value in results.values())
    return JsonResponse({"status": "ready" if ready else "not ready", "checks": results}, status=200 if ready else 503)
