"""Predictive scaling: the demand profile (rollout.predictive), how a forecast raises the
reactive decision (rollout.autoscaler.decide), and the pass that applies and audits it.
The simulation over a recorded trace is bench/predictive_scaling.py."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from accounts.services import api_key_create, organization_create
from billing.models import UsageRollup
from core import sketch
from core.errors import InvalidInput
from registry.models import AuditEntry, Deployment
from registry.services import SUPERVISOR, audit_record
from rollout.autoscaler import (
    AutoscalePolicy,
    DeploymentConfig,
    Forecast,
    Observations,
    autoscale_deployments,
    decide,
)
from rollout.predictive import DemandProfile, demand_profile, forecast_deployment, lead_seconds, load_seconds
from tests.serving.test_autoscaler import make_deployment

MONDAY = datetime(2026, 3, 2, tzinfo=UTC)  # a Monday, 00:00 UTC
HOUR = timedelta(hours=1)
WEEK = timedelta(weeks=1)


def weekly(hours: dict[int, float], weeks: int) -> dict[datetime, float]:
    """The same demand by hour of the week, ``weeks`` weeks from MONDAY."""
    return {MONDAY + WEEK * w + HOUR * h: value for w in range(weeks) for h, value in hours.items()}


class TestProfile:
    def test_an_hour_is_the_busiest_of_the_same_hour_in_the_last_weeks(self):
        demand = weekly({9: 10.0}, 3)
        demand[MONDAY + WEEK + HOUR * 9] = 25.0  # one busier Monday 09:00
        profile = DemandProfile(demand, since=MONDAY, until=MONDAY + WEEK * 3)
        assert profile.expected(MONDAY + WEEK * 3 + HOUR * 9) == (25.0, "busiest of this hour in the last 3 weeks")
        # Tuesday 09:00 had no rollup in any week: nothing was served then.
        assert profile.expected(MONDAY + WEEK * 3 + timedelta(days=1, hours=9)) == (
            0.0, "busiest of this hour in the last 3 weeks"
        )  # fmt: skip
        # Only the weeks kept count: with weeks=1, the busier Monday is too old.
        recent = DemandProfile(demand, since=MONDAY, until=MONDAY + WEEK * 3, weeks=1)
        assert recent.expected(MONDAY + WEEK * 3 + HOUR * 9) == (10.0, "busiest of this hour in the last 1 week")

    def test_with_less_than_a_week_the_same_hour_of_the_days_there_are_and_none_before_a_day(self):
        demand = {MONDAY + timedelta(days=d, hours=14): 4.0 + d for d in range(3)}
        profile = DemandProfile(demand, since=MONDAY, until=MONDAY + timedelta(days=3))
        three_days = (6.0, "busiest of this hour in the last 3 days")
        assert profile.expected(MONDAY + timedelta(days=3, hours=14)) == three_days
        young = DemandProfile(demand, since=MONDAY, until=MONDAY + timedelta(hours=20))
        assert young.expected(MONDAY + timedelta(hours=22)) is None

    def test_the_hour_now_running_and_the_future_are_never_read(self):
        demand = weekly({9: 10.0}, 2)
        demand[MONDAY + WEEK + HOUR * 9] = 99.0  # the hour "now": not complete, not read
        profile = DemandProfile(demand, since=MONDAY, until=MONDAY + WEEK + HOUR * 9)
        assert profile.expected(MONDAY + WEEK + HOUR * 9) == (10.0, "busiest of this hour in the last 1 week")

    def test_read_at_a_moment_hours_are_joined_at_their_midpoints(self):
        demand = weekly({8: 10.0, 9: 30.0}, 1)
        profile = DemandProfile(demand, since=MONDAY, until=MONDAY + WEEK)
        monday = MONDAY + WEEK
        assert profile.at(monday + timedelta(hours=8, minutes=30))[0] == pytest.approx(10.0)
        assert profile.at(monday + timedelta(hours=9))[0] == pytest.approx(20.0)
        assert profile.at(monday + timedelta(hours=9, minutes=15))[0] == pytest.approx(25.0)

    def test_the_forecast_is_the_busiest_moment_within_the_lead(self):
        demand = weekly({8: 10.0, 9: 30.0, 10: 50.0, 11: 5.0}, 2)
        profile = DemandProfile(demand, since=MONDAY, until=MONDAY + WEEK * 2 + HOUR * 8)
        now = MONDAY + WEEK * 2 + timedelta(hours=8, minutes=30)
        ahead = profile.forecast(now, 3600)
        assert ahead is not None
        assert (ahead.now_in_flight, ahead.in_flight, ahead.at, ahead.rise) == (10.0, 30.0, now + HOUR, 20.0)
        # Two hours ahead it sees the 10:00 peak, not past it.
        assert profile.forecast(now, 7200).in_flight == pytest.approx(50.0)
        assert profile.forecast(now, 3 * 3600).at == now + 2 * HOUR
        # Falling: no rise.
        assert profile.forecast(now + 2 * HOUR, 3600).rise == 0.0
        assert DemandProfile({}, since=now, until=now).forecast(now, 3600) is None


NOW = MONDAY + WEEK * 4 + timedelta(hours=8, minutes=45)
LONG_AGO = NOW - HOUR


def config(replicas: int = 2, *, max_replicas: int = 10, **policy: Any) -> DeploymentConfig:
    policy.setdefault("predictive", True)
    return DeploymentConfig(replicas, 1, max_replicas, AutoscalePolicy(enabled=True, **policy))


def forecast(now_in_flight: float, in_flight: float) -> Forecast:
    basis = "busiest of this hour in the last 4 weeks"
    return Forecast(now_in_flight, in_flight, NOW + timedelta(minutes=5), 315.0, basis)


class TestDecision:
    def test_a_rise_coming_is_added_to_the_load_now_before_it_comes(self):
        # 30 in flight on 2 replicas is within the target of 16 each: reactive holds.
        seen = Observations(ready=2, scraped=2, running=30)
        assert decide(config(2), seen, NOW, LONG_AGO).target_replicas == 2
        decision = decide(config(2), seen, NOW, LONG_AGO, forecast(20.0, 45.0))
        assert decision.target_replicas == 4  # ceil((30 + 25) / 16)
        (reason,) = decision.reasons
        assert reason.startswith("forecast: 45 in flight at Mon 08:50 UTC, 25 more than now")
        assert reason.endswith("30 in flight now + 25 needs 4")

    def test_the_busiest_stretch_of_the_quiet_period_counts_as_the_load_now(self):
        seen = Observations(ready=2, scraped=2, running=5, peak_in_flight=22)
        assert decide(config(2), seen, NOW, LONG_AGO, forecast(20.0, 40.0)).target_replicas == 3  # (22+20)/16

    def test_a_flat_or_falling_profile_leaves_the_reactive_decision(self):
        seen = Observations(ready=2, scraped=2, waiting=20)
        reactive = decide(config(2, predictive=False), seen, NOW, LONG_AGO)
        assert decide(config(2), seen, NOW, LONG_AGO, forecast(40.0, 40.0)) == reactive
        assert decide(config(2), seen, NOW, LONG_AGO, forecast(40.0, 10.0)) == reactive

    def test_never_below_the_reactive_target(self):
        seen = Observations(ready=2, scraped=2, waiting=40)  # reactive: 4 (doubling)
        assert decide(config(2), seen, NOW, LONG_AGO, forecast(10.0, 12.0)).target_replicas == 4

    def test_a_scale_in_the_forecast_would_undo_is_held(self):
        seen = Observations(ready=4, scraped=4, running=10, peak_in_flight=10)
        assert decide(config(4), seen, NOW, LONG_AGO).target_replicas == 3  # quiet: one goes
        decision = decide(config(4), seen, NOW, LONG_AGO, forecast(10.0, 60.0))  # ceil(60/16) = 4
        assert decision.target_replicas == 4
        assert decision.reasons[0].startswith("held: forecast:")

    def test_within_the_bounds_and_ignored_unless_the_policy_is_predictive(self):
        seen = Observations(ready=2, scraped=2, running=30)
        assert decide(config(2, max_replicas=3), seen, NOW, LONG_AGO, forecast(0.0, 500.0)).target_replicas == 3
        off = config(2, predictive=False)
        assert decide(off, seen, NOW, LONG_AGO, forecast(0.0, 500.0)).target_replicas == 2

    def test_a_cooldown_or_replicas_still_starting_do_not_hold_it(self):
        seen = Observations(ready=1, scraped=1, running=10)  # one replica still loading
        decision = decide(config(2), seen, NOW, NOW - timedelta(seconds=5), forecast(0.0, 60.0))
        assert decision.target_replicas == 5  # ceil((10 + 60) / 16)


class TestPolicy:
    def test_round_trip_and_defaults(self):
        policy = AutoscalePolicy.from_json({"enabled": True, "predictive": True, "predictive_lead_seconds": 600})
        assert (policy.predictive, policy.predictive_lead_seconds) == (True, 600.0)
        assert AutoscalePolicy.from_json(policy.as_json()) == policy
        assert (AutoscalePolicy().predictive, AutoscalePolicy().predictive_lead_seconds) == (False, None)

    @pytest.mark.parametrize(
        ("data", "field"),
        [
            ({"predictive": "on"}, "autoscale.predictive"),
            ({"predictive_lead_seconds": -1}, "autoscale.predictive_lead_seconds"),
            ({"predictive_lead_seconds": 86401}, "autoscale.predictive_lead_seconds"),
            ({"predictive_lead_seconds": "soon"}, "autoscale.predictive_lead_seconds"),
        ],
    )
    def test_a_bad_value_names_its_key(self, data, field):
        with pytest.raises(InvalidInput) as exc:
            AutoscalePolicy.from_json(data)
        assert exc.value.field == field


# --- from the database ------------------------------------------------------------------------


def rollup(key: Any, model: str, start: datetime, latencies_ms: dict[float, int], **fields: Any) -> None:
    histogram = {str(sketch.bucket_of(ms)): n for ms, n in latencies_ms.items()}
    UsageRollup.objects.create(
        period=UsageRollup.Period.HOUR, start=start, organization=key.organization, api_key=key, model=model,
        model_version=fields.pop("version", "1"), requests=sum(latencies_ms.values()),
        latency_histogram=histogram, **fields,
    )  # fmt: skip


def running(deployment: Deployment, *, since: datetime) -> None:
    Deployment.objects.filter(pk=deployment.pk).update(status=Deployment.Status.RUNNING, created_at=since)


@pytest.mark.django_db
class TestFromTheRollups:
    @pytest.fixture
    def key(self):
        org = organization_create(name=f"Predictive {uuid.uuid4().hex[:6]}")
        return api_key_create(organization=org, name="k").api_key

    def test_demand_is_time_served_over_the_hour_of_the_version_interactive_traffic(self, key, settings):
        settings.AUTOSCALER_PREDICTIVE_WEEKS = 2
        deployment = make_deployment("pr-profile")
        monday_9 = MONDAY + WEEK + HOUR * 9
        rollup(key, "pr-profile", monday_9, {2000: 3600})  # 3,600 requests of 2 s: 2 in flight
        other = api_key_create(organization=key.organization, name="other").api_key
        rollup(other, "pr-profile", monday_9, {1000: 1800})  # another key's row, same hour: +0.5
        rollup(key, "pr-profile", monday_9, {9000: 9000}, batch=True)  # batch lines: left out
        rollup(key, "pr-profile", monday_9, {9000: 9000}, version="2")  # another version
        rollup(key, "pr-profile", MONDAY + HOUR * 8, {9000: 9000})  # over two weeks back: too old
        now = monday_9 + WEEK + timedelta(minutes=10)
        rollup(key, "pr-profile", monday_9 + WEEK, {9000: 9000})  # the hour now running: not read
        profile = demand_profile(deployment, now=now)
        assert profile is not None
        assert profile.since == monday_9
        assert profile.demand[monday_9] == pytest.approx(2.5, rel=0.02)  # the sketch's 1 %
        assert set(profile.demand) == {monday_9}
        expected = profile.expected(monday_9 + WEEK)
        assert expected is not None
        assert expected[0] == pytest.approx(2.5, rel=0.02)
        assert expected[1] == "busiest of this hour in the last 1 week"
        assert demand_profile(make_deployment("pr-empty"), now=now) is None

    def test_the_lead_is_the_longest_recent_load_time_plus_a_tick(self, settings):
        settings.AUTOSCALER_TICK_SECONDS = 15.0
        settings.AUTOSCALER_PREDICTIVE_LOAD_SECONDS = 300.0
        deployment = make_deployment("pr-lead")
        assert load_seconds(deployment) == 300.0
        for seconds in (40.5, 95.25, 60.0):
            audit_record(
                actor=SUPERVISOR, action="replica.ready", target_type="replica", target="1", before=None,
                after={"load_seconds": seconds, "model": "pr-lead", "version": "1"},
            )  # fmt: skip
        audit_record(
            actor=SUPERVISOR, action="replica.ready", target_type="replica", target="2", before=None,
            after={"load_seconds": 900.0, "model": "pr-other", "version": "1"},
        )  # fmt: skip
        assert load_seconds(deployment) == 95.25
        assert lead_seconds(deployment, AutoscalePolicy(predictive=True)) == 110.25
        assert lead_seconds(deployment, AutoscalePolicy(predictive=True, predictive_lead_seconds=30)) == 30.0

    def test_a_pass_scales_ahead_of_the_profile_and_audits_the_forecast(self, key, settings):
        settings.AUTOSCALER_PREDICTIVE_LOAD_SECONDS = 1800.0
        deployment = make_deployment("pr-pass", replicas=1, max_replicas=6, predictive=True)
        hour = MONDAY + WEEK * 4 + HOUR * 8
        now = hour + timedelta(minutes=45)  # a fixed time: how far the lead reaches into the rise
        # Last week: 1 in flight this hour, 80 the next (288,000 requests of 1 s).
        rollup(key, "pr-pass", hour - WEEK, {1000: 3600})
        rollup(key, "pr-pass", hour - WEEK + HOUR, {1000: 288_000})
        running(deployment, since=now - HOUR)
        quiet = Observations(ready=1, scraped=1)
        changes = autoscale_deployments(observe=lambda d, p: quiet, forecast=forecast_deployment, now=now)
        assert [(c.deployment_id, c.before) for c in changes] == [(deployment.pk, 1)]
        # Expected now (08:45): 20.75 (between 1 at 08:30 and 80 at 09:30); at the lead's end
        # (09:15:15): 60.6; nothing running now: ceil((0 + 39.85) / 16) = 3.
        assert changes[0].after == 3
        entry = AuditEntry.objects.get(action="autoscale", target=str(deployment.pk))
        assert entry.after["reasons"][0].startswith("forecast: ")
        assert entry.after["observations"]["forecast"]["basis"] == "busiest of this hour in the last 1 week"
        # Reactive alone (the policy's predictive off) leaves it.
        other = make_deployment("pr-reactive", replicas=1, max_replicas=6)
        rollup(key, "pr-reactive", hour - WEEK + HOUR, {1000: 288_000})
        running(other, since=now - HOUR)
        changes = autoscale_deployments(observe=lambda d, p: quiet, forecast=forecast_deployment, now=now)
        assert other.pk not in [c.deployment_id for c in changes]

    def test_a_forecast_that_fails_leaves_the_pass_reactive(self, caplog):
        deployment = make_deployment("pr-broken", replicas=1, predictive=True)
        running(deployment, since=NOW - HOUR)

        def broken(*_: Any) -> Forecast:
            raise ValueError("a corrupt sketch")

        queued = Observations(ready=1, scraped=1, waiting=12)
        changes = autoscale_deployments(observe=lambda d, p: queued, forecast=broken, now=NOW)
        assert [(c.deployment_id, c.after) for c in changes] == [(deployment.pk, 2)]  # the queue still scales it
        assert "no forecast this pass" in caplog.text
