"""What billing's writes announce to whoever acts on it later (Celery tasks), so that the
services never import the tasks that call them."""

from __future__ import annotations

from django.dispatch import Signal

# Sent once an invoice's finalization has committed; ``invoice_id``. billing.tasks queues
# its email.
invoice_finalized = Signal()

# Sent once new budget alerts are committed (billing.usage.persist_budget_alerts);
# ``alert_ids``, the run's new alerts. billing.tasks queues their email.
budget_alerts_stored = Signal()
