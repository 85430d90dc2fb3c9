"""What the registry's writes announce to whoever acts on them later (Celery tasks), so that
the services never import the tasks that call them (as billing/signals.py)."""

from __future__ import annotations

from django.dispatch import Signal

# Sent once a claimed import of the bundled models has committed (its audit entry);
# ``force``. registry.tasks queues ``bundled_models_import``.
bundled_import_queued = Signal()
