"""The services the platform stands on: PostgreSQL, Redis (cache, Channels layer, key
namespace). With no DATABASE_URL / REDIS_URL the embedded servers (core/embedded.py) are used."""

from __future__ import annotations

import os
from typing import Any

import dj_database_url

from core import embedded

from .env import envfloat, envint

#: PostgreSQL's URL (postgresql://...; default: the embedded server).
DATABASE_URL = os.environ.get("DATABASE_URL") or embedded.database_url()
#: Redis's URL (redis://host:port/db; default: the embedded server).
REDIS_URL = os.environ.get("REDIS_URL") or embedded.redis_url()
# Pub/sub channels are not scoped by Redis database number; every channel name and shared
# key carries this namespace so a test run never talks to a running platform.
#: The prefix of every Redis key and channel name the platform uses (a string).
REDIS_NAMESPACE = os.environ.get("REDIS_NAMESPACE", "ip")

#: Django's database: DATABASE_URL with a psycopg 3 pool of DB_POOL_SIZE (default 10) connections.
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0, conn_health_checks=False)}
DATABASES["default"]["OPTIONS"] = {
    # psycopg 3 connection pool: daphne serves many requests on few threads.
    "pool": {"min_size": 1, "max_size": envint("DB_POOL_SIZE", 10), "timeout": 10},
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

#: Django's cache: Redis at REDIS_URL.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "OPTIONS": {"socket_timeout": REDIS_SOCKET_TIMEOUT, "socket_connect_timeout": 2},
    }
}


def channel_layers(url: str, prefix: str) -> dict[str, Any]:
    host = {
        "address": url,
        "socket_timeout": REDIS_BLOCKING_SOCKET_TIMEOUT,
        "socket_connect_timeout": 2,
        "health_check_interval": 30,
    }
    return {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [host], "prefix": prefix},
        }
    }


#: Channels' layer: Redis at REDIS_URL, channel names under REDIS_NAMESPACE.
CHANNEL_LAYERS = channel_layers(REDIS_URL, f"{REDIS_NAMESPACE}:channels")
