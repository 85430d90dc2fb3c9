"""Platform-wide usage over time, per model and version, from the hourly and daily rollups only.

The console's overview reads these: a month of traffic costs a month of rollup rows (one per
bucket, key, model, version and price), never a scan of the raw usage records.

Percentiles do not add up: a bucket's p50 or p99 over every key is not derivable from each
key's. Each rollup row keeps its latency and TTFT distributions as mergeable histograms
(``core.sketch``), so the percentiles here (per bucket, per version, over everything) are
those of the merged distribution: the rank-exact value within 1 %. TTFT counts only the
requests that produced a token (streams and completions of LLMs).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import QuerySet, Sum

from billing import outcomes
from billing.models import UsageRollup
from core import sketch

HOUR = timedelta(hours=1)
DAY = timedelta(days=1)


@dataclass(frozen=True)
class TimeRange:
    """A window the overview offers: how far back, and the rollup period it reads."""

    key: str
    label: str
    span: timedelta
    period: str  # UsageRollup.Period

    @property
    def bucket(self) -> timedelta:
        return HOUR if self.period == UsageRollup.Period.HOUR else DAY


TIME_RANGES: dict[str, TimeRange] = {
    r.key: r
    for r in (
        TimeRange("hour", "Last hour", HOUR, UsageRollup.Period.HOUR),
        TimeRange("day", "Last day", DAY, UsageRollup.Period.HOUR),
        TimeRange("7d", "Last 7 days", 7 * DAY, UsageRollup.Period.HOUR),
        TimeRange("30d", "Last 30 days", 30 * DAY, UsageRollup.Period.DAY),
    )
}
DEFAULT_RANGE = "day"


def _floor(moment: datetime, bucket: timedelta) -> datetime:
    moment = moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return moment.replace(hour=0) if bucket == DAY else moment


@dataclass
class Bucket:
    """One bucket's figures for one model version (or for everything: ``UsageTotals``)."""

    start: datetime
    seconds: float  # the bucket's length, or the part of it already past
    requests: int = 0
    errors: int = 0  # not a client's cancel (billing.outcomes)
    cancelled: int = 0  # requests their clients cancelled: in ``requests``, not in ``errors``
    output_tokens: int = 0
    cache_hits: int = 0
    latency: sketch.Histogram = field(default_factory=dict)
    ttft: sketch.Histogram = field(default_factory=dict)

    def add(self, row: dict[str, Any]) -> None:
        self.requests += int(row["requests_sum"] or 0)
        self.errors += int(row["errors_sum"] or 0)
        self.cancelled += int(row["cancelled_sum"] or 0)
        self.output_tokens += int(row["output_tokens_sum"] or 0)
        self.cache_hits += int(row["cache_hits_sum"] or 0)

    def absorb(self, other: Bucket) -> None:
        """Add ``other``'s figures (the same bucket of another version) to these."""
        self.requests += other.requests
        self.errors += other.errors
        self.cancelled += other.cancelled
        self.output_tokens += other.output_tokens
        self.cache_hits += other.cache_hits
        sketch.merge([other.latency], into=self.latency)
        sketch.merge([other.ttft], into=self.ttft)

    def add_distribution(self, kind: str, histogram: sketch.Histogram) -> None:
        sketch.merge([histogram], into=self.latency if kind == "latency" else self.ttft)

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def error_rate(self) -> float | None:
        """Errors over the requests the server decided: cancels count in neither (None: none decided)."""
        return outcomes.error_rate(errors=self.errors, requests=self.requests, cancelled=self.cancelled)

    @property
    def cancelled_share(self) -> float | None:
        """The share of the requests that their clients cancelled."""
        return self.cancelled / self.requests if self.requests else None

    @property
    def cache_hit_rate(self) -> float | None:
        return self.cache_hits / self.requests if self.requests else None

    @property
    def latency_p50_ms(self) -> float | None:
        return sketch.quantile(self.latency, 0.50)

    @property
    def latency_p99_ms(self) -> float | None:
        return sketch.quantile(self.latency, 0.99)

    @property
    def ttft_p50_ms(self) -> float | None:
        return sketch.quantile(self.ttft, 0.50)

    @property
    def ttft_p99_ms(self) -> float | None:
        return sketch.quantile(self.ttft, 0.99)


@dataclass
class VersionSeries:
    """One model version's buckets, oldest first, and its figures over the whole window."""

    model: str
    version: str
    buckets: list[Bucket] = field(default_factory=list)
    total: Bucket | None = None

    @property
    def label(self) -> str:
        return f"{self.model}:{self.version}" if self.version else self.model


def busiest(series: list[VersionSeries], keep: int) -> tuple[list[VersionSeries], VersionSeries | None]:
    """The ``keep`` versions with the most requests (in their usual order), and the rest
    merged into one series (None when nothing is left): its rates are sums, its percentiles
    those of the merged distributions. ``model`` names how many it holds."""
    if len(series) <= keep:
        return list(series), None
    ranked = sorted(series, key=lambda s: (-(s.total.requests if s.total else 0), s.label))
    top = {id(s) for s in ranked[:keep]}
    rest = [s for s in series if id(s) not in top]
    other = VersionSeries(model=f"{len(rest)} other versions", version="")
    other.buckets = [Bucket(start=b.start, seconds=b.seconds) for b in rest[0].buckets]
    other.total = Bucket(start=rest[0].total.start, seconds=rest[0].total.seconds) if rest[0].total else None
    for one in rest:
        for mine, theirs in zip(other.buckets, one.buckets, strict=True):
            mine.absorb(theirs)
        if other.total is not None and one.total is not None:
            other.total.absorb(one.total)
    return [s for s in series if id(s) in top], other


