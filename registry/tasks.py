"""Celery tasks of the registry (take ids, call a service, idempotent)."""

from __future__ import annotations

from celery import shared_task

# The canary controller judges versions by their usage records, which are billing's: this
# entry point hands billing's read to the controller, whose module never imports billing.
from billing.served_requests import served_requests
from registry.canary import canary_tick as canary_controller_tick


# Hard time limits only, as in billing.tasks: a soft one would be caught as one canary's failure.
@shared_task(ignore_result=True, time_limit=60)
def canary_tick() -> int:
    """Judge every running canary whose interval boundary has come (every few seconds,
    idempotent: each canary's row is locked and its boundary moved on in one transaction)."""
    return len(canary_controller_tick(load_samples=served_requests))


# Minutes on a laptop; the limit frees the slow queue from a conversion that hangs, well after
# the console's claim has lapsed (registry.bundled_import.STALE_AFTER, 15 min without progress).
@shared_task(ignore_result=True, acks_late=False, time_limit=3600)
def bundled_models_import(force: bool = False) -> int:
    """Import the bundled models (``registry.bundled``), recording progress for the console.

    Idempotent: a model whose stored artifact is current is left alone. Acknowledged on
    receipt, not at the end: a worker lost mid-import must not start a minutes-long
    conversion again on its own (the console's button does, once the claim lapses)."""
    from registry.bundled_import import import_run

    return len(import_run(force=force))
