"""Celery tasks of the registry (take ids, call a service, idempotent)."""

from __future__ import annotations

from celery import shared_task
from django.dispatch import receiver

from registry.bundled_import import import_run
from registry.signals import bundled_import_queued


# Minutes on a laptop; the limit frees the slow queue from a conversion that hangs, well after
# the console's claim has lapsed (registry.bundled_import.STALE_AFTER, 15 min without progress).
@shared_task(ignore_result=True, acks_late=False, time_limit=3600)
def bundled_models_import(force: bool = False) -> int:
    """Import the bundled models (``registry.bundled``), recording progress for the console.

    Idempotent: a model whose stored artifact is current is left alone. Acknowledged on
    receipt, not at the end: a worker lost mid-import must not start a minutes-long
    conversion again on its own (the console's button does, once the claim lapses)."""
    return len(import_run(force=force))


@receiver(bundled_import_queued, dispatch_uid="registry.tasks.queue_bundled_models_import")
def queue_bundled_models_import(sender: object, *, force: bool, **kwargs: object) -> None:
    """A claimed import of the bundled models runs as ``bundled_models_import`` on the slow queue."""
    bundled_models_import.delay(force=force)
