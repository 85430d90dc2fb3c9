"""What the requests one version of a model served in a time window tell about it, read from usage records.

The canary controller (``rollout.canary``) judges versions by these; its Celery task
(``rollout.tasks.canary_tick``) hands this function to the controller. The console's
deployments table shows the same counts, summed in SQL (``served_summaries``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.db.models import Count

from billing import outcomes
from billing.models import CacheOutcome, FailedAttempt, UsageRecord
from rollout.canary_stats import RequestSample

# The newest this many requests of a version in a window are judged: bounded memory and time
# for a base at 95 % of heavy traffic over a long interval, and plenty for the tests.
MAX_SAMPLES = 50_000


def served_requests(*, model: str, version: str, since: datetime) -> list[RequestSample]:
    """The requests ``model``:``version`` answered through an engine since ``since``, newest first.

    Cache hits are left out: the engine never saw them, so they say nothing about the version.
    Attempts that failed on it and were retried elsewhere (``FailedAttempt``) are in: status
    and latency only. Requests their clients cancelled (499) are in, for the figures to show;
    the statistics count them nowhere (``rollout.canary_stats``).
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


@dataclass(frozen=True)
class ServedSummary:
    """What one version served in a window, counted as the canary controller counts it: engine
    answers and failed attempts (cache hits left out), server errors (5xx), p99 latency of the
    answered (2xx, nearest rank). Requests their clients cancelled (499) are in ``requests``
    (they were load) and in ``cancelled``; the error % leaves them out of both sides."""

    requests: int
    errors: int
    p99_latency_ms: int | None
    seconds: float
    cancelled: int = 0

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def error_percent(self) -> float | None:
        """Server errors over the requests the server decided; None when there was none."""
        rate = outcomes.error_rate(errors=self.errors, requests=self.requests, cancelled=self.cancelled)
        return None if rate is None else 100.0 * rate


_SUMMARY_SQL = f"""
SELECT model, model_version, count(*), count(*) FILTER (WHERE status_code >= 500),
       count(*) FILTER (WHERE {outcomes.CANCELLED_SQL}),
       percentile_disc(0.99) WITHIN GROUP (ORDER BY latency_ms) FILTER (WHERE status_code BETWEEN 200 AND 299)
FROM {UsageRecord._meta.db_table}
WHERE model = ANY(%s) AND created_at >= %s AND cache = '{CacheOutcome.MISS.value}'
GROUP BY model, model_version
"""


def served_summaries(
    *, versions: list[tuple[str, str]], since: datetime, now: datetime
) -> dict[tuple[str, str], ServedSummary]:
    """Each (model, version)'s ``ServedSummary`` from ``since`` to ``now``: two grouped queries
    (usage records, failed attempts) for any number of versions; a version with no request has
    a summary of zeros."""
    wanted = set(versions)
    models = sorted({model for model, _ in wanted})
    found: dict[tuple[str, str], tuple[int, int, int, int | None]] = {}
    with connection.cursor() as cursor:
        cursor.execute(_SUMMARY_SQL, [models, since])
        for model, version, n, errors, cancelled, p99 in cursor.fetchall():
            found[(model, version)] = (n, errors, cancelled, p99)
    failed = (
        FailedAttempt.objects.filter(model__in=models, created_at__gte=since)
        .values_list("model", "model_version")
        .annotate(n=Count("id"))
    )
    extra = {(model, version): n for model, version, n in failed}
    seconds = max((now - since).total_seconds(), 0.0)
    out = {}
    for key in wanted:
        n, errors, cancelled, p99 = found.get(key, (0, 0, 0, None))
        more = extra.get(key, 0)
        out[key] = ServedSummary(
            requests=n + more, errors=errors + more, p99_latency_ms=p99, seconds=seconds, cancelled=cancelled
        )
    return out
