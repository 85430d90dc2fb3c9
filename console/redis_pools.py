"""Process-wide Redis clients: one async client per event loop, one sync client per process."""

from __future__ import annotations

import asyncio
import weakref
from functools import lru_cache

import redis
import redis.asyncio as aioredis
from django.conf import settings

_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = weakref.WeakKeyDictionary()


def async_redis() -> aioredis.Redis:
    """The async client for the running loop (a client cannot cross event loops)."""
    loop = asyncio.get_running_loop()
    client = _async_clients.get(loop)
    if client is None:
        client = aioredis.from_url(
            settings.REDIS_URL, max_connections=512, socket_connect_timeout=2, health_check_interval=30
        )
        _async_clients[loop] = client
    return client


@lru_cache(maxsize=1)
def sync_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, health_check_interval=30)


def key(*parts: str) -> str:
    """A Redis key or channel name inside this deployment's namespace."""
    return ":".join((settings.REDIS_NAMESPACE, *parts))
