"""Reconciliation: requests the ledger metered = usage records stored = requests in the hourly rollups.

Three independent counts of the same requests, per UTC hour:

- the ledger's own count: ``settle`` adds one to ``events`` in the hash
  ``core.keys.usage_counts(<YYYYMMDDHH>)`` in the same Lua step that appends the usage
  event, so it counts events written, by the hour the request was admitted in (kept
  ``COUNTS_KEPT``);
- the UsageRecord rows whose ``created_at`` is in that hour (the persister's work);
- the hourly UsageRollup rows' ``requests``, and their ``cost`` against the records' (the
  rollup job's work).

Every delta must be zero. The ledger counts per hour only, so an events mismatch names
the hour; records and rollups are also compared per hour, key and model, and those
differences go in ``details``. For a whole month, ``reconcile_month`` also compares the
invoices: their usage and adjustment lines against the records they bill re-priced by the
same rule (``billing.invoicing.invoiced_usage``), into ``invoiced``/``priced``, and flags
records they hold that belong on another month's invoice (``details["misbilled"]``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Count, F, Max, Q, Sum
from django.db.models.functions import TruncHour
from django.utils import timezone

from billing.invoicing import invoiced_usage, misbilled_records, month_bounds, round_cents
from billing.models import Reconciliation, UsageRecord, UsageRollup
from billing.rollups import HOUR, hour_start
from core import keys
from core.redis import sync_redis

logger = logging.getLogger(__name__)

# How long the ledger keeps its hourly counts (the EXPIRE in ledger.lua's settle).
COUNTS_KEPT = timedelta(days=40)
# The scheduled run checks each hour once, when it is the hour before last: by then its
# requests have been settled, persisted (every second) and rolled up (every minute).
SETTLED_AFTER = timedelta(hours=1)
# At most this many hours are caught up in one scheduled run (after the workers were down).
CATCH_UP_HOURS = 48
# Differences listed in ``details`` at most, per kind (the counts are always whole).
DETAILS_MAX = 500


def _hour_name(hour: datetime) -> str:
    return hour.astimezone(UTC).strftime("%Y%m%d%H")


@dataclass
class _Group:
    records: int = 0
    records_cost: Decimal = Decimal(0)
    rollup_requests: int = 0
    rollup_cost: Decimal = Decimal(0)

    @property
    def agrees(self) -> bool:
        return self.records == self.rollup_requests and self.records_cost == self.rollup_cost


@dataclass
class _Hour:
    events: int = 0
    records: int = 0
    groups: dict[tuple[int, str], _Group] = field(default_factory=lambda: defaultdict(_Group))


def _hours(start: datetime, end: datetime) -> list[datetime]:
    if timezone.is_naive(start) or timezone.is_naive(end):
        raise ValueError("start and end must include a time zone")
    if start != hour_start(start) or end != hour_start(end) or end <= start:
        raise ValueError("a reconciliation covers whole UTC hours: start < end, both on the hour")
    if start < timezone.now() - COUNTS_KEPT:
        raise ValueError(f"the ledger keeps its hourly counts {COUNTS_KEPT.days} days; start is older")
    hours, hour = [], start.astimezone(UTC)
    while hour < end:
        hours.append(hour)
        hour += HOUR
    return hours


def _ledger_events(hours: list[datetime], api_key_ids: Collection[int] | None = None) -> list[int]:
    """The ledger's count of events per hour: all of them, or those of these keys."""
    fields = ["events"] if api_key_ids is None else [f"key:{key_id}" for key_id in api_key_ids]
    if not fields:
        return [0] * len(hours)
    pipe = sync_redis().pipeline(transaction=False)
    for hour in hours:
        pipe.hmget(keys.usage_counts(_hour_name(hour)), fields)
    return [sum(int(v or 0) for v in values) for values in pipe.execute()]


def reconcile_month(*, period: date) -> Reconciliation:
    """Reconcile a whole UTC month: its hours as ``reconcile`` does, and its invoices.

    Run it after the month's invoices are drafted; a month still in progress is refused.
    """
    start, end = month_bounds(period)
    if end > timezone.now():
        raise ValueError(f"{period:%Y-%m} has not ended yet")
    invoices = invoiced_usage(period=period)
    misbilled = misbilled_records(period=period)
    result = reconcile(start=start, end=end)
    result.invoiced, result.priced = round_cents(invoices.invoiced), round_cents(invoices.priced)
    if invoices.mismatches:
        result.details["invoices"] = {
            str(number): {"invoiced": str(invoiced), "priced": str(priced)}
            for number, (invoiced, priced) in invoices.mismatches.items()
        }
    if misbilled:  # records this month's invoices hold that belong on another month's
        result.details["misbilled"] = misbilled
        logger.warning("records billed in the wrong month on %s invoices: %s", f"{period:%Y-%m}", misbilled)
    result.ok = result.ok and not invoices.mismatches and invoices.invoiced == invoices.priced and not misbilled
    result.save(update_fields=["invoiced", "priced", "details", "ok"])
    if invoices.mismatches:
        logger.warning("invoice reconciliation MISMATCH %s: %s", f"{period:%Y-%m}", result.details["invoices"])
    return result


