"""Settings for the inference platform: one file, configured from the environment."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from pathlib import Path
from typing import Any

import dj_database_url
import django_stubs_ext
from celery.schedules import crontab
from django.core.exceptions import ImproperlyConfigured
from kombu import Exchange, Queue

from core import embedded

BASE_DIR = Path(__file__).resolve().parent.parent

# Lets admin classes and querysets be subscripted (ModelAdmin[Model]) at run time.
django_stubs_ext.monkeypatch()


def envbool(name: str, default: str) -> bool:
    return os.environ.get(name, default).lower() in {"1", "true", "yes", "on"}


def envint(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


def envfloat(name: str, default: float) -> float:
    return float(os.environ.get(name, str(default)))


def envlist(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def development_secret_key(path: Path) -> str:
    """The development SECRET_KEY: made once and kept in ``path`` (mode 0600), so that
    `make run` needs no configuration and sessions survive restarts.

    Created atomically: written to a private temporary file, then linked into place, so
    processes starting at once agree on one key and none ever reads a half-written file.
    """
    with contextlib.suppress(FileNotFoundError):
        existing = path.read_text().strip()
        if existing:
            return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(64) + "\n")
        with contextlib.suppress(FileExistsError):  # another process made it first: use that one
            os.link(draft, path)
    finally:
        draft.unlink(missing_ok=True)
    key = path.read_text().strip()
    if not key:
        raise ImproperlyConfigured(f"{path} is empty: delete it and a new SECRET_KEY is made")
    return key


# "development" (the default: `make run` with no configuration) or "production", which
# requires a SECRET_KEY and turns on HTTPS-only cookies, HSTS and the HTTPS redirect.
PLATFORM_ENV = os.environ.get("PLATFORM_ENV", "development").strip().lower()
if PLATFORM_ENV not in {"development", "production"}:
    raise ImproperlyConfigured(f"PLATFORM_ENV must be 'development' or 'production', not {PLATFORM_ENV!r}")
PRODUCTION = PLATFORM_ENV == "production"

DEBUG = envbool("DEBUG", "false")
if PRODUCTION and DEBUG:
    raise ImproperlyConfigured("DEBUG must be off when PLATFORM_ENV=production")
SECRET_KEY = os.environ.get("SECRET_KEY", "").strip()
if not SECRET_KEY:
    if PRODUCTION:
        raise ImproperlyConfigured("SECRET_KEY must be set when PLATFORM_ENV=production")
    SECRET_KEY = development_secret_key(embedded.VAR_DIR / "secret_key")
ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS", "")

# --- HTTP security ---------------------------------------------------------------------
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = "same-origin"
# Behind a TLS-terminating proxy that sets X-Forwarded-Proto (and strips it from clients).
TRUST_PROXY_HEADERS = envbool("TRUST_PROXY_HEADERS", "false")
if TRUST_PROXY_HEADERS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
if PRODUCTION:
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_SSL_REDIRECT = envbool("SECURE_SSL_REDIRECT", "true")
    # Probes and the Prometheus scrape reach the process directly, over plain HTTP.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
    SECURE_HSTS_SECONDS = envint("SECURE_HSTS_SECONDS", 31_536_000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = envbool("SECURE_HSTS_INCLUDE_SUBDOMAINS", "true")
    SECURE_HSTS_PRELOAD = envbool("SECURE_HSTS_PRELOAD", "true")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI and Redoc served from static, never from a CDN
    "channels",
    "console",
    "accounts",
    "registry",
    "serving",
    "billing",
    "rollout",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "console.urls"
ASGI_APPLICATION = "console.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.pages.nav.navigation",
            ],
            # The house formats (money, UTC times) in every template without a {% load %}.
            "builtins": ["console.templatetags.formats"],
        },
    },
]

# --- Services -------------------------------------------------------------------------
# With no DATABASE_URL / REDIS_URL the embedded servers (core/embedded.py) are used.
DATABASE_URL = os.environ.get("DATABASE_URL") or embedded.database_url()
REDIS_URL = os.environ.get("REDIS_URL") or embedded.redis_url()
# Pub/sub channels are not scoped by Redis database number; every channel name and shared
# key carries this namespace so a test run never talks to a running platform.
REDIS_NAMESPACE = os.environ.get("REDIS_NAMESPACE", "ip")

DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0, conn_health_checks=False)}
DATABASES["default"]["OPTIONS"] = {
    # psycopg 3 connection pool: daphne serves many requests on few threads.
    "pool": {"min_size": 1, "max_size": envint("DB_POOL_SIZE", 10), "timeout": 10},
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# redis-py 8 defaults every connection's socket_timeout to 5 s, and a read that blocks that
# long then fails (core/redis.py). Clients that never block use REDIS_SOCKET_TIMEOUT; those
# that block (the Channels layer's BZPOPMIN for 5 s, Celery's BRPOP) use the blocking one,
# far above their longest block.
REDIS_SOCKET_TIMEOUT = envfloat("REDIS_SOCKET_TIMEOUT", 10.0)
REDIS_BLOCKING_SOCKET_TIMEOUT = envfloat("REDIS_BLOCKING_SOCKET_TIMEOUT", 60.0)

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


CHANNEL_LAYERS = channel_layers(REDIS_URL, f"{REDIS_NAMESPACE}:channels")

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", REDIS_URL)
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "socket_timeout": REDIS_BLOCKING_SOCKET_TIMEOUT,
    "socket_connect_timeout": 5,
    "health_check_interval": 25,
}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TIMEZONE = "UTC"
# Queues apart, one worker each (runplatform starts `celery worker -Q <queue>` per queue), so
# that nothing slow ever waits in front of metering or a rollback:
#   metering: usage records, budget alert rows and the lost-request sweeper; every 1 to 10 s,
#             each run bounded by its batch sizes. Invoices and the canaries read what it writes.
#   control:  the canary controller and the autoscaler; every 2 and 15 s, short.
#   slow:     whatever waits on something outside or grows with the data: the bundled models'
#             import (minutes), e-mail (an SMTP server may hang), invoice drafting, rollups,
#             reconciliation, the semantic-cache purge. Each catches up from where it stopped,
#             so minutes of lag there are harmless.
#   batch:    batch jobs' lines (serving.batches.jobs) and webhooks (serving.batches.webhooks): hours of work
#             at a low priority, never in front of anything above.
CELERY_TASK_QUEUES = [
    Queue(name, Exchange(name), routing_key=name) for name in ("metering", "control", "slow", "batch")
]
# A route naming no known queue fails when sent instead of filling a queue no worker reads.
CELERY_TASK_CREATE_MISSING_QUEUES = False
# A task left out of the routes (tests/console/test_celery_queues.py fails for it) lands here.
CELERY_TASK_DEFAULT_QUEUE = "slow"
CELERY_TASK_ROUTES = {
    task: {"queue": queue}
    for queue, tasks in {
        "metering": ("billing.tasks.usage_persist", "billing.tasks.budget_alerts_persist",
                     "serving.tasks.usage_sweep_lost"),
        "control": ("rollout.tasks.canary_tick", "rollout.tasks.autoscale_tick"),
        "slow": ("registry.tasks.bundled_models_import", "billing.tasks.invoices_draft_due",
                 "billing.tasks.invoice_email", "billing.tasks.budget_alerts_email",
                 "billing.tasks.budget_alerts_notify_pending", "billing.tasks.usage_rollups_build",
                 "billing.tasks.usage_reconcile", "billing.tasks.usage_reconcile_month",
                 "serving.tasks.cache_purge_expired"),
        "batch": ("serving.tasks.batch_work", "serving.tasks.webhooks_deliver"),
    }.items()
    for task in tasks
}  # fmt: skip

# --- Artifacts and bundled models -----------------------------------------------------
# The artifact store is pluggable: swap BACKEND for an object-store implementation of
# registry.artifacts.ArtifactStore without touching callers.
ARTIFACT_STORE: dict[str, Any] = {
    "BACKEND": os.environ.get("ARTIFACT_STORE_BACKEND", "registry.artifacts.LocalArtifactStore"),
    "OPTIONS": {"root": os.environ.get("ARTIFACT_ROOT", str(embedded.VAR_DIR / "artifacts"))},
}
# The largest artifact the console accepts as an upload (the request body: a folder's files or
# one .tar/.zip, and the unpacked size of an archive). Uploads stream to temporary files.
ARTIFACT_UPLOAD_MAX_BYTES = envint("ARTIFACT_UPLOAD_MAX_BYTES", 2 * 1024**3)

# --- Data plane -----------------------------------------------------------------------
ENGINE_CONNECT_TIMEOUT = envfloat("ENGINE_CONNECT_TIMEOUT", 2.0)
ENGINE_FIRST_TOKEN_TIMEOUT = envfloat("ENGINE_FIRST_TOKEN_TIMEOUT", 30.0)
ENGINE_REQUEST_TIMEOUT = envfloat("ENGINE_REQUEST_TIMEOUT", 600.0)
ENGINE_CONNECT_RETRIES = envint("ENGINE_CONNECT_RETRIES", 2)
# A request whose engine fails before its first byte reaches the client is retried once, on
# another replica of its version or the model's base version (serving.llm.call).
ENGINE_FALLBACK = envbool("ENGINE_FALLBACK", "true")
# The largest /v1 request body accepted; larger ones get 413 before they are read.
API_MAX_BODY_BYTES = envint("API_MAX_BODY_BYTES", 4 * 1024 * 1024)
# The Files API (/v1/files, serving.batches.files): the largest upload and the most requests in one file.
FILES_MAX_BYTES = envint("FILES_MAX_BYTES", 100 * 1024 * 1024)
FILES_MAX_LINES = envint("FILES_MAX_LINES", 50_000)
# Batch output and error files are kept this long, then deleted (OpenAI keeps them 30 days).
FILES_OUTPUT_RETENTION_DAYS = envint("FILES_OUTPUT_RETENTION_DAYS", 30)
# Uploaded batch input files are deleted this long after their upload, unless a batch that
# has not finished still reads them (then once it has).
FILES_INPUT_RETENTION_DAYS = envint("FILES_INPUT_RETENTION_DAYS", 30)
# What one organisation may keep in the Files API, every purpose together (its batches' output
# and error files count; only uploads are refused past it: 403 storage_quota_exceeded).
FILES_ORG_MAX_BYTES = envint("FILES_ORG_MAX_BYTES", 10 * 1024**3)
FILES_ORG_MAX_FILES = envint("FILES_ORG_MAX_FILES", 10_000)

# --- Batch jobs (serving.batches.jobs) ----------------------------------------------------------
# A batch's completion windows (OpenAI's is "24h"; more may be offered as "<n>h").
BATCH_COMPLETION_WINDOWS = tuple(os.environ.get("BATCH_COMPLETION_WINDOWS", "24h").split(","))
# Lines an organisation may have waiting or running in its unfinished batches, all together.
BATCH_MAX_ENQUEUED_LINES = envint("BATCH_MAX_ENQUEUED_LINES", 200_000)
# A worker's lines in flight per routable replica of a model that no interactive request
# holds: each interactive request in flight on the model takes a replica's share back.
BATCH_SLOTS_PER_REPLICA = envint("BATCH_SLOTS_PER_REPLICA", 4)
# After interactive requests of a model were last seen in flight, batch lines wait this long
# before taking its replicas again (the gap between two requests is not idle capacity).
BATCH_YIELD_SECONDS = envfloat("BATCH_YIELD_SECONDS", 2.0)
# Lines of a model kept in flight whatever the interactive load: 0 (the default) lets a batch
# wait out interactive traffic (within its completion window); 1 keeps it moving, slowly.
BATCH_MIN_SLOTS = envint("BATCH_MIN_SLOTS", 0)
# Lines beyond the share when interactive requests arrive stop at once (their engine request
# is cancelled, vLLM aborts it) and run again later, uncounted as a failure.
BATCH_PREEMPT = envbool("BATCH_PREEMPT", "true")
# How often a worker with lines in flight looks for interactive requests on their models.
BATCH_YIELD_POLL_SECONDS = envfloat("BATCH_YIELD_POLL_SECONDS", 0.05)
# How long a worker's claim on a running line lasts; renewed while it runs. A line whose
# claim ran out (its worker died) is given back and run again.
BATCH_LEASE_SECONDS = envfloat("BATCH_LEASE_SECONDS", 30.0)
# How many times a line is tried when its engine fails (5xx, gone) before it fails.
BATCH_MAX_ATTEMPTS = envint("BATCH_MAX_ATTEMPTS", 5)
# How long one batch_work run goes on before it hands over to the next tick.
BATCH_WORK_SECONDS = envfloat("BATCH_WORK_SECONDS", 50.0)
# vLLM's request priority for batch lines (interactive requests have 0; lower runs first),
# sent only while the engines run with --scheduling-policy priority (ENGINE_SCHEDULING_POLICY).
BATCH_ENGINE_PRIORITY = envint("BATCH_ENGINE_PRIORITY", 10)

# --- Webhooks (serving.batches.webhooks) -----------------------------------------------------------
# Host names webhooks may go to whatever they resolve to (e.g. an internal receiver).
WEBHOOK_ALLOWED_HOSTS = tuple(h for h in os.environ.get("WEBHOOK_ALLOWED_HOSTS", "").split(",") if h)
# Whether webhooks may go to private, loopback or link-local addresses (never by default).
WEBHOOK_ALLOW_PRIVATE_ADDRESSES = envbool("WEBHOOK_ALLOW_PRIVATE_ADDRESSES", "false")
WEBHOOK_TIMEOUT = envfloat("WEBHOOK_TIMEOUT", 10.0)
# Retries: BACKOFF * 2**(attempt-1) seconds apart, at most an hour, until MAX_ATTEMPTS.
WEBHOOK_BACKOFF_SECONDS = envfloat("WEBHOOK_BACKOFF_SECONDS", 10.0)
WEBHOOK_MAX_ATTEMPTS = envint("WEBHOOK_MAX_ATTEMPTS", 8)
# A receiver refuses a signature older than this (what docs/webhooks.md tells them).
WEBHOOK_TOLERANCE_SECONDS = envint("WEBHOOK_TOLERANCE_SECONDS", 300)
# uvicorn processes serving the one port (console.servers): each a gateway of its own.
GATEWAY_PROCESSES = max(1, envint("GATEWAY_PROCESSES", 1))
# Django's own limit for the console and admin (the data plane reads bodies itself).
DATA_UPLOAD_MAX_MEMORY_SIZE = API_MAX_BODY_BYTES
# Bodies larger than this have their prompt counted in one of PROMPT_COUNT_THREADS worker
# threads, off the event loop, after paying their place in the key's per-minute request bucket.
PROMPT_COUNT_INLINE_BYTES = envint("PROMPT_COUNT_INLINE_BYTES", 32 * 1024)
PROMPT_COUNT_THREADS = envint("PROMPT_COUNT_THREADS", 2)
# The platform's own organisation: its admins' memberships, and what platform staff use
# themselves (the console playground) is metered there, never to a customer.
PLATFORM_ORGANIZATION = os.environ.get("PLATFORM_ORGANIZATION", "Platform")
# /metrics answers clients on these networks (the monitoring network), and anyone presenting
# "Authorization: Bearer <METRICS_TOKEN>" when a token is set; everyone else gets 403.
METRICS_ALLOWED_NETWORKS = envlist("METRICS_ALLOWED_NETWORKS", "127.0.0.0/8,::1/128")
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "")
# A write to a client that waits longer than this (the client stopped reading) ends the
# request as the client going away (499): it never holds its place in flight for long.
CLIENT_SEND_TIMEOUT = envfloat("CLIENT_SEND_TIMEOUT", 30.0)
# Requests that may run at once on one WebSocket (each is still charged to its key's limits).
WS_MAX_REQUESTS_PER_SOCKET = envint("WS_MAX_REQUESTS_PER_SOCKET", 256)
# A replica is routed to only while its heartbeat is younger than this: three missed beats
# of WORKER_HEARTBEAT_SECONDS (3 s), so a replica whose supervisor died leaves routing within
# 9 s. It is also how long a database outage the supervisors' heartbeats may ride out.
REPLICA_STALE_AFTER = envfloat("REPLICA_STALE_AFTER", 9.0)
ROUTING_REFRESH_SECONDS = envfloat("ROUTING_REFRESH_SECONDS", 1.0)
ROUTING_MAX_STALENESS = envfloat("ROUTING_MAX_STALENESS", 10.0)
API_KEY_CACHE_SECONDS = envfloat("API_KEY_CACHE_SECONDS", 1.0)
CIRCUIT_FAILURE_THRESHOLD = envint("CIRCUIT_FAILURE_THRESHOLD", 3)
CIRCUIT_OPEN_SECONDS = envfloat("CIRCUIT_OPEN_SECONDS", 10.0)
# Backpressure: a model refuses a tier's new requests once this many per routable replica
# are in flight across all gateways (free first, then paid); nothing queues unboundedly.
BACKPRESSURE_FREE_PER_REPLICA = envint("BACKPRESSURE_FREE_PER_REPLICA", 48)
BACKPRESSURE_PAID_PER_REPLICA = envint("BACKPRESSURE_PAID_PER_REPLICA", 128)
# Tests move the limiter's clock (month boundaries) through a Redis key; never in production.
LIMITS_TEST_CLOCK = envbool("LIMITS_TEST_CLOCK", "false")
# /readyz waits for a routable replica of each of these models.
READY_MODELS = envlist("READY_MODELS", "smollm2-135m-instruct,all-minilm-l6-v2")
# An in-flight request whose gateway stopped heart-beating this long ago is closed by the sweeper.
GATEWAY_HEARTBEAT_SECONDS = envfloat("GATEWAY_HEARTBEAT_SECONDS", 5.0)
GATEWAY_LOST_AFTER = envfloat("GATEWAY_LOST_AFTER", 20.0)
# A usage event or budget alert that fails this many deliveries is parked in its
# dead-letter stream; a failed or abandoned entry is retried after this many seconds.
PERSIST_MAX_DELIVERIES = envint("PERSIST_MAX_DELIVERIES", 5)
PERSIST_RETRY_AFTER_SECONDS = envfloat("PERSIST_RETRY_AFTER_SECONDS", 60.0)


def every(seconds: float, task: str) -> dict[str, Any]:
    """A beat entry for ``task`` every ``seconds``. A run its worker has not started within
    one period is dropped (``expires``): a worker that was busy or down finds one run
    waiting, not a pile of them, and each run catches up on its own."""
    return {"task": task, "schedule": seconds, "options": {"expires": seconds}}


CELERY_BEAT_SCHEDULE = {
    "usage-persist": every(envfloat("USAGE_PERSIST_SECONDS", 1.0), "billing.tasks.usage_persist"),
    # Its own task: nothing about an alert may hold up usage persistence.
    "budget-alerts-persist": every(envfloat("USAGE_PERSIST_SECONDS", 1.0), "billing.tasks.budget_alerts_persist"),
    "usage-sweep-lost-gateways": every(10.0, "serving.tasks.usage_sweep_lost"),
    # Hourly and daily rollups of the records added since the last run (billing.rollups).
    "usage-rollups-build": every(60.0, "billing.tasks.usage_rollups_build"),
    # Each hour, once it is the hour before last: ledger counts = records = rollups.
    "usage-reconcile": every(600.0, "billing.tasks.usage_reconcile"),
    # Last month as a whole, invoices included, once they were drafted (the 1st + grace); a
    # run a day late is still wanted.
    "usage-reconcile-month": {
        "task": "billing.tasks.usage_reconcile_month",
        "schedule": crontab(minute="30", hour="6", day_of_month="2"),
        "options": {"expires": 86400.0},
    },
    # Alerts whose email failed when they were stored are retried this often.
    "budget-alerts-notify": every(
        envfloat("BUDGET_ALERT_RETRY_SECONDS", 60.0), "billing.tasks.budget_alerts_notify_pending"
    ),
    # Hourly; it drafts last month's invoices once INVOICE_GRACE_HOURS have passed, each once.
    "invoices-draft-due": {
        "task": "billing.tasks.invoices_draft_due",
        "schedule": crontab(minute="5"),
        "options": {"expires": 3600.0},
    },
    # Expired semantic-cache entries, deleted in batches, then each scope's size recounted.
    "semantic-cache-purge-expired": every(
        envfloat("SEMANTIC_CACHE_PURGE_SECONDS", 60.0), "serving.tasks.cache_purge_expired"
    ),
    # The autoscaler (rollout.autoscaler, rollout.observations): one pass over every running
    # deployment whose policy is enabled; its changes are audited ("autoscale").
    "autoscale-tick": every(envfloat("AUTOSCALER_TICK_SECONDS", 15.0), "rollout.tasks.autoscale_tick"),
    # Each running canary is judged at its own interval boundaries; this is only how often
    # the controller looks for boundaries that have come (rollout.canary).
    "canary-tick": every(envfloat("CANARY_TICK_SECONDS", 2.0), "rollout.tasks.canary_tick"),
    # Batch jobs: start, resume, run, expire and finish them (serving.batches.jobs); a run works
    # until there is nothing to do or BATCH_WORK_SECONDS pass, and a new batch starts one at once.
    "batch-work": every(envfloat("BATCH_TICK_SECONDS", 5.0), "serving.tasks.batch_work"),
    # Webhooks due (new, or a retry whose backoff has passed).
    "webhooks-deliver": every(envfloat("WEBHOOK_TICK_SECONDS", 5.0), "serving.tasks.webhooks_deliver"),
}

# --- Semantic cache (serving/semcache) ---------------------------------------------------
SEMANTIC_CACHE_ENABLED = envbool("SEMANTIC_CACHE_ENABLED", "true")
# The model that embeds prompts for the cache (384 dimensions: serving.models.CacheEntry).
SEMANTIC_CACHE_EMBEDDING_MODEL = os.environ.get("SEMANTIC_CACHE_EMBEDDING_MODEL", "all-minilm-l6-v2")
# Embedding + search + verification must finish within this, or the request is a miss.
SEMANTIC_CACHE_LOOKUP_TIMEOUT = envfloat("SEMANTIC_CACHE_LOOKUP_TIMEOUT", 0.5)
# Candidates below this cosine similarity are never verified (a guard: docs/architecture.md, "Verification").
SEMANTIC_CACHE_MIN_SIMILARITY = envfloat("SEMANTIC_CACHE_MIN_SIMILARITY", 0.60)
# The share of wrong hits the verifier is calibrated to stay under.
SEMANTIC_CACHE_WRONG_HIT_BUDGET = envfloat("SEMANTIC_CACHE_WRONG_HIT_BUDGET", 0.01)
# The error budget's prior (serving.semcache.budget): the verifier on held-out sources,
# 585 semantic hits served of which 1 was a trap (bench/semantic_cache_sources.py, 2026-11-26).
SEMANTIC_CACHE_PRIOR_SERVED = envfloat("SEMANTIC_CACHE_PRIOR_SERVED", 585)
SEMANTIC_CACHE_PRIOR_WRONG = envfloat("SEMANTIC_CACHE_PRIOR_WRONG", 1)
# The share of would-be hits of an open tier answered by the engine and compared (audits).
SEMANTIC_CACHE_AUDIT_RATE = envfloat("SEMANTIC_CACHE_AUDIT_RATE", 0.02)
# Two answers whose embeddings' cosine reaches this (and whose numbers match) agree.
SEMANTIC_CACHE_AUDIT_AGREEMENT = envfloat("SEMANTIC_CACHE_AUDIT_AGREEMENT", 0.90)
# How long a served cache answer can be reported wrong (POST /v1/cache/feedback).
SEMANTIC_CACHE_FEEDBACK_WINDOW_SECONDS = envint("SEMANTIC_CACHE_FEEDBACK_WINDOW_SECONDS", 7 * 86400)
# Feedback tightens the reported entry and those of its scope at least this similar to it.
SEMANTIC_CACHE_FEEDBACK_NEIGHBOUR_SIMILARITY = envfloat("SEMANTIC_CACHE_FEEDBACK_NEIGHBOUR_SIMILARITY", 0.90)
# Defaults for models without a CachePolicy row.
SEMANTIC_CACHE_MAX_TEMPERATURE = envfloat("SEMANTIC_CACHE_MAX_TEMPERATURE", 0.5)
SEMANTIC_CACHE_MAX_PROMPT_TOKENS = envint("SEMANTIC_CACHE_MAX_PROMPT_TOKENS", 2000)
SEMANTIC_CACHE_TTL_SECONDS = envint("SEMANTIC_CACHE_TTL_SECONDS", 3600)
# The store's search (serving/semcache/store.py; figures in docs/performance.md): scopes of up
# to this many entries are searched exactly, larger ones through the HNSW index with
# pgvector's iterative scan (this many candidates per step, this order, at most this many
# tuples visited).
SEMANTIC_CACHE_EXACT_MAX_ENTRIES = envint("SEMANTIC_CACHE_EXACT_MAX_ENTRIES", 5000)
SEMANTIC_CACHE_HNSW_EF_SEARCH = envint("SEMANTIC_CACHE_HNSW_EF_SEARCH", 40)
SEMANTIC_CACHE_HNSW_ITERATIVE_SCAN = os.environ.get("SEMANTIC_CACHE_HNSW_ITERATIVE_SCAN", "relaxed_order")
SEMANTIC_CACHE_HNSW_MAX_SCAN_TUPLES = envint("SEMANTIC_CACHE_HNSW_MAX_SCAN_TUPLES", 20_000)
# A search statement is cancelled after this long (a miss); at most this many cache calls per
# process wait on the database at once, and after a failure none is tried for this long.
SEMANTIC_CACHE_SEARCH_TIMEOUT_MS = envint("SEMANTIC_CACHE_SEARCH_TIMEOUT_MS", 250)
SEMANTIC_CACHE_MAX_DB_CALLS = envint("SEMANTIC_CACHE_MAX_DB_CALLS", 4)
SEMANTIC_CACHE_RETRY_AFTER = envfloat("SEMANTIC_CACHE_RETRY_AFTER", 5.0)
# Embeddings requests get an exact-match cache (Redis) for this long.
EMBEDDINGS_CACHE_TTL_SECONDS = envint("EMBEDDINGS_CACHE_TTL_SECONDS", 3600)

# --- Engine workers (manage.py runworkers) ---------------------------------------------
WORKER_HOST = os.environ.get("WORKER_HOST") or socket.gethostname()
# "cpu": one replica per listed core (VLLM_CPU_OMP_THREADS_BIND); "gpu": one per GPU index.
WORKER_DEVICE = os.environ.get("WORKER_DEVICE", "cpu")
WORKER_SLOTS = envlist("WORKER_SLOTS", ",".join(str(i) for i in range(os.cpu_count() or 1)))
WORKER_ENGINE_HOST = os.environ.get("WORKER_ENGINE_HOST", "127.0.0.1")
WORKER_HEARTBEAT_SECONDS = envfloat("WORKER_HEARTBEAT_SECONDS", 3.0)
WORKER_STARTUP_TIMEOUT = envfloat("WORKER_STARTUP_TIMEOUT", 600.0)
WORKER_DRAIN_TIMEOUT = envfloat("WORKER_DRAIN_TIMEOUT", 30.0)
WORKER_MAX_BACKOFF = envfloat("WORKER_MAX_BACKOFF", 60.0)
# One supervisor per host name: it holds the host's lease (registry.HostLease), renewed on
# every pass (0.5 s); a second one refuses to start while it runs. One killed with SIGKILL
# can be succeeded this long after its last renewal.
WORKER_HOST_LEASE_SECONDS = envfloat("WORKER_HOST_LEASE_SECONDS", 15.0)
WORKER_LOG_DIR = Path(os.environ.get("WORKER_LOG_DIR", str(embedded.VAR_DIR / "engines")))
VLLM_CPU_KVCACHE_SPACE = envint("VLLM_CPU_KVCACHE_SPACE", 1)
VLLM_GPU_MEMORY_UTILIZATION = envfloat("VLLM_GPU_MEMORY_UTILIZATION", 0.85)
# Upper bound on a replica's context; the model's own max_seq_len applies when smaller.
ENGINE_MAX_MODEL_LEN = envint("ENGINE_MAX_MODEL_LEN", 8192)
ENGINE_EXTRA_ARGS = os.environ.get("ENGINE_EXTRA_ARGS", "")
# vLLM's scheduling policy for the engines runworkers starts: "priority" lets interactive
# requests (priority 0) go before batch jobs' lines (BATCH_ENGINE_PRIORITY), which vLLM
# preempts for them; "fcfs" is vLLM's default (first come, first served).
ENGINE_SCHEDULING_POLICY = os.environ.get("ENGINE_SCHEDULING_POLICY", "priority")
if ENGINE_SCHEDULING_POLICY not in ("priority", "fcfs"):
    raise ValueError("ENGINE_SCHEDULING_POLICY must be priority or fcfs")
# The program a replica runs (its arguments follow). Empty: vLLM's OpenAI server.
WORKER_ENGINE_LAUNCHER = os.environ.get("WORKER_ENGINE_LAUNCHER", "")
# Small models (framework onnx) run in the platform's predict worker, not vLLM: each uses
# this many ONNX Runtime threads, and up to WORKER_PREDICT_PER_SLOT of them share a slot
# (with each other and with a vLLM engine): a small model rarely needs a core of its own.
WORKER_PREDICT_THREADS = envint("WORKER_PREDICT_THREADS", 1)
WORKER_PREDICT_PER_SLOT = envint("WORKER_PREDICT_PER_SLOT", 4)
# A predict request's answer is due from its worker within this (the worker's own batcher
# deadline, the version's batcher.timeout_s, usually ends it first).
PREDICT_REQUEST_TIMEOUT = envfloat("PREDICT_REQUEST_TIMEOUT", 30.0)
# The Open Inference Protocol's gRPC service (manage.py rungrpc, started by runplatform).
GRPC_PORT = envint("GRPC_PORT", 8001)
# How long the exact result cache keeps a deterministic small model's answer (0: off).
PREDICT_RESULT_CACHE_TTL_SECONDS = envint("PREDICT_RESULT_CACHE_TTL_SECONDS", 3600)
# Predict bodies larger than this have their tensors read in one of PREDICT_DECODE_THREADS
# worker threads, off the event loop, after paying their place in the key's per-minute
# request bucket (as large prompts do: PROMPT_COUNT_INLINE_BYTES).
PREDICT_DECODE_INLINE_BYTES = envint("PREDICT_DECODE_INLINE_BYTES", 32 * 1024)
PREDICT_DECODE_THREADS = envint("PREDICT_DECODE_THREADS", 2)

# --- Autoscaler (rollout.autoscaler; each deployment's policy is its ``autoscale`` JSON) ---
# Each replica's /metrics must answer within this, or it counts as not observed.
AUTOSCALER_SCRAPE_TIMEOUT = envfloat("AUTOSCALER_SCRAPE_TIMEOUT", 1.0)
# p99 latency is read over the usage records of this many last seconds, and only from
# this many requests up (fewer: no latency verdict).
AUTOSCALER_WINDOW_SECONDS = envfloat("AUTOSCALER_WINDOW_SECONDS", 60.0)
AUTOSCALER_MIN_SAMPLES = envint("AUTOSCALER_MIN_SAMPLES", 20)
# The quiet period's load is judged in stretches this long (its busiest one counts).
AUTOSCALER_BUCKET_SECONDS = envint("AUTOSCALER_BUCKET_SECONDS", 30)

# --- Auth, i18n, static ---------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "/accounts/login/"
# Failed logins allowed per username within the window (five times as many per address); see console/auth.py.
LOGIN_MAX_FAILURES = envint("LOGIN_MAX_FAILURES", 5)
LOGIN_LOCKOUT_SECONDS = envint("LOGIN_LOCKOUT_SECONDS", 900)
# How often the console's live overview (console/consumers.py) pushes fresh figures.
CONSOLE_LIVE_INTERVAL_SECONDS = envfloat("CONSOLE_LIVE_INTERVAL_SECONDS", 5.0)
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
    "console.staticfinders.PlotlyFinder",  # plotly/plotly.min.js from the plotly package
]
STATIC_ROOT = BASE_DIR / "staticfiles"

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        # Under the login page's lockout (console.auth): no unlimited password guessing.
        "console.auth.RateLimitedBasicAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
}
# The platform's version, as the management API's schema and the Open Inference Protocol's
# server metadata (GET /v2) report it.
PLATFORM_VERSION = "0.1.0"
SPECTACULAR_SETTINGS = {
    "TITLE": "Inference platform management API",
    "VERSION": PLATFORM_VERSION,
    "SERVE_INCLUDE_SCHEMA": False,
    # Served from our static files (drf-spectacular-sidecar): the docs work offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # No badge fetched from Swagger's online validator.
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},
    "ENUM_NAME_OVERRIDES": {
        "RoleEnum": "accounts.models.Role",
        "InvitedRoleEnum": "accounts.models.INVITABLE_ROLES",
        # Every "status" field needs its own name once two choice sets share it.
        "DeploymentStatusEnum": "registry.models.Deployment.Status",
        "InvoiceStatusEnum": "billing.models.Invoice.Status",
    },
    # console.openapi documents the errors every DRF view may answer; the data plane is served
    # by serving.gateway.asgi, not DRF, so serving.openapi adds it to the schema.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "console.openapi.document_errors",
        "serving.openapi.add_data_plane",
    ],
}

# --- Money ------------------------------------------------------------------------------
# Every price, spend cap and invoice is in this currency (ISO 4217).
BILLING_CURRENCY = os.environ.get("BILLING_CURRENCY", "USD")
# Last month's invoices are drafted this long after it ends, so late usage (settlements
# retried after an outage) lands on them; anything later becomes an adjustment next month.
INVOICE_GRACE_HOURS = envfloat("INVOICE_GRACE_HOURS", 12.0)

# --- Email ------------------------------------------------------------------------------
# Invoices and budget alerts go to each organisation's billing_email. The default writes
# every message as a file under $PLATFORM_VAR_DIR/mail/ (nothing leaves the machine);
# EMAIL_BACKEND=django.core.mail.backends.smtp.EmailBackend with EMAIL_HOST etc. sends them.
EMAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.filebased.EmailBackend")
EMAIL_FILE_PATH = os.environ.get("EMAIL_FILE_PATH", str(embedded.VAR_DIR / "mail"))
EMAIL_HOST = os.environ.get("EMAIL_HOST", "localhost")
EMAIL_PORT = envint("EMAIL_PORT", 25)
EMAIL_HOST_USER = os.environ.get("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = os.environ.get("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = envbool("EMAIL_USE_TLS", "false")
EMAIL_USE_SSL = envbool("EMAIL_USE_SSL", "false")
# A mail server that hangs must not hold a worker (alerts are retried, invoices too).
EMAIL_TIMEOUT = envfloat("EMAIL_TIMEOUT", 10.0)
DEFAULT_FROM_EMAIL = os.environ.get("DEFAULT_FROM_EMAIL", "billing@localhost")
SERVER_EMAIL = DEFAULT_FROM_EMAIL

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},  # one INFO line per engine request is noise
        "httpcore": {"level": "WARNING"},
    },
}
