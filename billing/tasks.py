"""Celery tasks of accounts and billing (take ids, call a service, idempotent)."""

from __future__ import annotations

from celery import shared_task

from billing.usage import persist_budget_alerts, persist_usage_stream


@shared_task(ignore_result=True)
def usage_persist() -> int:
    """Usage events and budget alerts from Redis into PostgreSQL (every second, idempotent)."""
    persist_budget_alerts()
    return persist_usage_stream()
