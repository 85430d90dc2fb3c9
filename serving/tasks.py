"""Celery tasks of the data plane."""

from __future__ import annotations

from celery import shared_task

from serving.metering import sweep_lost_requests


@shared_task(ignore_result=True)
def usage_sweep_lost() -> int:
    return sweep_lost_requests()
