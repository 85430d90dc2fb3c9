"""Reads of usage for people and keys: daily usage by model (and key), from the daily rollups only.

Raw UsageRecord rows are read only by ``cache_hits_by_tier`` (a rollup does not keep a
hit's tier; it reads a window of records by an index on their time). Everything else
answers from ``UsageRollup`` (built by ``billing.rollups`` every minute), so a request for
a year costs a year of daily rows, not a year of requests. Pages are keyset-paginated on
(day, model, key) with an opaque cursor; every read is scoped to one key or one organisation.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

import orjson
from django.db.models import Count, Max, Q, QuerySet, Sum

from billing.models import CacheOutcome, UsageRecord, UsageRollup

USAGE_DEFAULT_DAYS = 30
USAGE_PAGE_DEFAULT = 30
USAGE_PAGE_MAX = 100
_SUMS = ("requests", "errors", "cancelled", "input_tokens", "output_tokens", "cached_tokens", "inferences", "cost")


class InvalidCursor(ValueError):
    """A page cursor this API did not hand out."""


@dataclass(frozen=True)
class UsageCursor:
    """The last row of a page. Clients see it as an opaque string (base64url of JSON), which
    only says where the next page starts: the scope is always the caller's own."""

    date: date
    model: str
    api_key_id: int | None = None

    def encode(self) -> str:
        raw = orjson.dumps([self.date.isoformat(), self.model, self.api_key_id])
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> UsageCursor:
        try:
            day, model, key = orjson.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
            if not isinstance(day, str) or not isinstance(model, str):
                raise InvalidCursor(text)
            if key is not None and (type(key) is not int or key < 0):
                raise InvalidCursor(text)
            return cls(date.fromisoformat(day), model, key)
        except (ValueError, TypeError, binascii.Error):
            raise InvalidCursor(text) from None


@dataclass(frozen=True)
class DailyUsage:
    """One UTC day of one model (and one key, when grouped by key), over every version and price."""

    date: date
    model: str
    requests: int
    errors: int  # not 2xx, but for a client's cancel (billing.outcomes)
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    cost: Decimal  # exact, in the billing currency
    api_key_id: int | None = None
    api_key_name: str = ""
    api_key_prefix: str = ""
    batch_requests: int = 0  # of ``requests``: batch jobs' lines
    batch_cost: Decimal = Decimal(0)  # of ``cost``: theirs, at the batch price
    cancelled: int = 0  # of ``requests``: cancelled by their clients (status 499), not errors
    inferences: int = 0  # items of predict requests (small models: priced per thousand)

    def cursor(self) -> UsageCursor:
        return UsageCursor(self.date, self.model, self.api_key_id)


@dataclass(frozen=True)
class UsagePage:
    rows: list[DailyUsage]
    has_more: bool

    @property
    def next_page(self) -> UsageCursor | None:
        return self.rows[-1].cursor() if self.has_more else None


def usage_window(*, start: date | None, end: date | None, today: date) -> tuple[date, date]:
    """The days asked for, both inclusive: ``end`` defaults to today (UTC) and ``start`` to
    USAGE_DEFAULT_DAYS days up to ``end``. ValueError when ``start`` is after ``end``."""
    end = end or today
    start = start or end - timedelta(days=USAGE_DEFAULT_DAYS - 1)
    if start > end:
        raise ValueError("start_date is after end_date")
    return start, end


def _midnight(day: date) -> datetime:
    return datetime.combine(day, time.min, UTC)


def _days(start: date, end: date) -> Q:
    """The daily rollups of UTC days ``start`` to ``end``, both inclusive."""
    return Q(period=UsageRollup.Period.DAY, start__gte=_midnight(start), start__lt=_midnight(end + timedelta(days=1)))


