"""Process-wide Redis clients: one async client per event loop, one sync client per process.

redis-py 8 gives every connection a 5 s ``socket_timeout`` unless told otherwise, and a
read that blocks as long as that (BZPOPMIN, XREADGROUP BLOCK, BRPOP) then fails at
random. Every client the project makes says its timeout: commands here never block, so
``REDIS_SOCKET_TIMEOUT`` bounds a request to a Redis that stopped answering; clients that
do block (the Channels layer, Celery's broker) are configured in settings with
``REDIS_BLOCKING_SOCKET_TIMEOUT``, well above their longest block. Pub/sub ``listen()``
waits without a socket timeout (redis-py passes no limit for it).

Under uvloop (the gateway's loop, console/servers.py) a write on a connection the server
dropped raises ``RuntimeError("unable to perform operation on <TCPTransport closed=True>")``
where asyncio's own loop raises an ``OSError``, which redis-py turns into a
``ConnectionError``. Every caller here handles a Redis outage as a ``ConnectionError``
(503 at admission, a deferred settlement, a retried beat), so the async client's
connections report that write the same way.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.connection import AbstractConnection, parse_url

from core.lifecycle import PerLoop


class _LostOnClosedTransport(AbstractConnection):
    """A write on a transport closed under us is a lost connection, on uvloop too."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except RuntimeError as exc:  # uvloop's closed transport; redis-py has disconnected
            raise redis.exceptions.ConnectionError(f"Connection lost while writing: {exc}") from exc


class _Connection(_LostOnClosedTransport, aioredis.Connection):
    pass


class _SSLConnection(_LostOnClosedTransport, aioredis.SSLConnection):
    pass


class _UnixConnection(_LostOnClosedTransport, aioredis.UnixDomainSocketConnection):
    pass


_CONNECTION_CLASSES: dict[type[AbstractConnection], type[AbstractConnection]] = {
    aioredis.Connection: _Connection,
    aioredis.SSLConnection: _SSLConnection,
    aioredis.UnixDomainSocketConnection: _UnixConnection,
}


def _async_client() -> aioredis.Redis:
    options = parse_url(settings.REDIS_URL)
    url_class = options.get("connection_class", aioredis.Connection)
    options["connection_class"] = _CONNECTION_CLASSES.get(url_class, url_class)
    pool = aioredis.ConnectionPool(
        max_connections=512,
        socket_connect_timeout=2,
        socket_timeout=settings.REDIS_SOCKET_TIMEOUT,
        health_check_interval=30,
        **options,
    )
    return aioredis.Redis.from_pool(pool)


_async_clients = PerLoop(_async_client)


def async_redis() -> aioredis.Redis:
    """The async client for the running loop (a client cannot cross event loops)."""
    return _async_clients.get()


@lru_cache(maxsize=1)
def sync_redis() -> redis.Redis:
    return redis.Redis.from_url(
        settings.REDIS_URL,
        socket_connect_timeout=2,
        socket_timeout=settings.REDIS_SOCKET_TIMEOUT,
        health_check_interval=30,
    )


# Errors Redis answers while it cannot take a write for a while: a replica after a failover
# (READONLY), a failed background save (MISCONF), maxmemory (OOM), a long script (BUSY),
# missing replicas (NOREPLICAS), a restart loading its data (LOADING), a cluster failover
# (MASTERDOWN, TRYAGAIN, CLUSTERDOWN). They pass: retry them like an outage. Inside a script
# Redis wraps them ("Error running script …: -NOREPLICAS …"). Anything else it answers (a
# script's own error, a wrong type) will be answered the same way every time.
_TRANSIENT_REPLY = re.compile(
    r"(?:^|-)(READONLY|MISCONF|OOM|BUSY|NOREPLICAS|LOADING|MASTERDOWN|TRYAGAIN|CLUSTERDOWN)\b"
)


def is_transient(exc: BaseException) -> bool:
    """Whether a Redis failure may pass: an outage, a timeout, or one of the replies above."""
    if isinstance(exc, redis.exceptions.ResponseError):
        code = getattr(exc, "status_code", None)
        return bool(_TRANSIENT_REPLY.search(f"{code or ''} {exc}".strip()))
    return isinstance(exc, redis.exceptions.RedisError | OSError)
