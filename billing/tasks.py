"""Celery tasks of accounts and billing (take ids, call a service, idempotent)."""

from __future__ import annotations

from celery import shared_task

from billing.usage import persist_usage_stream


@shared_task(ignore_result=True)
def usage_persist() -> int:
    return persist_usage_stream()
