"""Process-wide Redis clients: one async client per event loop, one sync client per process.

redis-py 8 gives every connection a 5 s ``socket_timeout`` unless told otherwise, and a
read that blocks as long as that (BZPOPMIN, XREADGROUP BLOCK, BRPOP) then fails at
random. Every client the project makes says its timeout: commands here never block, so
``REDIS_SOCKET_TIMEOUT`` bounds a request to a Redis that stopped answering; clients that
do block (the Channels layer, Celery's broker) are configured in settings with
``REDIS_BLOCKING_SOCKET_TIMEOUT``, well above their longest block. Pub/sub ``listen()``
waits without a socket timeout (redis-py passes no limit for it).
"""

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
            settings.REDIS_URL,
            max_connections=512,
            socket_connect_timeout=2,
            socket_timeout=settings.REDIS_SOCKET_TIMEOUT,
            health_check_interval=30,
        )
        _async_clients[loop] = client
    return client


@lru_cache(maxsize=1)
def sync_redis() -> redis.Redis:
    return redis.Redis.from_url(
        settings.REDIS_URL,
        socket_connect_timeout=2,
        socket_timeout=settings.REDIS_SOCKET_TIMEOUT,
        health_check_interval=30,
    )
