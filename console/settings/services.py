"""The services the platform stands on: PostgreSQL, Redis (cache, Channels layer, key
namespace, Sentinel). With no DATABASE_URL / REDIS_URL (and no REDIS_SENTINELS) the embedded
servers (core/embedded.py) are used."""

from __future__ import annotations

import os
from typing import Any

import dj_database_url
from redis.connection import parse_url

from core import embedded

from .env import envfloat, envint, envlist

#: PostgreSQL's URL (postgresql://...; default: the embedded server).
DATABASE_URL = os.environ.get("DATABASE_URL") or embedded.database_url()


def sentinel_addresses(items: list[str]) -> list[tuple[str, int]]:
    """``host:port`` items as (host, port) pairs (port 26379 when left out)."""
    pairs = []
    for item in items:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "26379")
        pairs.append((host.strip("[]"), int(port)))
    return pairs


# Redis Sentinel (docs/architecture.md, "Redis with Sentinel"): every Redis client the
# platform makes (core/redis.py, Django's cache, the Channels layer, Celery's broker) asks
# these for the current master and follows a failover. REDIS_URL's host and port are then
# not used; its database number, user and password (the master's) are.
#: Redis Sentinel's addresses (host:port, comma-separated; empty: no Sentinel, REDIS_URL's server).
REDIS_SENTINELS = sentinel_addresses(envlist("REDIS_SENTINELS", ""))
#: The name the Sentinels monitor the platform's Redis master under (with REDIS_SENTINELS).
REDIS_SENTINEL_MASTER = os.environ.get("REDIS_SENTINEL_MASTER", "mymaster")
#: The Sentinels' own password, when they ask for one (requirepass in sentinel.conf; the master's is REDIS_URL's).
REDIS_SENTINEL_PASSWORD = os.environ.get("REDIS_SENTINEL_PASSWORD") or None
#: Redis's URL (redis://[:password@]host:port/db; default: the embedded server, or with Sentinel
#: redis://localhost/0, whose host is not used).
REDIS_URL = os.environ.get("REDIS_URL") or ("redis://localhost:6379/0" if REDIS_SENTINELS else embedded.redis_url())
# Pub/sub channels are not scoped by Redis database number; every channel name and shared
# key carries this namespace so a test run never talks to a running platform.
#: The prefix of every Redis key and channel name the platform uses (a string).
REDIS_NAMESPACE = os.environ.get("REDIS_NAMESPACE", "ip")

#: The most connections each process's psycopg 3 pool holds to the database.
DB_POOL_SIZE = envint("DB_POOL_SIZE", 10)
#: Django's database: DATABASE_URL with a psycopg 3 pool of DB_POOL_SIZE connections.
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0, conn_health_checks=False)}
DATABASES["default"]["OPTIONS"] = {
    # psycopg 3 connection pool: daphne serves many requests on few threads.
    "pool": {"min_size": 1, "max_size": DB_POOL_SIZE, "timeout": 10},
}
#: The primary key type of models that declare none (a field class path).
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# redis-py 8 defaults every connection's socket_timeout to 5 s, and a read that blocks that
# long then fails (core/redis.py). Clients that never block use REDIS_SOCKET_TIMEOUT; those
# that block (the Channels layer's BZPOPMIN for 5 s, Celery's BRPOP) use the blocking one,
# far above their longest block.
#: The socket timeout of Redis clients that never block (seconds).
REDIS_SOCKET_TIMEOUT = envfloat("REDIS_SOCKET_TIMEOUT", 10.0)
#: The socket timeout of Redis clients that block: Channels, Celery (seconds).
REDIS_BLOCKING_SOCKET_TIMEOUT = envfloat("REDIS_BLOCKING_SOCKET_TIMEOUT", 60.0)

#: Django's cache: Redis at REDIS_URL (with Sentinel, the master it names: core.redis.SentinelPool).
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "OPTIONS": {
            "socket_timeout": REDIS_SOCKET_TIMEOUT,
            "socket_connect_timeout": 2,
            **({"pool_class": "core.redis.SentinelPool"} if REDIS_SENTINELS else {}),
        },
    }
}


def channel_layers(url: str, prefix: str) -> dict[str, Any]:
    """The Channels layer on Redis at ``url``, or with Sentinel on the master it names (``url``
    then gives the database and the master's password: channels_redis asks Sentinel itself)."""
    host: dict[str, Any] = {
        "socket_timeout": REDIS_BLOCKING_SOCKET_TIMEOUT,
        "socket_connect_timeout": 2,
        "health_check_interval": 30,
    }
    if REDIS_SENTINELS:
        options = parse_url(url)  # type: ignore[no-untyped-call]
        host |= {
            "master_name": REDIS_SENTINEL_MASTER,
            "sentinels": REDIS_SENTINELS,
            "sentinel_kwargs": {"password": REDIS_SENTINEL_PASSWORD, "socket_connect_timeout": 2},
            **{k: v for k, v in options.items() if k in ("db", "username", "password")},
        }
    else:
        host["address"] = url
    return {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [host], "prefix": prefix},
        }
    }


#: Channels' layer: Redis at REDIS_URL, channel names under REDIS_NAMESPACE.
CHANNEL_LAYERS = channel_layers(REDIS_URL, f"{REDIS_NAMESPACE}:channels")
