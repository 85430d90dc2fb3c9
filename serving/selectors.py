"""Reads of the data plane's own tables: how a shadow candidate compares with the version that answered,
cache policies and entries, and batch jobs as the console and the portal list them."""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Collection, Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from billing import outcomes
from billing.models import UsageRecord
from serving.models import Batch, BatchLine, CacheEntry, CacheFeedback, CachePolicy, ShadowPolicy, ShadowRecord
from serving.semcache.budget import ModelQuality, quality_of

# The comparison reads at most this many of the newest mirrored requests: enough for stable
# percentiles, bounded however long a shadow runs (the console shows the same figures).
SHADOW_SAMPLE_LIMIT = 10_000


def _percentile(values: list[int], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return float(values[0])
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 1)


def _arm(rows: Iterable[tuple[int, int, int | None, int, str]]) -> dict[str, Any]:
    rows = list(rows)
    ok = [r for r in rows if r[0] < 400]
    # A request its client cancelled (499) is no failure: counted apart, in no rate (billing.outcomes).
    cancelled = sum(1 for r in rows if outcomes.cancelled_by_client(r[0]))
    failed = len(rows) - len(ok) - cancelled
    error_rate = outcomes.error_rate(errors=failed, requests=len(rows), cancelled=cancelled)
    latency = [r[1] for r in ok]
    ttft = [r[2] for r in ok if r[2] is not None]
    return {
        "requests": len(rows),
        "failed": failed,
        "cancelled": cancelled,
        "error_rate": None if error_rate is None else round(error_rate, 4),
        "latency_p50_ms": _percentile(latency, 50),
        "latency_p99_ms": _percentile(latency, 99),
        "ttft_p50_ms": _percentile(ttft, 50),
        "ttft_p99_ms": _percentile(ttft, 99),
        "mean_completion_tokens": round(sum(r[3] for r in ok) / len(ok), 1) if ok else None,
        "truncated_share": round(sum(r[4] == "length" for r in ok) / len(ok), 4) if ok else None,
    }


def shadow_comparison(*, model: str, since: datetime) -> dict[str, Any]:
    """The candidate's figures on the mirrored requests since ``since`` (newest
    SHADOW_SAMPLE_LIMIT), beside the primary's on the very same requests (their usage records)."""
    shadows = list(
        ShadowRecord.objects.filter(model=model, created_at__gte=since)
        .order_by("-created_at")
        .values_list("request_id", "status_code", "latency_ms", "ttft_ms", "completion_tokens", "finish_reason",
                     "candidate_version", "inferences", "agreements")[:SHADOW_SAMPLE_LIMIT]
    )  # fmt: skip
    primaries = dict(
        (row[0], row[1:])
        for row in UsageRecord.objects.filter(request_id__in=[s[0] for s in shadows]).values_list(
            "request_id", "status_code", "latency_ms", "ttft_ms", "completion_tokens", "finish_reason"
        )
    )
    return {
        "model": model,
        "since": since,
        "candidate_versions": sorted({s[6] for s in shadows}),
        "candidate": _arm(s[1:6] for s in shadows),
        "primary": _arm(primaries.values()),
        "agreement": _agreement([(s[7], s[8]) for s in shadows if s[1] == 200]),
    }


def _agreement(items: list[tuple[int, int]]) -> dict[str, Any]:
    """A small model's copies: on how many of the items answered by both the candidate
    predicted what the primary did (``rate``: None when no item was compared)."""
    compared = sum(n for n, _ in items)
    agreed = sum(a for _, a in items)
    return {"items": compared, "agreed": agreed, "rate": round(agreed / compared, 4) if compared else None}


def shadow_policy_of(*, model_id: int) -> ShadowPolicy | None:
    """The model's shadow policy, with its candidate version, if it has one."""
    return ShadowPolicy.objects.select_related("candidate").filter(model_id=model_id).first()


def cache_policies_by_model() -> dict[int, CachePolicy]:
    """Every model's semantic-cache policy, by model id (a model without one gets the defaults)."""
    return {policy.model_id: policy for policy in CachePolicy.objects.all()}


def cache_quality(*, models: Collection[str], organization_id: int | None = None) -> list[ModelQuality]:
    """Each model's semantic hits, wrong-hit estimate (95 % interval) and budget, and the
    wrong answers reported (by ``organization_id`` only, when given)."""
    policies = CachePolicy.objects.filter(model__name__in=models, wrong_hit_budget__isnull=False)
    pairs = policies.values_list("model__name", "wrong_hit_budget")
    budgets = {name: float(percent or 0) / 100 for name, percent in pairs}
    reports = CacheFeedback.objects.filter(model__in=models)
    if organization_id is not None:
        reports = reports.filter(organization_id=organization_id)
    counted = dict(reports.values_list("model").annotate(n=Count("id")).values_list("model", "n"))
    out = []
    for model in sorted(models):
        found = quality_of(model, wrong_hit_budget=budgets.get(model, settings.SEMANTIC_CACHE_WRONG_HIT_BUDGET))
        out.append(dataclasses.replace(found, feedback=int(counted.get(model, 0))))
    return out