def _daily(
    rollups: QuerySet[UsageRollup], *, start: date, end: date, by_key: bool, limit: int, after: UsageCursor | None
) -> UsagePage:
    rows = rollups.filter(_days(start, end))
    if after is not None:
        at = _midnight(after.date)
        position = Q(start__gt=at) | Q(start=at, model__gt=after.model)
        if by_key:
            position |= Q(start=at, model=after.model, api_key_id__gt=after.api_key_id or 0)
        rows = rows.filter(position)
    order = ["start", "model", *(["api_key_id"] if by_key else [])]
    group = [*order, *(["api_key__name", "api_key__prefix"] if by_key else [])]
    batch = Q(batch=True)
    found = list(
        rows.values(*group)
        # Before the sums, which take the names of the columns they add up.
        .annotate(batch_requests=Sum("requests", filter=batch), batch_cost=Sum("cost", filter=batch))
        .annotate(**{name: Sum(name) for name in _SUMS})
        .order_by(*order)[: limit + 1]
    )
    page = [
        DailyUsage(
            date=row["start"].astimezone(UTC).date(),
            model=row["model"],
            requests=int(row["requests"]),
            errors=int(row["errors"]),
            cancelled=int(row["cancelled"]),
            inferences=int(row["inferences"]),
            input_tokens=int(row["input_tokens"]),
            output_tokens=int(row["output_tokens"]),
            cached_tokens=int(row["cached_tokens"]),
            cost=Decimal(row["cost"]),
            api_key_id=row.get("api_key_id"),
            api_key_name=row.get("api_key__name", ""),
            api_key_prefix=row.get("api_key__prefix", ""),
            batch_requests=int(row["batch_requests"] or 0),
            batch_cost=Decimal(row["batch_cost"] or 0),
        )
        for row in found[:limit]
    ]
    return UsagePage(rows=page, has_more=len(found) > limit)


def usage_daily_for_key(
    *, api_key_id: int, start: date, end: date, limit: int = USAGE_PAGE_DEFAULT, after: UsageCursor | None = None
) -> UsagePage:
    """One key's usage by UTC day and model, days ``start`` to ``end`` inclusive, oldest first."""
    rollups = UsageRollup.objects.filter(api_key_id=api_key_id)
    return _daily(rollups, start=start, end=end, by_key=False, limit=limit, after=after)


def usage_daily_for_organization(
    *,
    organization_id: int,
    start: date,
    end: date,
    api_key_id: int | None = None,
    by_key: bool = True,
    limit: int = USAGE_PAGE_DEFAULT,
    after: UsageCursor | None = None,
) -> UsagePage:
    """An organisation's usage by UTC day, model and (``by_key``) key, oldest first; only
    ``api_key_id``'s when given (a key of another organisation matches nothing)."""
    rollups = UsageRollup.objects.filter(organization_id=organization_id)
    if api_key_id is not None:
        rollups = rollups.filter(api_key_id=api_key_id)
    return _daily(rollups, start=start, end=end, by_key=by_key, limit=limit, after=after)


def cost_by_organization(*, organization_ids: list[int], start: date, end: date) -> dict[int, Decimal]:
    """Each organisation's cost over UTC days ``start`` to ``end`` inclusive, from the daily
    rollups, in one query (0 for an organisation without usage)."""
    rows = (
        UsageRollup.objects.filter(_days(start, end), organization_id__in=organization_ids)
        .values("organization_id")
        .annotate(cost=Sum("cost"))
        .order_by()
    )
    costs = {organization_id: Decimal(0) for organization_id in organization_ids}
    costs.update({row["organization_id"]: Decimal(row["cost"]) for row in rows})
    return costs


@dataclass(frozen=True)
class KeyUsage:
    requests: int = 0
    cost: Decimal = Decimal(0)


def usage_by_key(*, api_key_ids: list[int], start: date, end: date) -> dict[int, KeyUsage]:
    """Each key's requests and cost over UTC days ``start`` to ``end`` inclusive, from the daily
    rollups, in one query (nothing used: zero)."""
    rows = (
        UsageRollup.objects.filter(_days(start, end), api_key_id__in=api_key_ids)
        .values("api_key_id")
        .annotate(requests=Sum("requests"), cost=Sum("cost"))
        .order_by()
    )
    found = {key_id: KeyUsage() for key_id in api_key_ids}
    found.update({r["api_key_id"]: KeyUsage(int(r["requests"]), Decimal(r["cost"])) for r in rows})
    return found


