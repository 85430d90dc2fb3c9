"""Predictive scaling: a deployment's demand by hour of the week, from the usage rollups, and
the forecast the autoscaler adds to its reactive rule (``rollout.autoscaler.decide``).

Demand in an hour is the requests in flight on average: the time the version's engines spent
answering (its hourly rollups' latency sketches: the sum of requests times latency) over the hour's 3,600 s
(Little's law). Batch lines are left out: they run below interactive traffic and wait for it.

The profile of an hour is the busiest of the same hour of the week over the last
``AUTOSCALER_PREDICTIVE_WEEKS`` weeks of history; with less than a week, the busiest of the
same hour of the day over the days there are; with less than a day, there is no forecast. An
hour inside the history with no rollup served nothing (0). The hour now running is never read
(its rollup is not complete): the forecast of an hour comes from earlier weeks or days.

Read at a moment, the profile joins its hours' values, each taken at the hour's midpoint, by
straight lines. The forecast at ``now`` is what it expects now and at its busiest from now to
``now + lead`` (``rollout.autoscaler.decide`` adds the rise to the load now), where the lead
is the policy's ``predictive_lead_seconds`` or the longest of the version's recent load times
(``replica.ready`` audit entries; AUTOSCALER_PREDICTIVE_LOAD_SECONDS when it has none yet)
plus one autoscaler tick: a replica asked for then is ready when the load comes. A
deployment's warm standbys are promoted first (``registry.warm_pool``), so with a pool the
first replicas of a step are serving at once; the lead is kept for the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings

from billing.models import UsageRollup
from core import sketch
from registry.models import AuditEntry, Deployment
from rollout.autoscaler import AutoscalePolicy, Forecast

HOUR = timedelta(hours=1)
HALF_HOUR = timedelta(minutes=30)
DAY = timedelta(days=1)
WEEK = timedelta(weeks=1)
# The load times a lead is taken from: the version's latest starts.
LOAD_TIMES_READ = 20


def hour_of(at: datetime) -> datetime:
    """The start of ``at``'s UTC hour."""
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


@dataclass(frozen=True)
class DemandProfile:
    """Hourly demand of the past, read by hour of the week (or of the day)."""

    demand: Mapping[datetime, float]  # UTC hour start → requests in flight on average
    since: datetime  # the first hour of history (the first hour with a rollup)
    until: datetime  # the end of history: the start of the hour now running
    weeks: int = 4

    def _past(self, hour: datetime, step: timedelta, count: int) -> list[datetime]:
        past = (hour - step * k for k in range(1, count + 1))
        return [h for h in past if self.since <= h < self.until]

    def expected(self, hour: datetime) -> tuple[float, str] | None:
        """The demand expected in the hour starting at ``hour``, and what it comes from; None
        without a day of history before it."""
        for step, count, unit in ((WEEK, self.weeks, "week"), (DAY, 7, "day")):
            seen = self._past(hour, step, count)
            if seen:
                busiest = max(self.demand.get(h, 0.0) for h in seen)
                return busiest, f"busiest of this hour in the last {len(seen)} {unit}{'s' * (len(seen) > 1)}"
        return None

    def at(self, moment: datetime) -> tuple[float, str] | None:
        """The demand expected at ``moment``: the profile's hours read as their midpoints' values,
        joined by straight lines (an hour alone where its neighbour has no profile)."""
        before = hour_of(moment - HALF_HOUR)
        first, second = self.expected(before), self.expected(before + HOUR)
        if first is None or second is None:
            return first or second
        share = (moment - before - HALF_HOUR) / HOUR
        return first[0] + (second[0] - first[0]) * share, first[1]

    def forecast(self, now: datetime, lead_seconds: float) -> Forecast | None:
        """The demand expected now and at the busiest moment from now to ``now + lead_seconds``
        (a straight-line profile peaks at an end or at an hour's midpoint); None without a
        profile for now."""
        current = self.at(now)
        if current is None:
            return None
        end = now + timedelta(seconds=lead_seconds)
        moments = [now, end]
        midpoint = hour_of(now) + HALF_HOUR
        while midpoint < end:
            if midpoint > now:
                moments.append(midpoint)
            midpoint += HOUR
        best, best_at = current, now
        for moment in moments[1:]:
            found = self.at(moment)
            if found is not None and found[0] > best[0]:
                best, best_at = found, moment
        return Forecast(
            now_in_flight=current[0], in_flight=best[0], at=best_at, lead_seconds=lead_seconds, basis=best[1]
        )

    def peak(self, now: datetime, horizon: timedelta = DAY) -> Forecast | None:
        """The busiest moment expected in the next ``horizon`` (what the console shows)."""
        return self.forecast(now, horizon.total_seconds())


def demand_profile(deployment: Deployment, *, now: datetime, weeks: int | None = None) -> DemandProfile | None:
    """The profile of the version ``deployment`` serves, from its hourly rollups of the last
    ``weeks`` (AUTOSCALER_PREDICTIVE_WEEKS) weeks before the hour now running; None when it
    has none."""
    weeks = weeks or settings.AUTOSCALER_PREDICTIVE_WEEKS
    version = deployment.version
    until = hour_of(now)
    rows = UsageRollup.objects.filter(
        period=UsageRollup.Period.HOUR,
        model=version.model.name,
        model_version=version.version,
        batch=False,
        start__gte=until - WEEK * weeks,
        start__lt=until,
    ).values_list("start", "latency_histogram")
    busy_ms: dict[datetime, float] = {}
    for start, histogram in rows:
        served = sum(count * sketch.value_of(bucket) for bucket, count in sketch.parse(histogram).items())
        busy_ms[start] = busy_ms.get(start, 0.0) + served
    if not busy_ms:
        return None
    demand = {start: ms / HOUR.total_seconds() / 1000 for start, ms in busy_ms.items()}
    return DemandProfile(demand=demand, since=min(demand), until=until, weeks=weeks)


def load_seconds(deployment: Deployment) -> float:
    """The longest of the version's latest load times (start to first good /health), or
    AUTOSCALER_PREDICTIVE_LOAD_SECONDS before its first replica has loaded."""
    version = deployment.version
    entries = AuditEntry.objects.filter(
        action="replica.ready", after__model=version.model.name, after__version=version.version
    ).order_by("-created_at")[:LOAD_TIMES_READ]
    times = [float(after["load_seconds"]) for after in entries.values_list("after", flat=True) if after]
    times = [t for t in times if math.isfinite(t) and t >= 0]
    return max(times, default=float(settings.AUTOSCALER_PREDICTIVE_LOAD_SECONDS))


def lead_seconds(deployment: Deployment, policy: AutoscalePolicy) -> float:
    """How far ahead the forecast looks: the policy's lead, else the load time plus one tick."""
    if policy.predictive_lead_seconds is not None:
        return policy.predictive_lead_seconds
    return load_seconds(deployment) + float(settings.AUTOSCALER_TICK_SECONDS)


def forecast_deployment(deployment: Deployment, policy: AutoscalePolicy, now: datetime) -> Forecast | None:
    """The autoscaler's forecaster (``rollout.autoscaler.Forecaster``)."""
    profile = demand_profile(deployment, now=now)
    if profile is None:
        return None
    return profile.forecast(now, lead_seconds(deployment, policy))
