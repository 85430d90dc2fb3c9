"""Celery tasks of accounts and billing (take ids, call a service, idempotent)."""

from __future__ import annotations

from celery import shared_task

from billing.usage import persist_budget_alerts, persist_usage_stream


@shared_task(ignore_result=True)
def usage_persist() -> int:
    """Usage events from Redis into PostgreSQL (every second, idempotent).

    Budget alerts have their own task, so that nothing about an alert can hold up usage.
    """
    return persist_usage_stream()


@shared_task(ignore_result=True)
def budget_alerts_persist() -> int:
    """Budget alerts from Redis into BudgetAlert rows (every second, idempotent)."""
    return persist_budget_alerts()