def cache_by_model(*, organization_id: int, start: date, end: date) -> dict[str, tuple[int, Decimal]]:
    """An organisation's requests answered from the cache and the money they saved, per model,
    over whole UTC days (the daily rollups)."""
    days = UsageRollup.objects.filter(_days(start, end), organization_id=organization_id)
    rows = days.values("model").annotate(hits=Sum("cache_hits"), saved=Sum("saved"))
    return {row["model"]: (int(row["hits"] or 0), Decimal(row["saved"] or 0)) for row in rows}


# A hit's tier as a usage record names it (serving.semcache: the same text, then the wording
# tiers and the paraphrase tier); billing knows them as names only.
CACHE_HIT_TIERS = ("exact", "same", "typo", "reordered", "paraphrase")
# Semantic hits recorded before their tier was (billing 0016): one of the word tiers, unknown which.
UNRECORDED_WORD_TIER = "words"


@dataclass
class TierHits:
    """One model's requests over a window and its cache hits by tier (``CACHE_HIT_TIERS``, and
    ``UNRECORDED_WORD_TIER`` for older semantic hits)."""

    model: str
    requests: int = 0
    hits: dict[str, int] = field(default_factory=dict)

    def share(self, tier: str) -> float | None:
        """The tier's hits as a share of the model's requests (None: no requests)."""
        return self.hits.get(tier, 0) / self.requests if self.requests else None


def _hit_tier(cache: str, tier: str) -> str | None:
    if cache == CacheOutcome.HIT:
        return "exact"  # before billing 0016 an exact hit's tier was empty
    if cache == CacheOutcome.SEMANTIC_HIT:
        return tier if tier in CACHE_HIT_TIERS and tier != "exact" else UNRECORDED_WORD_TIER
    return None


def cache_hits_by_tier(
    *, since: datetime, until: datetime, organization_id: int | None = None, models: Collection[str] | None = None
) -> dict[str, TierHits]:
    """Per model, the requests recorded from ``since`` (included) to ``until`` (excluded) and
    their cache hits by tier; ``organization_id``'s requests only, when given. One GROUP BY over
    the usage records of the window, found by usage_org_time (an organisation), usage_model_time
    (models named) or usage_time."""
    records = UsageRecord.objects.filter(created_at__gte=since, created_at__lt=until)
    if organization_id is not None:
        records = records.filter(organization_id=organization_id)
    if models is not None:
        records = records.filter(model__in=list(models))
    rows = records.values_list("model", "cache", "cache_tier").annotate(n=Count("id")).order_by()
    found: dict[str, TierHits] = {}
    for model, cache, tier, n in rows:
        figures = found.setdefault(model, TierHits(model=model))
        figures.requests += n
        hit = _hit_tier(cache, tier)
        if hit is not None:
            figures.hits[hit] = figures.hits.get(hit, 0) + n
    return found


@dataclass(frozen=True)
class Unpriced:
    """A model version that served metered requests with no price in effect."""

    model: str
    version: str
    requests: int
    last_day: date


def unpriced_usage(*, since: date) -> list[Unpriced]:
    """Model versions whose requests since ``since`` (UTC days, the daily rollups) had no price:
    served for free, whether meant or not. Most requests first."""
    rows = (
        UsageRollup.objects.filter(
            period=UsageRollup.Period.DAY, start__gte=_midnight(since), price__isnull=True, requests__gt=0
        )
        .values("model", "model_version")
        .annotate(total=Sum("requests"), last=Max("start"))
        .order_by("-total", "model", "model_version")
    )
    return [Unpriced(r["model"], r["model_version"], int(r["total"]), r["last"].astimezone(UTC).date()) for r in rows]
