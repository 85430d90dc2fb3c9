"""What the semantic cache saved, per model and version and over time, from the hourly usage rollups.

A rollup counts a bucket's cache hits (requests answered from the cache), the prompt tokens
they replayed as cached tokens, and ``saved``: what the hits would have cost from an engine
(their prompt and completion tokens at the input and output prices) less what they were
charged (``billing.rollups``). The console's cache page reads these, never the raw records.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db.models import Sum

from billing.models import UsageRollup


@dataclass
class CacheSavings:
    """One model version's (or everything's) cache figures over a window."""

    model: str
    version: str
    requests: int = 0
    cache_hits: int = 0
    cached_tokens: int = 0
    saved: Decimal = Decimal(0)

    @property
    def hit_rate(self) -> float | None:
        return self.cache_hits / self.requests if self.requests else None

    @property
    def hit_rate_percent(self) -> float | None:
        rate = self.hit_rate
        return None if rate is None else rate * 100


@dataclass
class HitRateSeries:
    """One model version's hit rate per hour, oldest first (None: no requests that hour)."""

    model: str
    version: str
    hours: list[datetime] = field(default_factory=list)
    hit_rates: list[float | None] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.model}:{self.version}"


@dataclass(frozen=True)
class CacheSavingsReport:
    since: datetime
    until: datetime
    versions: list[CacheSavings]
    total: CacheSavings
    series: list[HitRateSeries]


def _hour(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def cache_savings(*, span: timedelta, now: datetime | None = None) -> CacheSavingsReport:
    """Cache figures of every model version from the hourly rollups of the last ``span`` (whole
    hours, the current one included), with each version's hit rate hour by hour."""
    now = (now or datetime.now(UTC)).astimezone(UTC)
    since = _hour(now - span)
    rows = (
        UsageRollup.objects.filter(period=UsageRollup.Period.HOUR, start__gte=since, start__lte=now)
        .values("start", "model", "model_version")
        .annotate(
            requests_sum=Sum("requests"),
            hits_sum=Sum("cache_hits"),
            cached_sum=Sum("cached_tokens"),
            saved_sum=Sum("saved"),
        )
        .order_by("start", "model", "model_version")
    )
    hours: list[datetime] = []
    moment = since
    while moment <= now:
        hours.append(moment)
        moment += timedelta(hours=1)
    totals: dict[tuple[str, str], CacheSavings] = {}
    per_hour: dict[tuple[str, str], dict[datetime, tuple[int, int]]] = defaultdict(dict)
    total = CacheSavings(model="", version="")
    for row in rows:
        key = (row["model"], row["model_version"])
        figures = totals.setdefault(key, CacheSavings(model=key[0], version=key[1]))
        for target in (figures, total):
            target.requests += int(row["requests_sum"] or 0)
            target.cache_hits += int(row["hits_sum"] or 0)
            target.cached_tokens += int(row["cached_sum"] or 0)
            target.saved += row["saved_sum"] or Decimal(0)
        at = _hour(row["start"])
        requests, hits = per_hour[key].get(at, (0, 0))
        per_hour[key][at] = (requests + int(row["requests_sum"] or 0), hits + int(row["hits_sum"] or 0))
    series = []
    for key in sorted(totals):
        counts = per_hour[key]
        rates = [(counts[h][1] / counts[h][0]) if counts.get(h, (0, 0))[0] else None for h in hours]
        series.append(HitRateSeries(model=key[0], version=key[1], hours=hours, hit_rates=rates))
    return CacheSavingsReport(
        since=since, until=now, versions=[totals[k] for k in sorted(totals)], total=total, series=series
    )