def reconcile(*, start: datetime, end: datetime, api_key_ids: Collection[int] | None = None) -> Reconciliation:
    """Compare the ledger's counts, the usage records and the hourly rollups over whole UTC
    hours [start, end), for every key or only ``api_key_ids`` (one customer's keys; the
    ledger counts per key too); store and return the result (a warning is logged on a mismatch)."""
    hours = _hours(start, end)
    events_by_hour = _ledger_events(hours, api_key_ids)
    by_hour = {hour: _Hour(events=events) for hour, events in zip(hours, events_by_hour, strict=True)}
    scope = Q() if api_key_ids is None else Q(api_key_id__in=list(api_key_ids))
    records = (
        UsageRecord.objects.filter(scope, created_at__gte=start, created_at__lt=end)
        .annotate(hour=TruncHour("created_at", tzinfo=UTC))
        .values("hour", "api_key_id", "model")
        .annotate(n=Count("pk"), cost=Sum("cost"))
        .order_by()
    )
    for row in records:
        slot = by_hour[row["hour"]]
        slot.records += row["n"]
        group = slot.groups[(row["api_key_id"], row["model"])]
        group.records, group.records_cost = row["n"], row["cost"]
    rollups = (
        UsageRollup.objects.filter(scope, period=UsageRollup.Period.HOUR, start__gte=start, start__lt=end)
        .values("start", "api_key_id", "model")
        .annotate(n=Sum("requests"), cost=Sum("cost"))
        .order_by()
    )
    for row in rollups:
        group = by_hour[row["start"]].groups[(row["api_key_id"], row["model"])]
        group.rollup_requests, group.rollup_cost = int(row["n"]), row["cost"]

    hour_details: list[dict[str, Any]] = []
    group_details: list[dict[str, Any]] = []
    totals = _Group()
    events = 0
    for hour, slot in by_hour.items():
        events += slot.events
        if slot.events != slot.records:
            hour_details.append({"hour": hour.isoformat(), "stream_events": slot.events, "records": slot.records})
        for (api_key_id, model), group in sorted(slot.groups.items()):
            totals.records += group.records
            totals.records_cost += group.records_cost
            totals.rollup_requests += group.rollup_requests
            totals.rollup_cost += group.rollup_cost
            if not group.agrees:
                group_details.append({
                    "hour": hour.isoformat(), "api_key": api_key_id, "model": model, "records": group.records,
                    "rollup_requests": group.rollup_requests, "records_cost": str(group.records_cost),
                    "rollup_cost": str(group.rollup_cost),
                })  # fmt: skip
    ok = not hour_details and not group_details and events == totals.records and totals.agrees
    details: dict[str, Any] = {}
    for name, found in (("hours", hour_details), ("groups", group_details)):
        if found:
            details[name] = found[:DETAILS_MAX]
            if len(found) > DETAILS_MAX:
                details[f"{name}_not_listed"] = len(found) - DETAILS_MAX
    result = Reconciliation.objects.create(
        period_start=start,
        period_end=end,
        stream_events=events,
        records=totals.records,
        rollup_requests=totals.rollup_requests,
        records_cost=totals.records_cost,
        rollup_cost=totals.rollup_cost,
        ok=ok,
        details=details,
    )
    if not ok:
        logger.warning(
            "usage reconciliation MISMATCH %s to %s: %d events, %d records, %d in rollups, cost %s vs %s (%s)",
            start.isoformat(), end.isoformat(), events, totals.records, totals.rollup_requests,
            totals.records_cost, totals.rollup_cost, details,
        )  # fmt: skip
    return result


def reconcile_due_hours(*, now: datetime | None = None) -> list[Reconciliation]:
    """Reconcile, one row each, the hours not yet checked up to the hour before last.

    Idempotent: an hour already checked (a one-hour reconciliation exists) is not checked
    again by this; ``reconcile`` can re-check any period by hand. The first run checks
    the hour before last only; after an outage, at most CATCH_UP_HOURS are caught up.
    """
    now = now or timezone.now()
    last_due = hour_start(now) - SETTLED_AFTER  # the end of the hour before last
    checked = (
        Reconciliation.objects.filter(period_end=F("period_start") + HOUR, period_end__lte=last_due)
        .aggregate(last=Max("period_end"))["last"]
    )  # fmt: skip
    hour = max(checked or last_due - HOUR, last_due - CATCH_UP_HOURS * HOUR)
    results = []
    while hour + HOUR <= last_due:
        results.append(reconcile(start=hour, end=hour + HOUR))
        hour += HOUR
    return results
