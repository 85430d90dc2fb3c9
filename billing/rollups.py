"""Usage rollups: UsageRecord rows summed into hourly and daily UsageRollup rows, bucket by bucket.

A bucket is one UTC hour or day. Its rows (one per key, model, version and price) are
always recomputed whole from the bucket's records, in SQL, percentiles included
(``percentile_disc``: an observed value, so an integer number of milliseconds). Writing
is an upsert that leaves a row alone when its numbers are unchanged, plus a delete of
rows the bucket no longer has: building a bucket twice changes nothing, not even
``updated_at``.

``rollups_build`` finds the buckets to rebuild from the records added since the last
run: ``RollupProgress`` keeps the last UsageRecord id read (the watermark). A late
record (admitted hours ago, persisted now) gets a new id, so its old hour and day are
rebuilt like any other.

The watermark hazard, and the answer. Ids are taken when a row is inserted but become
visible when its transaction commits, and commits need not come in id order: two
persister batches in flight at once can commit id 101 before id 100. A watermark moved
straight to the highest id seen (101) would skip 100 for good. Rebuilding "the last
couple of hours" would not be enough either: a late record's hour is an old one. So the
watermark only moves past ids that have been visible for ``WATERMARK_LAG``: each run
reads every record past the watermark (a few minutes of inserts, so the same recent
buckets are rebuilt a few times, which costs little and changes nothing), notes the
highest id it saw and when (the *candidate*, a second ``RollupProgress`` row), and moves
the watermark up to a candidate only once the candidate is ``WATERMARK_LAG`` old. An id
below the candidate that was invisible when the candidate was noted belonged to a
transaction open at that moment; the persister's transactions last well under a second,
so after the lag it has committed (and is read by the run that moves the watermark) or
rolled back. A transaction held open longer than the lag could still be missed;
``billing.reconciliation`` compares records with hourly rollups and flags that, and
``rollups_rebuild`` repairs any period.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from django.db import connection, transaction
from django.db.models import Count, Max
from django.db.models.functions import TruncHour
from django.utils import timezone

from billing import outcomes
from billing.models import Price, RollupProgress, UsageRecord, UsageRollup
from billing.pricing import charged_tokens_sql, saved_sql
from core import sketch

logger = logging.getLogger(__name__)

WATERMARK = "usage-rollups"
CANDIDATE = "usage-rollups:candidate"
# Far longer than any persister transaction (one batch insert: milliseconds to a second).
WATERMARK_LAG = timedelta(minutes=5)

HOUR = timedelta(hours=1)
DAY = timedelta(days=1)

_RECORDS = UsageRecord._meta.db_table
_PRICES = Price._meta.db_table
_ROLLUPS = UsageRollup._meta.db_table
_BUCKET_CONSTRAINT = "uniq_rollup_bucket"
_SUMS = (
    "requests", "errors", "cancelled", "input_tokens", "output_tokens", "cached_tokens", "inferences", "cost",
    "cache_hits", "saved",
)  # fmt: skip
_PERCENTILES = (
    "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms",
)  # fmt: skip
_HISTOGRAMS = ("latency_histogram", "ttft_histogram")
_VALUES = ("organization_id", *_SUMS, *_PERCENTILES, *_HISTOGRAMS)
_GROUP = "organization_id, api_key_id, model, model_version, price_id, batch"
_CHARGED = charged_tokens_sql("u")


def _same_group(a: str, b: str) -> str:
    return " AND ".join(
        f"{a}.{c} IS NOT DISTINCT FROM {b}.{c}" if c == "price_id" else f"{a}.{c} = {b}.{c}" for c in _GROUP.split(", ")
    )


# One bucket, recomputed whole. Errors are answers outside 2xx but for a client's cancel
# (a 499: the client went away), which is counted on its own (billing.outcomes). Input
# tokens are those charged at the input price (billing.pricing, the one rule); output and
# cached tokens are what the records report. Percentiles are over every request of the bucket;
# TTFT ignores requests that produced no token (null). One sort per column: the three
# percentiles come from one ``percentile_disc(array)``. Cache hits are counted, with what
# they saved: their tokens at the input and output prices, less what they were charged.
# Each row also keeps its latency and TTFT distributions as mergeable histograms
# (``core.sketch``: counts per log bucket, 1 % relative error), which is what lets a page
# compute the percentiles of any grouping of rows (all keys, a model, a week) rather than
# averaging the rows' own percentiles.
_REBUILD_SQL = f"""
WITH histograms AS (
    SELECT {_GROUP}, kind, jsonb_object_agg(bucket, n) AS histogram
    FROM (
        SELECT {_GROUP}, 'latency' AS kind, {sketch.bucket_sql("latency_ms")} AS bucket, count(*) AS n
        FROM {_RECORDS}
        WHERE created_at >= %(start)s AND created_at < %(end)s AND latency_ms IS NOT NULL
        GROUP BY {_GROUP}, bucket
        UNION ALL
        SELECT {_GROUP}, 'ttft' AS kind, {sketch.bucket_sql("ttft_ms")} AS bucket, count(*) AS n
        FROM {_RECORDS}
        WHERE created_at >= %(start)s AND created_at < %(end)s AND ttft_ms IS NOT NULL
        GROUP BY {_GROUP}, bucket
    ) counted
    GROUP BY {_GROUP}, kind
), fresh AS (
    SELECT g.organization_id, g.api_key_id, g.model, g.model_version, g.price_id, g.batch,
           requests, errors, cancelled, input_tokens, output_tokens, cached_tokens, inferences, cost, cache_hits,
           saved, latency[1] AS latency_p50_ms, latency[2] AS latency_p95_ms, latency[3] AS latency_p99_ms,
           ttft[1] AS ttft_p50_ms, ttft[2] AS ttft_p95_ms, ttft[3] AS ttft_p99_ms,
           coalesce(l.histogram, '{{}}'::jsonb) AS latency_histogram,
           coalesce(t.histogram, '{{}}'::jsonb) AS ttft_histogram
    FROM (
        SELECT organization_id, api_key_id, model, model_version, price_id, batch,
               count(*) AS requests,
               count(*) FILTER (WHERE {outcomes.ERROR_SQL}) AS errors,
               count(*) FILTER (WHERE {outcomes.CANCELLED_SQL}) AS cancelled,
               sum({_CHARGED["input"]}) AS input_tokens,
               sum(completion_tokens) AS output_tokens,
               sum(cached_tokens) AS cached_tokens,
               sum(inferences) AS inferences,
               sum(cost) AS cost,
               count(*) FILTER (WHERE cache <> 'miss') AS cache_hits,
               coalesce(sum({saved_sql("u", "p")}), 0) AS saved,
               percentile_disc(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY latency_ms) AS latency,
               percentile_disc(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY ttft_ms) AS ttft
        FROM {_RECORDS} u LEFT JOIN {_PRICES} p ON p.id = u.price_id
        WHERE u.created_at >= %(start)s AND u.created_at < %(end)s
        GROUP BY {_GROUP}
    ) g
    LEFT JOIN histograms l ON l.kind = 'latency' AND {_same_group("l", "g")}
    LEFT JOIN histograms t ON t.kind = 'ttft' AND {_same_group("t", "g")}
), written AS (
    INSERT INTO {_ROLLUPS} AS r (period, start, api_key_id, model, model_version, price_id, batch,
                                 {", ".join(_VALUES)}, updated_at)
    SELECT %(period)s, %(start)s, api_key_id, model, model_version, price_id, batch, {", ".join(_VALUES)}, now()
    FROM fresh
    ON CONFLICT ON CONSTRAINT {_BUCKET_CONSTRAINT} DO UPDATE
    SET {", ".join(f"{name} = EXCLUDED.{name}" for name in _VALUES)}, updated_at = EXCLUDED.updated_at
    WHERE ({", ".join(f"r.{name}" for name in _VALUES)})
          IS DISTINCT FROM ({", ".join(f"EXCLUDED.{name}" for name in _VALUES)})
    RETURNING 1
), removed AS (
    DELETE FROM {_ROLLUPS} r
    WHERE r.period = %(period)s AND r.start = %(start)s AND NOT EXISTS (
        SELECT 1 FROM fresh f
        WHERE f.api_key_id = r.api_key_id AND f.model = r.model AND f.model_version = r.model_version
              AND f.price_id IS NOT DISTINCT FROM r.price_id AND f.batch = r.batch
    )
    RETURNING 1
)
SELECT (SELECT count(*) FROM written), (SELECT count(*) FROM removed)
"""  # only constant names are formatted in; every value is a parameter


@dataclass(frozen=True)
class RollupReport:
    """What one run did: the records it read, the buckets it rebuilt, the rows it changed."""

    records_read: int = 0
    hours: tuple[datetime, ...] = ()
    days: tuple[datetime, ...] = ()
    rows_written: int = 0  # inserted, or updated because a number changed
    rows_removed: int = 0  # no longer in their bucket
    watermark: int = 0  # every record id up to this one is in the rollups
    skipped: bool = False  # another run held the lock


def hour_start(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def day_start(moment: datetime) -> datetime:
    return hour_start(moment).replace(hour=0)


def _rebuild(period: str, start: datetime) -> tuple[int, int]:
    """Recompute one bucket whole: (rows written, rows removed). Call inside transaction.atomic."""
    end = start + (HOUR if period == UsageRollup.Period.HOUR else DAY)
    with connection.cursor() as cursor:
        cursor.execute(_REBUILD_SQL, {"period": period, "start": start, "end": end})
        written, removed = cursor.fetchone()
    return int(written), int(removed)


def _rebuild_all(*, hours: list[datetime], records_read: int, watermark: int) -> RollupReport:
    """Rebuild these hours and their days. Call inside transaction.atomic."""
    days = sorted({day_start(h) for h in hours})
    written = removed = 0
    for period, starts in ((UsageRollup.Period.HOUR, hours), (UsageRollup.Period.DAY, days)):
        for start in starts:
            w, r = _rebuild(period, start)
            written, removed = written + w, removed + r
    return RollupReport(
        records_read=records_read,
        hours=tuple(hours),
        days=tuple(days),
        rows_written=written,
        rows_removed=removed,
        watermark=watermark,
    )


def rollups_build(*, now: datetime | None = None, lag: timedelta = WATERMARK_LAG) -> RollupReport:
    """Rebuild every hour and day that received records since the watermark, and move the
    watermark as far as is safe (the module docstring says why it lags). Safe to re-run
    at any time; a run that finds another one going skips (``skipped``)."""
    now = now or timezone.now()
    for name in (WATERMARK, CANDIDATE):
        RollupProgress.objects.get_or_create(name=name)
    with transaction.atomic():
        # The watermark row is the lock: one build at a time; a run that overlaps skips.
        progress = RollupProgress.objects.select_for_update(skip_locked=True).filter(name=WATERMARK).first()
        if progress is None:
            return RollupReport(skipped=True)
        candidate = RollupProgress.objects.select_for_update().get(name=CANDIDATE)
        watermark = progress.last_record_id
        touched = list(
            UsageRecord.objects.filter(pk__gt=watermark)
            .annotate(hour=TruncHour("created_at", tzinfo=UTC))
            .values("hour")
            .annotate(records=Count("pk"), newest=Max("pk"))
            .order_by("hour")
        )
        newest = max((row["newest"] for row in touched), default=watermark)
        report = _rebuild_all(
            hours=[row["hour"] for row in touched],
            records_read=sum(row["records"] for row in touched),
            watermark=watermark,
        )
        if candidate.last_record_id > watermark and candidate.updated_at <= now - lag:
            # Everything up to the candidate has had `lag` to commit, and this run read it.
            watermark = candidate.last_record_id
            RollupProgress.objects.filter(pk=progress.pk).update(last_record_id=watermark, updated_at=now)
        if candidate.last_record_id <= watermark:
            # Nothing pending: what this run saw becomes the next candidate, from now.
            RollupProgress.objects.filter(pk=candidate.pk).update(last_record_id=max(newest, watermark), updated_at=now)
    if report.rows_written or report.rows_removed:
        logger.info("usage rollups: %d records, %d hours and %d days rebuilt, %d rows written, %d removed",
                    report.records_read, len(report.hours), len(report.days), report.rows_written,
                    report.rows_removed)  # fmt: skip
    return replace(report, watermark=watermark)


def rollups_rebuild(*, start: datetime, end: datetime) -> RollupReport:
    """Rebuild every hour in [start, end) and every day they touch, whatever the watermark
    says (a backfill, or a repair after reconciliation flagged a period)."""
    if timezone.is_naive(start) or timezone.is_naive(end):
        raise ValueError("start and end must include a time zone")
    hours: list[datetime] = []
    hour = hour_start(start)
    while hour < end:
        hours.append(hour)
        hour += HOUR
    with transaction.atomic():
        # Serialised with rollups_build: the same buckets must not be written by two runs.
        progress, _ = RollupProgress.objects.get_or_create(name=WATERMARK)
        RollupProgress.objects.select_for_update().filter(pk=progress.pk).first()
        records = UsageRecord.objects.filter(created_at__gte=hours[0] if hours else start, created_at__lt=end).count()
        return _rebuild_all(hours=hours, records_read=records, watermark=progress.last_record_id)
