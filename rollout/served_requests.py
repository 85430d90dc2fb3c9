"""What the requests one version of a model served in a time window tell about it, read from usage records.

The canary controller (``rollout.canary``) judges versions by these; its Celery task
(``rollout.tasks.canary_tick``) hands this function to the controller.
"""

from __future__ import annotations

from datetime import datetime

from billing.models import CacheOutcome, FailedAttempt, UsageRecord
from rollout.canary_stats import RequestSample

# The newest this many requests of a version in a window are judged: bounded memory and time
# for a base at 95 % of heavy traffic over a long interval, and plenty for the tests.
MAX_SAMPLES = 50_000


def served_requests(*, model: str, version: str, since: datetime) -> list[RequestSample]:
    """The requests ``model``:``version`` answered through an engine since ``since``, newest first.

    Cache hits are left out: the engine never saw them, so they say nothing about the version.
    Attempts that failed on it and were retried elsewhere (``FailedAttempt``) are in: status
    and latency only.
    Records reach the table within a second or so of the request (``billing.tasks.usage_persist``).
    """
    rows = (
        UsageRecord.objects.filter(model=model, model_version=version, created_at__gte=since, cache=CacheOutcome.MISS)
        .order_by("-created_at")
        .values_list("status_code", "latency_ms", "ttft_ms", "completion_tokens", "finish_reason")[:MAX_SAMPLES]
    )
    samples = [
        RequestSample(
            status_code=status, latency_ms=latency, ttft_ms=ttft, completion_tokens=tokens, finish_reason=finish
        )
        for status, latency, ttft, tokens, finish in rows
    ]
    # Attempts that failed here and were answered by another version (the fallback): the
    # customer never saw the error, but it is this version's.
    failed = (
        FailedAttempt.objects.filter(model=model, model_version=version, created_at__gte=since)
        .order_by("-created_at")
        .values_list("status_code", "latency_ms")[:MAX_SAMPLES]
    )
    samples += [
        RequestSample(status_code=status, latency_ms=latency, ttft_ms=None, completion_tokens=0, finish_reason="")
        for status, latency in failed
    ]
    return samples
