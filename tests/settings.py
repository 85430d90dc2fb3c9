"""Test settings: the same real services as `make run`, isolated from a running platform.

PostgreSQL: pytest-django creates its own ``test_<name>`` database on the same server.
Redis: another database number and another namespace for pub/sub channels.
"""

from __future__ import annotations

import os

from console import embedded
from console.settings import *  # noqa: F403
from console.settings import DATABASES

REDIS_URL = os.environ.get("TEST_REDIS_URL") or (
    os.environ["REDIS_URL"].rsplit("/", 1)[0] + "/9" if os.environ.get("REDIS_URL") else embedded.redis_url(db=9)
)
REDIS_NAMESPACE = "ip-test"
CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}
CHANNEL_LAYERS = {
    "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL], "prefix": "test"}},
}
CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_ALWAYS_EAGER = False

# Fast hashing: tests create users often; production keeps Django's default.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DATABASES["default"]["TEST"] = {"NAME": "test_inference"}
# Tests that need replicas wait for them explicitly.
READY_MODELS = list[str]()
LIMITS_TEST_CLOCK = True
