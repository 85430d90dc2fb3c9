"""Celery tasks of the data plane."""

from __future__ import annotations

import asyncio

from celery import shared_task
from django.conf import settings

from billing.ledger import sweep_lost_requests
from serving.batches.webhooks import webhooks_deliver_due
from serving.batches.worker import work
from serving.semcache.store import purge_expired, scope_sizes_refresh


# Hard time limits only, as in billing.tasks: a soft one would be caught as one item's failure.
@shared_task(ignore_result=True, time_limit=60)
def usage_sweep_lost() -> int:
    """Settle the requests of gateways that died mid-request (every 10 s, idempotent)."""
    return sweep_lost_requests()


@shared_task(ignore_result=True, time_limit=600)
def cache_purge_expired() -> int:
    """Delete expired semantic-cache entries in batches, then recount each scope's entries
    (the search plan's input); every minute, idempotent."""
    purged = purge_expired()
    scope_sizes_refresh()
    return purged


@shared_task(ignore_result=True, time_limit=300)
def webhooks_deliver() -> int:
    """Send the webhooks that are due, with their retries (every 5 s, and on each new one;
    idempotent: concurrent runs take different deliveries)."""
    return webhooks_deliver_due()


# Past BATCH_WORK_SECONDS a run stops taking lines and finishes those in flight (each bounded
# by ENGINE_REQUEST_TIMEOUT); a run killed at this limit leaves its lines to be given back.
@shared_task(ignore_result=True, time_limit=3600)
def batch_work() -> int:
    """Run batch jobs' lines for a while (serving.batches.worker.work); every BATCH_TICK_SECONDS and
    when a batch is created or cancelled. Several workers share the lines."""
    return asyncio.run(work(seconds=settings.BATCH_WORK_SECONDS))
