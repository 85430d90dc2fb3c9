"""Reads of shadow traffic: how a candidate compares with the version that answered, and a model's policy."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from billing import outcomes
from billing.models import UsageRecord
from serving.gateway.models import ShadowPolicy
from serving.shadow.models import ShadowRecord

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
