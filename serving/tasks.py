"""Celery tasks of the data plane."""

from __future__ import annotations

from celery import shared_task

from billing.ledger import sweep_lost_requests
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