@dataclass
class UsageOverview:
    """What the overview shows for one window: every model version's series, and the totals."""

    time_range: TimeRange
    start: datetime  # the first bucket's start
    now: datetime
    series: list[VersionSeries]
    total: Bucket
    bucket_starts: list[datetime]


def _rows(rollups: QuerySet[UsageRollup]) -> QuerySet[UsageRollup, dict[str, Any]]:
    return (
        rollups.values("start", "model", "model_version")
        .annotate(
            requests_sum=Sum("requests"),
            errors_sum=Sum("errors"),
            cancelled_sum=Sum("cancelled"),
            output_tokens_sum=Sum("output_tokens"),
            cache_hits_sum=Sum("cache_hits"),
        )
        .order_by("start", "model", "model_version")
    )


_DISTRIBUTIONS_SQL = """
SELECT r.start, r.model, r.model_version, d.kind, h.key::int, sum(h.value::bigint)
FROM {table} r
CROSS JOIN LATERAL (VALUES ('latency', r.latency_histogram), ('ttft', r.ttft_histogram)) d (kind, histogram)
CROSS JOIN LATERAL jsonb_each_text(d.histogram) h
WHERE r.period = %(period)s AND r.start >= %(start)s AND r.start <= %(end)s
GROUP BY 1, 2, 3, 4, 5
"""


Distributions = dict[tuple[datetime, str, str, str], sketch.Histogram]  # (start, model, version, kind)


def _distributions(
    *, period: str, start: datetime, end: datetime, model: str | None = None, version: str | None = None
) -> Distributions:
    """Each bucket's and version's latency and TTFT histograms, merged over its keys in SQL
    (one version's only, with ``model`` and ``version``)."""
    out: defaultdict[tuple[datetime, str, str, str], sketch.Histogram] = defaultdict(dict)
    sql = _DISTRIBUTIONS_SQL.format(table=UsageRollup._meta.db_table)
    params: dict[str, Any] = {"period": period, "start": start, "end": end}
    if model is not None and version is not None:
        sql = sql.replace("GROUP BY", "AND r.model = %(model)s AND r.model_version = %(version)s\nGROUP BY")
        params |= {"model": model, "version": version}
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        for at, model, version, kind, bucket, n in cursor.fetchall():
            out[(at.astimezone(UTC), model, version, kind)][int(bucket)] = int(n)
    return dict(out)


def usage_overview(
    *,
    range_key: str = DEFAULT_RANGE,
    now: datetime | None = None,
    model: str | None = None,
    version: str | None = None,
) -> UsageOverview:
    """Every model version's usage in the window ``range_key`` (a TIME_RANGES key) up to
    ``now``, bucket by bucket, from the rollups of the window's period; one version's only
    with ``model`` and ``version``. The bucket that holds ``now`` is measured over the part
    already past, so its rates are not diluted."""
    time_range = TIME_RANGES[range_key]
    now = (now or datetime.now(UTC)).astimezone(UTC)
    bucket = time_range.bucket
    start = _floor(now - time_range.span, bucket)
    starts: list[datetime] = []
    moment = start
    while moment <= now:
        starts.append(moment)
        moment += bucket

    def seconds(at: datetime) -> float:
        return max((min(at + bucket, now) - at).total_seconds(), 1.0)

    rollups = UsageRollup.objects.filter(period=time_range.period, start__gte=start, start__lte=now)
    if model is not None and version is not None:
        rollups = rollups.filter(model=model, model_version=version)
    rows = _rows(rollups)
    by_version: dict[tuple[str, str], dict[datetime, Bucket]] = defaultdict(dict)
    totals: dict[tuple[str, str], Bucket] = {}
    total = Bucket(start=start, seconds=max((now - start).total_seconds(), 1.0))
    for row in rows:
        at = row["start"].astimezone(UTC)
        key = (row["model"], row["model_version"])
        by_version[key].setdefault(at, Bucket(start=at, seconds=seconds(at))).add(row)
        totals.setdefault(key, Bucket(start=start, seconds=total.seconds)).add(row)
        total.add(row)
    for (at, name, number, kind), histogram in _distributions(
        period=time_range.period, start=start, end=now, model=model, version=version
    ).items():
        key = (name, number)
        if at not in by_version[key]:
            continue  # a row added between the two reads: counted with the next page load
        for figures in (by_version[key][at], totals[key], total):
            figures.add_distribution(kind, histogram)
    series = [
        VersionSeries(
            model=name,
            version=number,
            # Every bucket of the window, empty ones included, so the lines show the gaps as zero.
            buckets=[by_version[(name, number)].get(at) or Bucket(start=at, seconds=seconds(at)) for at in starts],
            total=totals[(name, number)],
        )
        for name, number in sorted(by_version)
    ]
    return UsageOverview(time_range=time_range, start=start, now=now, series=series, total=total, bucket_starts=starts)
