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

With Redis Sentinel (``REDIS_SENTINELS``), every client here, and Django's cache (its pool
class, ``SentinelPool``), connects to the master the Sentinels name for
``REDIS_SENTINEL_MASTER``, and leaves it as soon as they name another (``MasterWatch``): a
command for the old master fails as a lost connection, which every caller already handles as
an outage, and is retried on the new one. ``REDIS_URL`` then gives the database number and the
master's password only. What a failover can lose: docs/architecture.md, "Redis with Sentinel".
"""

from __future__ import annotations

import os
import re
import threading
import time
from functools import lru_cache
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel
import redis.connection
import redis.sentinel
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


class MasterWatch:
    """The address of the master Sentinel names now, kept current by a thread: the Sentinels'
    ``+switch-master`` announcements, and their answer asked each ``POLL_S`` (a missed message).

    redis-py's Sentinel connections ask for the master only when they connect. After a
    failover the old master, when it is still up (``SENTINEL FAILOVER``, a partition that
    heals), keeps taking the writes of clients connected to it until the Sentinels demote it,
    seconds later (measured: more than 10 s), and those writes are then lost; and for a moment
    some Sentinels still name the old master. So a connection connects to this address, and
    checks it before each command: a master that moved is a lost connection, retried on the new one.
    (redis-py 8.1's retry of a lost connection reconnects to the address it had, not through
    Sentinel: the connections here reconnect through Sentinel before sending.)
    """

    POLL_S = 0.5
    SETTLE_S = 5.0

    def __init__(self, sentinels: list[tuple[str, int]], master: str, options: dict[str, Any]) -> None:
        self.sentinels, self.master, self.options = sentinels, master, options
        self.address: tuple[str, int] | None = None
        self.switched_at = 0.0
        self.stopped = threading.Event()
        threading.Thread(target=self._run, name="redis master watch", daemon=True).start()

    def _run(self) -> None:
        sentinel = redis.sentinel.Sentinel(self.sentinels, sentinel_kwargs=self.options)  # type: ignore[no-untyped-call]
        while not self.stopped.is_set():
            try:
                self.address = sentinel.discover_master(self.master)  # type: ignore[no-untyped-call]
                listening = None
                for candidate in sentinel.sentinels:  # the first that answers; each POLL_S all are asked
                    listening = candidate.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
                    try:
                        listening.subscribe("+switch-master")
                        break
                    except redis.RedisError:
                        listening.close()
                        listening = None
                if listening is None:
                    raise redis.ConnectionError("no Sentinel answers")
                with listening:
                    while not self.stopped.is_set():
                        message = listening.get_message(timeout=self.POLL_S)
                        if message is not None:
                            name, _, _, host, port = message["data"].decode().split()
                            if name == self.master:
                                self.address, self.switched_at = (host, int(port)), time.monotonic()
                        elif time.monotonic() - self.switched_at > self.SETTLE_S:
                            # Right after a switch some Sentinels may still name the old master.
                            self.address = sentinel.discover_master(self.master)  # type: ignore[no-untyped-call]
            except (redis.RedisError, OSError, ValueError):
                self.stopped.wait(self.POLL_S)

    def moved(self, host: str | None, port: int | None) -> bool:
        """Whether a connection to ``host:port`` is to a master that is no longer the master."""
        return self.address is not None and host is not None and (host, port) != self.address


_watches: dict[tuple[Any, ...], MasterWatch] = {}
_watches_lock = threading.Lock()


def master_watch() -> MasterWatch:
    """This process's watch of the master Sentinel names (one per Sentinel settings)."""
    # The pid too: a forked child (a Celery pool process) has no copy of its parent's thread.
    key = (
        tuple(settings.REDIS_SENTINELS),
        settings.REDIS_SENTINEL_MASTER,
        settings.REDIS_SENTINEL_PASSWORD,
        os.getpid(),
    )
    with _watches_lock:
        watch = _watches.get(key)
        if watch is None:
            for old in _watches.values():  # settings changed (tests): the old ones stop
                old.stopped.set()
            _watches.clear()
            watch = _watches[key] = MasterWatch(list(key[0]), key[1], _sentinel_options())
        return watch


# A lost connection, which callers retry (redis-py's own retry first), reconnecting to the new master.
_MOVED = "The Redis master moved away from {}:{} (Sentinel failover)"


class _SentinelConnection(_LostOnClosedTransport, aioredis.sentinel.SentinelManagedConnection):
    async def connect_to(self, address: tuple[str, int]) -> None:
        # The watch's address, once it has one: right after a failover the Sentinel the pool asked
        # may still name the old master.
        await super().connect_to(master_watch().address or address)  # type: ignore[no-untyped-call]

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self.is_connected and master_watch().moved(self.host, self.port):
            await self.disconnect()
            raise redis.exceptions.ConnectionError(_MOVED.format(self.host, self.port))
        if not self.is_connected:  # through Sentinel: redis-py's own reconnect here reuses the old address
            await self.connect()  # type: ignore[no-untyped-call]
        await super().send_packed_command(command, check_health)


class _SentinelSSLConnection(_SentinelConnection, aioredis.sentinel.SentinelManagedSSLConnection):
    pass


