"""The autoscaler: its decisions for given figures, what it reads from engines and usage
records, and a real scale-out (and in) of a deployment served by fake engines."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from django.utils import timezone

from accounts.services import api_key_create, organization_create
from core.errors import InvalidInput
from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica
from registry.services import deployment_create, deployment_scale
from rollout.autoscaler import (
    AutoscalePolicy,
    DeploymentConfig,
    Observations,
    decide,
    deployment_autoscale_set,
    last_change_at,
)
from rollout.observations import engine_load, latency_p99, observe_deployment, peak_in_flight
from rollout.tasks import autoscale_tick
from serving.supervisor.host import Supervisor
from tests.support.usage_records import make_record

NOW = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
LONG_AGO = NOW - timedelta(hours=1)


def config(replicas: int = 2, *, min_replicas: int = 1, max_replicas: int = 6, **policy: Any) -> DeploymentConfig:
    return DeploymentConfig(replicas, min_replicas, max_replicas, AutoscalePolicy(enabled=True, **policy))


def seen(replicas: int = 2, **figures: Any) -> Observations:
    return Observations(**{"ready": replicas, "scraped": replicas, **figures})


class TestScaleOut:
    def test_a_queue_above_target_scales_out_to_bring_it_to_target(self):
        decision = decide(config(2), seen(2, waiting=20), NOW, LONG_AGO)
        assert decision.target_replicas == 4  # ceil(20 waiting / 4 per replica), at most double
        assert decision.reasons == ("queue 10 per replica > target 4",)

    def test_a_queue_at_target_is_no_reason(self):
        assert decide(config(2), seen(2, waiting=8), NOW, LONG_AGO).target_replicas == 2

    def test_in_flight_per_replica_above_target_scales_out(self):
        decision = decide(config(2, target_in_flight_per_replica=10), seen(2, running=30), NOW, LONG_AGO)
        assert decision.target_replicas == 3
        assert decision.reasons == ("in flight 15 per replica > target 10",)

    def test_p99_above_target_adds_one(self):
        decision = decide(config(2, target_p99_ms=2000), seen(2, p99_ms=3500, samples=80), NOW, LONG_AGO)
        assert decision.target_replicas == 3
        assert decision.reasons == ("p99 3500 ms > target 2000 ms (80 requests)",)

    def test_p99_ttft_above_target_adds_one(self):
        decision = decide(config(2, target_p99_ttft_ms=500), seen(2, p99_ttft_ms=900, samples=50), NOW, LONG_AGO)
        assert decision.target_replicas == 3

    def test_no_latency_verdict_without_figures_or_target(self):
        assert decide(config(2), seen(2, p99_ms=99_000, samples=80), NOW, NOW).target_replicas == 2
        assert decide(config(2, target_p99_ms=100), seen(2, p99_ms=None), NOW, NOW).target_replicas == 2

    def test_the_worst_signal_wins_and_every_reason_is_given(self):
        decision = decide(
            config(2, target_p99_ms=100, max_step=10), seen(2, waiting=20, running=20, p99_ms=500), NOW, LONG_AGO
        )
        assert decision.target_replicas == 5
        assert len(decision.reasons) == 3

    def test_a_step_is_at_most_max_step_or_double(self):
        assert decide(config(1), seen(1, waiting=100), NOW, LONG_AGO).target_replicas == 2
        assert decide(config(1, max_step=3), seen(1, waiting=100), NOW, LONG_AGO).target_replicas == 4

    def test_never_above_max_replicas(self):
        assert decide(config(4, max_replicas=5), seen(4, waiting=100), NOW, LONG_AGO).target_replicas == 5
        decision = decide(config(5, max_replicas=5), seen(5, waiting=100), NOW, LONG_AGO)
        assert decision.target_replicas == 5
        assert decision.reasons[-1] == "at max_replicas (5)"

    def test_held_during_the_cooldown(self):
        decision = decide(config(2, cooldown_seconds=60), seen(2, waiting=20), NOW, NOW - timedelta(seconds=45))
        assert decision.target_replicas == 2
        assert decision.reasons[-1] == "held: cooldown, 15 s left"
        assert decide(config(2, cooldown_seconds=60), seen(2, waiting=20), NOW, NOW - timedelta(seconds=61)) == (
            decide(config(2), seen(2, waiting=20), NOW, None)
        )

    def test_held_while_the_last_change_has_not_landed(self):
        decision = decide(config(3), Observations(ready=2, scraped=2, waiting=40), NOW, LONG_AGO)
        assert decision.target_replicas == 3
        assert decision.reasons[-1] == "held: 1 replica not ready yet"


class TestScaleIn:
    def test_after_a_quiet_period_one_replica_goes(self):
        decision = decide(config(3), seen(3, running=2, peak_in_flight=5), NOW, LONG_AGO)
        assert decision.target_replicas == 2
        assert decision.reasons[0].startswith("quiet for 300 s")

    def test_not_before_the_quiet_period_has_passed_since_the_last_change(self):
        decision = decide(config(3), seen(3), NOW, NOW - timedelta(seconds=200))
        assert decision.target_replicas == 3
        assert "quiet period, 100 s left" in decision.reasons[0]

    def test_not_when_the_busiest_stretch_would_not_fit_in_one_fewer(self):
        # 2 replicas left at 50 % of 16 in flight each: room for 16.
        assert decide(config(3), seen(3, peak_in_flight=17), NOW, LONG_AGO).target_replicas == 3
        assert decide(config(3), seen(3, running=17), NOW, LONG_AGO).target_replicas == 3
        assert decide(config(3), seen(3, peak_in_flight=16), NOW, LONG_AGO).target_replicas == 2

    def test_not_while_anything_is_queued_or_a_replica_is_unseen(self):
        assert decide(config(3), seen(3, waiting=1), NOW, LONG_AGO).target_replicas == 3
        assert decide(config(3), Observations(ready=3, scraped=2), NOW, LONG_AGO).target_replicas == 3

    def test_not_while_latency_is_near_its_target(self):
        decision = decide(config(3, target_p99_ms=1000), seen(3, p99_ms=700), NOW, LONG_AGO)
        assert decision.target_replicas == 3
        assert decide(config(3, target_p99_ms=1000), seen(3, p99_ms=300), NOW, LONG_AGO).target_replicas == 2

    def test_never_below_min_replicas_nor_below_one(self):
        assert decide(config(2, min_replicas=2), seen(2), NOW, LONG_AGO).target_replicas == 2
        assert decide(config(1, min_replicas=0), seen(1), NOW, LONG_AGO).target_replicas == 1


class TestBounds:
    def test_a_count_outside_the_bounds_is_brought_inside_at_once(self):
        decision = decide(config(1, min_replicas=3), seen(1), NOW, NOW)
        assert (decision.target_replicas, decision.reasons) == (3, ("1 replica is below min_replicas (3)",))
        assert decide(config(8, max_replicas=6), seen(8), NOW, NOW).target_replicas == 6
        assert decide(config(0, min_replicas=0), seen(0), NOW, NOW).target_replicas == 1


class TestPolicy:
    def test_defaults_and_round_trip(self):
        policy = AutoscalePolicy.from_json({"enabled": True, "target_p99_ms": 1500})
        assert (policy.target_queue_per_replica, policy.cooldown_seconds, policy.target_p99_ms) == (4.0, 60.0, 1500.0)
        assert AutoscalePolicy.from_json(policy.as_json()) == policy

    @pytest.mark.parametrize(
        ("data", "field"),
        [
            ({"enabled": "yes"}, "autoscale.enabled"),
            ({"target_queue_per_replica": 0}, "autoscale.target_queue_per_replica"),
            ({"cooldown_seconds": -1}, "autoscale.cooldown_seconds"),
            ({"scale_in_utilisation": 1.5}, "autoscale.scale_in_utilisation"),
            ({"max_step": 0}, "autoscale.max_step"),
            ({"target_p99_ms": "fast"}, "autoscale.target_p99_ms"),
            ({"scale_out_on": "vibes"}, "autoscale.scale_out_on"),
        ],
    )
    def test_a_bad_value_names_its_key(self, data, field):
        with pytest.raises(InvalidInput) as exc:
            AutoscalePolicy.from_json(data)
        assert exc.value.field == field


# --- what it reads ------------------------------------------------------------------------


class TestEngineLoad:
    def test_it_sums_each_gauge_over_engines_and_matches_names_whole(self):
        text = (
            "# HELP vllm:num_requests_waiting Number of requests waiting.\n"
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 7.0\n'
            "vllm:num_requests_running 1\n"
        )
        assert engine_load(text) == (5.0, 8.0)


def make_deployment(name: str, *, replicas: int = 1, max_replicas: int = 3, **policy: Any) -> Deployment:
    model = Model.objects.create(name=name, task="chat")
    version = ModelVersion.objects.create(
        model=model, version="1", framework="fake", artifact_uri=f"local://{name}/1", artifact_sha256="0" * 64,
        artifact_size=1, config={"max_seq_len": 512},
    )  # fmt: skip
    deployment = deployment_create(version=version, replicas=replicas, max_replicas=max_replicas)
    return deployment_autoscale_set(actor=None, deployment=deployment, autoscale={"enabled": True, **policy})


@pytest.mark.django_db
class TestUsageFigures:
    @pytest.fixture
    def key(self):
        org = organization_create(name=f"Autoscale {uuid.uuid4().hex[:6]}")
        return api_key_create(organization=org, name="k").api_key

    def test_p99_of_served_requests_in_the_window(self, key, settings):
        settings.AUTOSCALER_MIN_SAMPLES = 10
        deployment = make_deployment("as-p99")
        now = timezone.now()
        for latency in range(1, 101):  # 1 … 100 ms
            make_record(key, at=now - timedelta(seconds=5), model="as-p99", latency=latency * 10, ttft=latency)
        make_record(key, at=now - timedelta(seconds=5), model="as-p99", latency=99_999, status=500)  # failed
        make_record(key, at=now - timedelta(seconds=5), model="as-p99", latency=99_999, cache="hit")  # no engine
        make_record(key, at=now - timedelta(minutes=5), model="as-p99", latency=99_999)  # before the window
        make_record(key, at=now - timedelta(seconds=5), model="as-p99", version="2", latency=99_999)  # other version
        p99, p99_ttft, samples = latency_p99(deployment, since=now - timedelta(seconds=60))
        assert samples == 100
        assert p99 == pytest.approx(990.1)
        assert p99_ttft == pytest.approx(99.01)
        settings.AUTOSCALER_MIN_SAMPLES = 101
        assert latency_p99(deployment, since=now - timedelta(seconds=60)) == (None, None, 100)

    def test_the_busiest_stretch_of_the_quiet_period(self, key, settings):
        settings.AUTOSCALER_BUCKET_SECONDS = 10
        deployment = make_deployment("as-peak")
        start = datetime.fromtimestamp((int(timezone.now().timestamp()) // 10 - 5) * 10, tz=UTC)
        for _ in range(4):  # 4 requests of 5 s in one 10 s stretch: 2 in flight on average
            make_record(key, at=start + timedelta(seconds=1), model="as-peak", latency=5000)
        make_record(key, at=start + timedelta(seconds=21), model="as-peak", latency=5000)
        assert peak_in_flight(deployment, since=start) == pytest.approx(2.0)
        assert peak_in_flight(deployment, since=start + timedelta(seconds=20)) == pytest.approx(0.5)


class TestScaleService:
    pytestmark = pytest.mark.django_db

    def test_a_change_is_audited_with_its_reasons_and_figures(self):
        deployment = make_deployment("as-service")
        scaled = deployment_scale(
            actor=None, deployment=deployment, replicas=2, reasons=["queue"], observations={"waiting": 9.0}, expected=1
        )
        assert scaled is not None
        assert Deployment.objects.get(pk=deployment.pk).replicas == 2
        entry = AuditEntry.objects.get(action="autoscale", target=str(deployment.pk))
        assert (entry.before, entry.after) == (
            {"replicas": 1},
            {"replicas": 2, "reasons": ["queue"], "observations": {"waiting": 9.0}},
        )
        assert last_change_at(deployment) == entry.created_at

    def test_a_decision_made_from_a_stale_count_writes_nothing(self):
        deployment = make_deployment("as-stale")
        assert deployment_scale(actor=None, deployment=deployment, replicas=2, reasons=["x"], expected=3) is None
        assert not AuditEntry.objects.filter(action="autoscale", target=str(deployment.pk)).exists()

    def test_it_stays_within_the_bounds(self):
        deployment = make_deployment("as-bounds", max_replicas=2)
        for replicas in (0, 3):
            with pytest.raises(InvalidInput):
                deployment_scale(actor=None, deployment=deployment, replicas=replicas, reasons=[])

    def test_a_bad_policy_is_refused(self):
        deployment = make_deployment("as-policy")
        with pytest.raises(InvalidInput):
            deployment_autoscale_set(actor=None, deployment=deployment, autoscale={"enabled": 1})


# --- the tick, with engines ---------------------------------------------------------------


@pytest.fixture
def supervisor(settings, tmp_path) -> Iterator[Supervisor]:
    settings.WORKER_ENGINE_LAUNCHER = f"{sys.executable} -m tests.support.busy_engine"
    settings.WORKER_HEARTBEAT_SECONDS = 0.2
    settings.WORKER_DRAIN_TIMEOUT = 5
    sup = Supervisor(host=f"as-{uuid.uuid4().hex[:8]}", slots=["0", "1"], log_dir=tmp_path, report=lambda m: None)
    yield sup
    sup.close()


def step_until(sup: Supervisor, condition: Callable[[], Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sup.step()
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def ready(deployment: Deployment) -> list[Replica]:
    return list(Replica.objects.filter(deployment=deployment, state="ready").order_by("id"))


@pytest.mark.django_db
class TestTick:
    def test_a_queue_on_the_engine_scales_out_to_a_second_ready_replica(self, supervisor):
        supervisor.models = frozenset({"as-tick"})  # other tests may have committed deployments
        deployment = make_deployment("as-tick", max_replicas=2, cooldown_seconds=60)
        # Created long ago: the cooldown that follows a change (creation too) is over.
        Deployment.objects.filter(pk=deployment.pk).update(created_at=timezone.now() - timedelta(hours=1))
        step_until(supervisor, lambda: len(ready(deployment)) == 1)
        [first] = ready(deployment)
        observed = observe_deployment(deployment, AutoscalePolicy(enabled=True))
        assert (observed.ready, observed.scraped, observed.waiting) == (1, 1, 0.0)
        autoscale_tick()  # nothing queued
        assert Deployment.objects.get(pk=deployment.pk).replicas == 1

        httpx.post(f"{first.endpoint}/_control", json={"waiting": 9}, timeout=5).raise_for_status()
        autoscale_tick()
        deployment.refresh_from_db()
        assert deployment.replicas == 2
        entry = AuditEntry.objects.get(action="autoscale", target=str(deployment.pk))
        assert entry.actor_name == "autoscaler"  # the audit log names the part of the platform that acted
        assert entry.after["reasons"] == ["queue 9 per replica > target 4"]
        assert entry.after["observations"]["waiting"] == 9.0
        step_until(supervisor, lambda: len(ready(deployment)) == 2)

        autoscale_tick()  # still queued, but at max_replicas (and cooling down): nothing more
        assert AuditEntry.objects.filter(action="autoscale", target=str(deployment.pk)).count() == 1

    def test_a_quiet_deployment_scales_in_and_its_surplus_replica_is_drained(self, supervisor):
        supervisor.models = frozenset({"as-quiet"})
        deployment = make_deployment("as-quiet", replicas=2, scale_in_quiet_seconds=0, cooldown_seconds=0)
        step_until(supervisor, lambda: len(ready(deployment)) == 2)
        autoscale_tick()
        deployment.refresh_from_db()
        assert deployment.replicas == 1
        entry = AuditEntry.objects.get(action="autoscale", target=str(deployment.pk))
        assert entry.after["reasons"][0].startswith("quiet for 0 s")
        step_until(supervisor, lambda: Replica.objects.filter(deployment=deployment, state="stopped").count() == 1)
        assert len(ready(deployment)) == 1

    def test_a_deployment_without_a_policy_is_left_alone(self, supervisor):
        supervisor.models = frozenset({"as-off"})
        deployment = make_deployment("as-off", replicas=2)
        Deployment.objects.filter(pk=deployment.pk).update(autoscale={})
        step_until(supervisor, lambda: len(ready(deployment)) == 2)
        autoscale_tick()
        assert Deployment.objects.get(pk=deployment.pk).replicas == 2
