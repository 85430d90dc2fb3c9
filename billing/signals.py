"""What billing's writes announce to whoever acts on it later (Celery tasks), so that the
services never import the tasks that call them."""

from __future__ import annotations

from django.dispatch import Signal

# Sent once an invoice's finalization has committed; ``invoice_id``. billing.tasks queues
# its email.
invoice_finalized = Signal()
