"""Liveness and readiness endpoints for load balancers and `make run`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse

from core.db import run_db
from core.lifecycle import draining
from core.redis import async_redis
from serving.gateway.routing import router


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


async def _replicas_ok() -> bool:
    """Every model in READY_MODELS has a replica the router would send a request to."""
    table = await router.snapshot()
    missing = [
        name
        for name in settings.READY_MODELS
        if name not in table.models or not any(router.routable(v) for v in table.models[name].versions)
    ]
    if missing:
        raise LookupError(f"no ready replica for {', '.join(missing)}")
    return True


async def readyz(request: HttpRequest) -> JsonResponse:
    """The process can do useful work: PostgreSQL and Redis answer, the default models are up,
    and it is not draining to stop."""
    if draining():  # asked to stop: the balancer takes it out while it still serves
        return JsonResponse({"status": "draining", "checks": {}}, status=503)
    checks = [
        _check("database", run_db(_database_ok)),
        _check("redis", async_redis().ping()),
    ]
    if settings.READY_MODELS:
        checks.append(_check("replicas", _replicas_ok()))
    results = dict(await asyncio.gather(*checks))
    ready = all(value == "ok" for value in results.values())
    return JsonResponse({"status": "ready" if ready else "not ready", "checks": results}, status=200 if ready else 503)