def cache_entries_count(
    *, model: str | None = None, version: str | None = None, organization_id: int | None = None
) -> int:
    """How many cache entries match every filter given (what ``serving.services.cache_purge``
    with the same filters would delete, entries stored meanwhile aside)."""
    entries = CacheEntry.objects.all()
    if model is not None:
        entries = entries.filter(model=model)
    if version is not None:
        entries = entries.filter(model_version=version)
    if organization_id is not None:
        entries = entries.filter(organization_id=organization_id)
    return entries.count()


# --- Batch jobs ------------------------------------------------------------------------------

# Lines still to run: waiting for a worker, or with one.
_LINES_TO_RUN = (BatchLine.Status.PENDING, BatchLine.Status.RUNNING)
# Statuses whose counts are live in the lines (as ``serving.batches.request_counts`` reads them).
_COUNTED_LIVE = (Batch.Status.IN_PROGRESS, Batch.Status.FINALIZING, Batch.Status.CANCELLING)
# Throughput is the lines finished over this window, per minute.
THROUGHPUT_WINDOW = timedelta(minutes=5)


def batches_listed(*, organization_id: int | None = None, status: str = "") -> QuerySet[Batch]:
    """Batches newest first, with their files and organisation: one organisation's, or every
    organisation's for None; only those in ``status`` when one is given."""
    batches = Batch.objects.all() if organization_id is None else Batch.objects.filter(organization_id=organization_id)
    if status:
        batches = batches.filter(status=status)
    return batches.select_related("organization", "input_file", "output_file", "error_file").order_by(
        "-created_at", "-pk"
    )


def batch_progress(batches: Iterable[Batch]) -> dict[int, dict[str, int]]:
    """``serving.batches.request_counts`` of many batches (total, completed, failed by batch id),
    with one query for the lines of those still running rather than one per batch."""
    batches = list(batches)
    live = [b.pk for b in batches if b.status in _COUNTED_LIVE]
    finished: dict[int, dict[str, int]] = defaultdict(dict)
    rows = (
        BatchLine.objects.filter(batch_id__in=live, status__in=[BatchLine.Status.SUCCEEDED, BatchLine.Status.FAILED])
        .values_list("batch_id", "status")
        .annotate(n=Count("pk"))
        .order_by()
    )
    for batch_id, status, n in rows:
        finished[batch_id][status] = n
    progress = {}
    for b in batches:
        if b.status in _COUNTED_LIVE:
            done = finished[b.pk]
            progress[b.pk] = {"total": b.total, "completed": done.get("succeeded", 0), "failed": done.get("failed", 0)}
        else:
            progress[b.pk] = {"total": b.total, "completed": b.completed, "failed": b.failed}
    return progress


def batch_lines_queued(*, models: Collection[str]) -> dict[str, list[tuple[int, int]]]:
    """For each model, its batches in progress with lines still to run, oldest first (the order
    workers take them in), each as (batch id, lines to run). Per model these add up to
    ``serving.batches.enqueued_lines_of_model``."""
    rows = (
        BatchLine.objects.filter(
            batch__model__in=list(models), batch__status=Batch.Status.IN_PROGRESS, status__in=_LINES_TO_RUN
        )
        .values_list("batch__model", "batch_id", "batch__created_at")
        .annotate(n=Count("pk"))
        .order_by("batch__created_at", "batch_id")
    )
    queued: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for model, batch_id, _created, n in rows:
        queued[model].append((batch_id, n))
    return dict(queued)


def batch_queue_stats(*, now: datetime | None = None) -> dict[str, Any]:
    """The batch queue across every organisation: lines ``waiting`` (not started, in batches
    validating or in progress: the queue's depth), lines ``running``, lines ``finished_recently``
    (succeeded or failed over the last THROUGHPUT_WINDOW) and that as ``per_minute``, and the
    batches ``in_progress``."""
    now = now or timezone.now()
    # A cancelling batch's pending lines never start; a running line finishes whatever its batch.
    by_status = dict(
        BatchLine.objects.filter(
            Q(status=BatchLine.Status.PENDING, batch__status=Batch.Status.IN_PROGRESS)
            | Q(status=BatchLine.Status.RUNNING)
        )
        .values_list("status")
        .annotate(n=Count("pk"))
        .order_by()
    )
    validating = Batch.objects.filter(status=Batch.Status.VALIDATING).aggregate(n=Sum("total"))["n"] or 0
    finished = BatchLine.objects.filter(
        finished_at__gte=now - THROUGHPUT_WINDOW, status__in=[BatchLine.Status.SUCCEEDED, BatchLine.Status.FAILED]
    ).count()
    minutes = THROUGHPUT_WINDOW.total_seconds() / 60
    return {
        "waiting": by_status.get(BatchLine.Status.PENDING, 0) + int(validating),
        "running": by_status.get(BatchLine.Status.RUNNING, 0),
        "finished_recently": finished,
        "window_minutes": int(minutes),
        "per_minute": round(finished / minutes, 1),
        "in_progress": Batch.objects.filter(status=Batch.Status.IN_PROGRESS).count(),
    }
