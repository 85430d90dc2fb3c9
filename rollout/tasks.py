"""Celery tasks of rollout's control loops (take nothing, call the loop, idempotent)."""

from __future__ import annotations

from celery import shared_task

from rollout.autoscaler import autoscale_deployments
from rollout.canary import canary_tick as canary_controller_tick
from rollout.observations import observe_deployment
from rollout.predictive import forecast_deployment
from rollout.served_requests import served_requests


# Hard time limits only, as in billing.tasks: a soft one would be caught as one canary's failure.
@shared_task(ignore_result=True, time_limit=60)
def canary_tick() -> int:
    """Judge every running canary whose interval boundary has come (every few seconds,
    idempotent: each canary's row is locked and its boundary moved on in one transaction)."""
    return len(canary_controller_tick(load_samples=served_requests))


@shared_task(ignore_result=True, time_limit=60)
def autoscale_tick() -> int:
    """One autoscaler pass (every AUTOSCALER_TICK_SECONDS): scrape, decide, and set the
    replica count of each autoscaled deployment that needs another; the number changed.
    Idempotent: a pass overlapping another changes a deployment at most once (each change
    names the count it was decided from). A predictive policy adds its profile's forecast."""
    return len(autoscale_deployments(observe=observe_deployment, forecast=forecast_deployment))