class _SyncSentinelConnection(redis.sentinel.SentinelManagedConnection):
    def connect_to(self, address: tuple[str, int]) -> None:
        super().connect_to(master_watch().address or address)  # type: ignore[no-untyped-call]

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._sock is not None and master_watch().moved(self.host, self.port):
            self.disconnect()
            raise redis.exceptions.ConnectionError(_MOVED.format(self.host, self.port))
        if self._sock is None:  # through Sentinel: redis-py's own reconnect here reuses the old address
            self.connect()  # type: ignore[no-untyped-call]
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


class _SyncSentinelSSLConnection(_SyncSentinelConnection, redis.sentinel.SentinelManagedSSLConnection):
    pass


_CONNECTION_CLASSES: dict[type[AbstractConnection], type[AbstractConnection]] = {
    aioredis.Connection: _Connection,
    aioredis.SSLConnection: _SSLConnection,
    aioredis.UnixDomainSocketConnection: _UnixConnection,
}

# With Sentinel the connection class is Sentinel's (it asks for the master's address on connect).
_SENTINEL_CONNECTION_CLASSES: dict[type[Any], type[Any]] = {
    aioredis.Connection: _SentinelConnection,
    aioredis.SSLConnection: _SentinelSSLConnection,
    redis.connection.Connection: _SyncSentinelConnection,
    redis.connection.SSLConnection: _SyncSentinelSSLConnection,
}

# Every client's socket options (the Channels layer and Celery's broker, which block, set theirs
# in settings).
_SOCKET_OPTIONS: dict[str, Any] = {"socket_connect_timeout": 2, "health_check_interval": 30}


def sentinel_enabled() -> bool:
    """Whether Redis is reached through Sentinel (``REDIS_SENTINELS`` is set)."""
    return bool(settings.REDIS_SENTINELS)


def _sentinel_connection_options(options: dict[str, Any], plain: type[Any]) -> dict[str, Any]:
    """REDIS_URL's options for a connection to whichever server Sentinel names master: its
    database, user, password and TLS; never its host and port (Sentinel says where)."""
    options = {k: v for k, v in options.items() if k not in ("host", "port", "path")}
    url_class = options.get("connection_class", plain)
    if url_class not in _SENTINEL_CONNECTION_CLASSES:
        raise ValueError(f"REDIS_URL {settings.REDIS_URL!r}: with REDIS_SENTINELS use redis:// or rediss://")
    options["connection_class"] = _SENTINEL_CONNECTION_CLASSES[url_class]
    return options


def _sentinel_options() -> dict[str, Any]:
    """How to reach the Sentinels themselves: their own password, never the master's."""
    return {
        "password": settings.REDIS_SENTINEL_PASSWORD,
        "socket_connect_timeout": 2,
        "socket_timeout": settings.REDIS_SOCKET_TIMEOUT,
    }


def _async_client() -> aioredis.Redis:
    options = parse_url(settings.REDIS_URL)
    if sentinel_enabled():
        sentinel = aioredis.sentinel.Sentinel(settings.REDIS_SENTINELS, sentinel_kwargs=_sentinel_options())  # type: ignore[no-untyped-call]
        return sentinel.master_for(  # type: ignore[no-any-return]
            settings.REDIS_SENTINEL_MASTER,
            max_connections=512,
            socket_timeout=settings.REDIS_SOCKET_TIMEOUT,
            **_SOCKET_OPTIONS,
            **_sentinel_connection_options(options, aioredis.Connection),  # type: ignore[arg-type]
        )
    url_class = options.get("connection_class", aioredis.Connection)
    options["connection_class"] = _CONNECTION_CLASSES.get(url_class, url_class)
    pool = aioredis.ConnectionPool(
        max_connections=512, socket_timeout=settings.REDIS_SOCKET_TIMEOUT, **_SOCKET_OPTIONS, **options
    )
    return aioredis.Redis.from_pool(pool)


_async_clients = PerLoop(_async_client)


def async_redis() -> aioredis.Redis:
    """The async client for the running loop (a client cannot cross event loops)."""
    return _async_clients.get()


@lru_cache(maxsize=1)
def sync_redis() -> redis.Redis:
    if sentinel_enabled():
        return redis.Redis(connection_pool=SentinelPool.from_url(settings.REDIS_URL))
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=settings.REDIS_SOCKET_TIMEOUT, **_SOCKET_OPTIONS)


class SentinelPool(redis.sentinel.SentinelConnectionPool):
    """A synchronous pool of connections to the master Sentinel names: the sync client's, and
    Django's cache's (``CACHES``' ``pool_class`` with Sentinel), which makes it from its
    LOCATION (REDIS_URL) like any pool."""

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> SentinelPool:
        options = _sentinel_connection_options(redis.connection.parse_url(url), redis.connection.Connection)  # type: ignore[no-untyped-call]
        options = {"socket_timeout": settings.REDIS_SOCKET_TIMEOUT, **_SOCKET_OPTIONS, **options, **kwargs}
        sentinel = redis.sentinel.Sentinel(settings.REDIS_SENTINELS, sentinel_kwargs=_sentinel_options())  # type: ignore[no-untyped-call]
        return cls(settings.REDIS_SENTINEL_MASTER, sentinel, **options)


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
