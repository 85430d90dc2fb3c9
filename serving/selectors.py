"""Reads of the data plane's own tables: how a shadow candidate compares with the version that answered."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from billing.models import UsageRecord
from serving.models import CacheEntry, CachePolicy, ShadowPolicy, ShadowRecord

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
    latency = [r[1] for r in ok]
    ttft = [r[2] for r in ok if r[2] is not None]
    return {
        "requests": len(rows),
        "failed": len(rows) - len(ok),
        "error_rate": round((len(rows) - len(ok)) / len(rows), 4) if rows else None,
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
