"""Celery: the broker, the queues and which task goes to which, and the beat schedule (a new
periodic task gets its route and its beat entry here)."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from celery.schedules import crontab
from kombu import Exchange, Queue

from .env import envfloat
from .rollout import AUTOSCALER_TICK_SECONDS
from .services import (
    REDIS_BLOCKING_SOCKET_TIMEOUT,
    REDIS_SENTINEL_MASTER,
    REDIS_SENTINEL_PASSWORD,
    REDIS_SENTINELS,
    REDIS_URL,
)


def broker_url(redis_url: str) -> str:
    """Celery's broker at ``redis_url``, or with Sentinel kombu's ``sentinel://`` transport: one
    URL per Sentinel, each with REDIS_URL's password and database (the master's)."""
    if not REDIS_SENTINELS:
        return redis_url
    parts = urlsplit(redis_url)
    auth = parts.netloc.rpartition("@")[0]
    return ";".join(
        f"sentinel://{auth + '@' if auth else ''}{host}:{port}{parts.path or '/0'}" for host, port in REDIS_SENTINELS
    )


#: The broker's URL (default: REDIS_URL, or with REDIS_SENTINELS its Sentinels: sentinel://…;sentinel://…).
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or broker_url(REDIS_URL)
#: The broker's Redis socket options (seconds), and with Sentinel the master's name.
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, Any] = {
    "socket_timeout": REDIS_BLOCKING_SOCKET_TIMEOUT,
    "socket_connect_timeout": 5,
    "health_check_interval": 25,
}
if REDIS_SENTINELS:
    CELERY_BROKER_TRANSPORT_OPTIONS |= {
        "master_name": REDIS_SENTINEL_MASTER,
        "sentinel_kwargs": {"password": REDIS_SENTINEL_PASSWORD, "socket_connect_timeout": 5},
    }
#: A worker keeps retrying the broker when it starts before it (a bool).
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
#: No result backend: tasks write what they produce to the database themselves.
CELERY_RESULT_BACKEND = None
#: A task is acknowledged once it has run, not when it is received (a bool).
CELERY_TASK_ACKS_LATE = True
#: A task whose worker died is queued again (a bool).
CELERY_TASK_REJECT_ON_WORKER_LOST = True
#: Tasks a worker reserves beyond the one it runs, per process (a count).
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
#: The beat schedule's time zone (a tz database name).
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
#   batch:    batch jobs' lines (serving.batches) and webhooks (serving.batches.webhooks): hours of work
#             at a low priority, never in front of anything above.
#: The task queues: metering, control, slow, batch (kombu Queues).
CELERY_TASK_QUEUES = [
    Queue(name, Exchange(name), routing_key=name) for name in ("metering", "control", "slow", "batch")
]
# A route naming no known queue fails when sent instead of filling a queue no worker reads.
#: Sending to an unknown queue is an error (a bool).
CELERY_TASK_CREATE_MISSING_QUEUES = False
# A task left out of the routes (tests/console/test_celery_queues.py fails for it) lands here.
#: The queue of a task with no route (a queue name).
CELERY_TASK_DEFAULT_QUEUE = "slow"
#: Each task's queue (task name to {"queue": name}).
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


def every(seconds: float, task: str) -> dict[str, Any]:
    """A beat entry for ``task`` every ``seconds``. A run its worker has not started within
    one period is dropped (``expires``): a worker that was busy or down finds one run
    waiting, not a pile of them, and each run catches up on its own."""
    return {"task": task, "schedule": seconds, "options": {"expires": seconds}}


#: How often usage records and budget alerts are moved from Redis into PostgreSQL (seconds).
USAGE_PERSIST_SECONDS = envfloat("USAGE_PERSIST_SECONDS", 1.0)
#: How often budget alerts whose email failed are sent again (seconds).
BUDGET_ALERT_RETRY_SECONDS = envfloat("BUDGET_ALERT_RETRY_SECONDS", 60.0)
#: How often expired semantic-cache entries are purged (seconds).
SEMANTIC_CACHE_PURGE_SECONDS = envfloat("SEMANTIC_CACHE_PURGE_SECONDS", 60.0)
#: How often the canary controller looks for interval boundaries that have come (seconds).
CANARY_TICK_SECONDS = envfloat("CANARY_TICK_SECONDS", 2.0)
#: How often batch jobs are started, resumed, run, expired and finished (seconds).
BATCH_TICK_SECONDS = envfloat("BATCH_TICK_SECONDS", 5.0)
#: How often webhooks due are delivered (seconds).
WEBHOOK_TICK_SECONDS = envfloat("WEBHOOK_TICK_SECONDS", 5.0)

#: The periodic tasks celery beat sends (entry name to task, schedule in seconds or crontab).
CELERY_BEAT_SCHEDULE = {
    "usage-persist": every(USAGE_PERSIST_SECONDS, "billing.tasks.usage_persist"),
    # Its own task: nothing about an alert may hold up usage persistence.
    "budget-alerts-persist": every(USAGE_PERSIST_SECONDS, "billing.tasks.budget_alerts_persist"),
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
    "budget-alerts-notify": every(BUDGET_ALERT_RETRY_SECONDS, "billing.tasks.budget_alerts_notify_pending"),
    # Hourly; it drafts last month's invoices once INVOICE_GRACE_HOURS have passed, each once.
    "invoices-draft-due": {
        "task": "billing.tasks.invoices_draft_due",
        "schedule": crontab(minute="5"),
        "options": {"expires": 3600.0},
    },
    # Expired semantic-cache entries, deleted in batches, then each scope's size recounted.
    "semantic-cache-purge-expired": every(SEMANTIC_CACHE_PURGE_SECONDS, "serving.tasks.cache_purge_expired"),
    # The autoscaler (rollout.autoscaler, rollout.observations): one pass over every running
    # deployment whose policy is enabled; its changes are audited ("autoscale").
    "autoscale-tick": every(AUTOSCALER_TICK_SECONDS, "rollout.tasks.autoscale_tick"),
    # Each running canary is judged at its own interval boundaries; this is only how often
    # the controller looks for boundaries that have come (rollout.canary).
    "canary-tick": every(CANARY_TICK_SECONDS, "rollout.tasks.canary_tick"),
    # Batch jobs: start, resume, run, expire and finish them (serving.batches); a run works
    # until there is nothing to do or BATCH_WORK_SECONDS pass, and a new batch starts one at once.
    "batch-work": every(BATCH_TICK_SECONDS, "serving.tasks.batch_work"),
    # Webhooks due (new, or a retry whose backoff has passed).
    "webhooks-deliver": every(WEBHOOK_TICK_SECONDS, "serving.tasks.webhooks_deliver"),
}
