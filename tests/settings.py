"""Test settings: the same real services as `make run`, isolated from a running platform.

PostgreSQL: pytest-django creates its own ``test_<name>`` database on the same server.
Redis: another database number and another namespace for keys and pub/sub channels.

``TEST_SESSION=N`` (1 to 6) gives a second pytest run of its own database, Redis database
and namespace, so two runs on one machine never touch each other's state.
"""

from __future__ import annotations

import os

from console.settings import *  # noqa: F403
from console.settings import CACHES, DATABASES, broker_url, channel_layers
from core import embedded

TEST_SESSION = int(os.environ.get("TEST_SESSION", "0"))
if not 0 <= TEST_SESSION <= 6:
    raise ValueError("TEST_SESSION must be between 0 and 6")
_SUFFIX = f"_{TEST_SESSION}" if TEST_SESSION else ""
_REDIS_DB = 9 + TEST_SESSION

REDIS_URL = os.environ.get("TEST_REDIS_URL") or (
    os.environ["REDIS_URL"].rsplit("/", 1)[0] + f"/{_REDIS_DB}"
    if os.environ.get("REDIS_URL")
    else embedded.redis_url(db=_REDIS_DB)
)
REDIS_NAMESPACE = f"ip-test{_SUFFIX}"
CACHES = {"default": {**CACHES["default"], "LOCATION": REDIS_URL}}
CHANNEL_LAYERS = channel_layers(REDIS_URL, f"{REDIS_NAMESPACE}:channels")
CELERY_BROKER_URL = broker_url(REDIS_URL)
CELERY_TASK_ALWAYS_EAGER = False

# Fast hashing: tests create users often; production keeps Django's default.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DATABASES["default"]["TEST"] = {"NAME": f"test_inference{_SUFFIX}"}
# Tests that need replicas wait for them explicitly.
READY_MODELS = list[str]()
LIMITS_TEST_CLOCK = True

# A semantic hit is not sampled for an audit in tests unless a test asks for it (a 2 % draw
# would make "the second ask is a hit" flaky); the budget's own tests set it.
SEMANTIC_CACHE_AUDIT_RATE = float(os.environ.get("SEMANTIC_CACHE_AUDIT_RATE", "0"))
# The cache's local models (the paraphrase tier's embedder and verifier) only where a test asks
# for them (the ``cache_verifier`` fixture, which builds them once): elsewhere a lookup embeds
# through the (fake) embedding replica, as those tests expect.
SEMANTIC_CACHE_VERIFIER_DIR = os.environ.get("TEST_SEMANTIC_CACHE_VERIFIER_DIR", str(embedded.VAR_DIR / "no-verifier"))
