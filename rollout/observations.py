"""What the autoscaler sees of a deployment: its engines' queues, scraped from their /metrics,
and its recent latency and load, from the usage records of the version it serves."""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import httpx
from django.conf import settings
from django.db.models import Aggregate, Count, F, FloatField, Func, IntegerField, QuerySet, Sum
from django.utils import timezone

from billing.models import CacheOutcome, UsageRecord
from registry.models import Deployment, Replica
from registry.replica_keys import replica_api_key
from registry.selectors import heartbeat_fresh_after
from rollout.autoscaler import AutoscalePolicy, Observations

logger = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"


def engine_load(metrics_text: str) -> tuple[float, float]:
    """(waiting, running) from a vLLM /metrics page: each gauge summed over its label sets
    (one per engine core); a name is matched whole, never as a prefix of a longer one."""
    totals = {WAITING: 0.0, RUNNING: 0.0}
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            with contextlib.suppress(ValueError):
                totals[name] += float(line.rsplit(" ", 1)[-1])
    return totals[WAITING], totals[RUNNING]


def scrape_replica(client: httpx.Client, replica_id: int, endpoint: str) -> tuple[float, float] | None:
    """The replica's (waiting, running), or None when it does not answer in time."""
    try:
        response = client.get(f"{endpoint}/metrics", headers={"Authorization": f"Bearer {replica_api_key(replica_id)}"})
        response.raise_for_status()
    except httpx.HTTPError as exc:
        logger.info("autoscaler: replica %s /metrics: %s", replica_id, exc)
        return None
    return engine_load(response.text)


class _Percentile(Aggregate):
    """PostgreSQL's ordered-set ``percentile_cont(fraction) WITHIN GROUP (ORDER BY x)``; NULLs are skipped."""

    function = "PERCENTILE_CONT"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()


def _served(deployment: Deployment, since: datetime) -> QuerySet[UsageRecord]:
    """Requests an engine of this deployment's version answered (cache hits load no engine)."""
    version = deployment.version
    return UsageRecord.objects.filter(
        model=version.model.name, model_version=version.version, created_at__gte=since, cache=CacheOutcome.MISS
    )


def latency_p99(deployment: Deployment, *, since: datetime) -> tuple[float | None, float | None, int]:
    """p99 whole-request latency and time to first token (ms) of the version's successful
    requests since then, and how many there were; the figures are None below
    AUTOSCALER_MIN_SAMPLES."""
    figures: dict[str, Any] = (
        _served(deployment, since)
        .filter(status_code=200)
        .aggregate(
            p99=_Percentile("latency_ms", fraction=0.99),
            p99_ttft=_Percentile("ttft_ms", fraction=0.99),
            samples=Count("pk"),
        )
    )
    samples = int(figures["samples"] or 0)
    if samples < settings.AUTOSCALER_MIN_SAMPLES:
        return None, None, samples
    return figures["p99"], figures["p99_ttft"], samples


def peak_in_flight(deployment: Deployment, *, since: datetime) -> float:
    """The busiest AUTOSCALER_BUCKET_SECONDS since then: requests in flight on average (time
    served ÷ the bucket's length). A request counts in the bucket it was admitted in, so one
    longer than a bucket makes that bucket look busier than it was: it errs towards keeping
    replicas. Requests still running have no record yet; the scrape sees those."""
    seconds = max(1, int(settings.AUTOSCALER_BUCKET_SECONDS))
    bucket = Func(
        F("created_at"), template=f"floor(extract(epoch from %(expressions)s) / {seconds})", output_field=IntegerField()
    )
    busy = (
        _served(deployment, since)
        .annotate(bucket=bucket)
        .values("bucket")
        .annotate(busy_ms=Sum("latency_ms"))
        .values_list("busy_ms", flat=True)
    )
    return max((int(ms or 0) for ms in busy), default=0) / (seconds * 1000)


def observe_deployment(deployment: Deployment, policy: AutoscalePolicy, *, now: datetime | None = None) -> Observations:
    """Scrape every routable replica of the deployment (in parallel, each within
    AUTOSCALER_SCRAPE_TIMEOUT) and read its version's recent usage."""
    now = now or timezone.now()
    fresh_after = heartbeat_fresh_after(now)
    replicas = list(
        Replica.objects.filter(
            deployment=deployment, state=Replica.State.READY, standby=False, last_heartbeat__gte=fresh_after
        )
        .order_by("id")
        .values_list("id", "endpoint")
    )
    loads: list[tuple[float, float]] = []
    if replicas:
        with (
            httpx.Client(timeout=settings.AUTOSCALER_SCRAPE_TIMEOUT) as client,
            ThreadPoolExecutor(max_workers=min(8, len(replicas)), thread_name_prefix="autoscale-scrape") as pool,
        ):
            answers = pool.map(lambda replica: scrape_replica(client, *replica), replicas)
            loads = [answer for answer in answers if answer is not None]
    p99, p99_ttft, samples = latency_p99(deployment, since=now - timedelta(seconds=settings.AUTOSCALER_WINDOW_SECONDS))
    return Observations(
        ready=len(replicas),
        scraped=len(loads),
        waiting=sum(waiting for waiting, _ in loads),
        running=sum(running for _, running in loads),
        p99_ms=p99,
        p99_ttft_ms=p99_ttft,
        samples=samples,
        peak_in_flight=peak_in_flight(deployment, since=now - timedelta(seconds=policy.scale_in_quiet_seconds)),
    )
