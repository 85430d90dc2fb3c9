"""Runs of the data plane's Celery tasks, queued by their registered names.

A task calls a service and a service never imports the tasks that call it: ``serving.tasks``
imports the batch and webhook services, and they queue its runs here, by name, through the
broker. Queuing never raises: a broker that is away leaves the run to the beat's next tick.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import current_app

logger = logging.getLogger(__name__)

BATCH_WORK = "serving.tasks.batch_work"
WEBHOOKS_DELIVER = "serving.tasks.webhooks_deliver"


def queue(name: str, **options: Any) -> bool:
    """Queue one run of the task ``name`` now; False (logged) when the broker refused it."""
    try:
        current_app.send_task(name, **options)
    except Exception:  # the broker is away: the beat's next tick starts it
        logger.warning("could not queue %s; the beat's next run sends it", name, exc_info=True)
        return False
    return True
