"""The warm pool: standby replicas that are started, ready and heart-beaten but never routed,
promoted first on scale-up, on a serving replica failing and on a hot-swap, and refilled by the
supervisors. The services on rows (no process), then the supervisor stepped in process with
fake engines (``tests/support/busy_engine.py``)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from core.errors import InvalidInput
from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica
from registry.selectors import ready_replicas
from registry.services import (
    deployment_bounds_set,
    deployment_create,
    deployment_scale,
    replica_claim,
    replica_surplus,
)
from registry.warm_pool import (
    deployment_standby_set,
    deployments_promote_standbys,
    replica_surplus_pick,
)
from rollout.autoscaler import AutoscalePolicy
from rollout.hotswap import deployment_prewarm, deployment_swap_version, open_swaps, swap_get, swap_step
from rollout.observations import observe_deployment
from serving.gateway.routing import load_routing_table
from serving.supervisor.host import Supervisor
from tests.support.gateway import committed

pytestmark = pytest.mark.django_db

BUSY_LAUNCHER = f"{sys.executable} -m tests.support.busy_engine"


def fake_model(name: str, *, versions: tuple[str, ...] = ("1",)) -> Model:
    model = Model.objects.create(name=f"{name}-{uuid.uuid4().hex[:6]}", task="chat")
    for label in versions:
        ModelVersion.objects.create(
            model=model, version=label, framework="fake", artifact_uri=f"local://{model.name}/{label}",
            artifact_sha256="0" * 64, artifact_size=1, config={"max_seq_len": 512},
        )  # fmt: skip
    return model


def deploy(name: str, *, replicas: int = 1, standby: int = 0, versions: tuple[str, ...] = ("1",)) -> Deployment:
    model = fake_model(name, versions=versions)
    version = model.versions.get(version=versions[0])
    return deployment_create(version=version, replicas=replicas, max_replicas=max(4, replicas), standby=standby)


def row(deployment: Deployment, *, state: str = "ready", standby: bool = False, stale: bool = False) -> Replica:
    beat = timezone.now() - timedelta(minutes=5) if stale else timezone.now()
    return Replica.objects.create(
        deployment=deployment, host="h", state=state, standby=standby, endpoint="http://127.0.0.1:9",
        last_heartbeat=beat if state == "ready" else None,
    )  # fmt: skip


def standbys(deployment: Deployment) -> set[int]:
    return set(Replica.objects.filter(deployment=deployment, standby=True).values_list("id", flat=True))


class TestClaim:
    def test_it_claims_serving_places_then_the_pool_and_never_more(self):
        deployment = deploy("claim", replicas=2, standby=2)
        roles = []
        for _ in range(5):
            claimed = replica_claim(deployment=deployment, host="h")
            roles.append(None if claimed is None else claimed.standby)
        assert roles == [False, False, True, True, None]
        assert Replica.objects.filter(deployment=deployment).count() == 4
        assert replica_surplus(deployment=deployment) == 0

    def test_a_ready_standby_is_promoted_instead_of_a_cold_claim(self, django_capture_on_commit_callbacks):
        deployment = deploy("claim-warm", replicas=1, standby=1)
        warm = row(deployment, standby=True)
        told: list[list[int]] = []
        with django_capture_on_commit_callbacks(execute=True):
            claimed = replica_claim(deployment=deployment, host="h", on_promoted=told.append)
        assert told == [[warm.pk]]  # the supervisor announces it (routing changed), after the commit
        # The standby took the serving place; what was claimed is the pool's refill.
        assert claimed is not None
        assert claimed.standby
        assert standbys(deployment) == {claimed.pk}
        assert not Replica.objects.get(pk=warm.pk).standby
        assert replica_claim(deployment=deployment, host="h") is None

    def test_supervisors_claiming_at_once_never_over_fill_replicas_and_standby(self, django_db_blocker):
        """Six claimers on connections of their own, started together: the row lock lets
        exactly replicas + standby through, serving places first."""

        def create() -> int:
            return deploy("claim-race", replicas=2, standby=2).pk

        deployment_id = committed(django_db_blocker, create)
        barrier = threading.Barrier(6)

        def claimer(host: str) -> list[bool]:
            barrier.wait()
            roles = []
            try:
                while (claimed := replica_claim(deployment=Deployment(pk=deployment_id), host=host)) is not None:
                    roles.append(claimed.standby)
            finally:
                connection.close()
            return roles

        try:
            with django_db_blocker.unblock(), ThreadPoolExecutor(max_workers=6) as pool:
                claims = [role for found in pool.map(claimer, [f"h{i}" for i in range(6)]) for role in found]
            assert sorted(claims) == [False, False, True, True]
            rows = committed(django_db_blocker, lambda: list(Replica.objects.filter(deployment_id=deployment_id)))
            assert sorted(r.standby for r in rows) == [False, False, True, True]
        finally:

            def drop() -> None:
                deployment = Deployment.objects.select_related("version__model").get(pk=deployment_id)
                model = deployment.version.model
                deployment.delete()
                ModelVersion.objects.filter(model=model).delete()
                model.delete()

            committed(django_db_blocker, drop)


class TestRouting:
    def test_a_standby_is_never_routed_nor_scraped(self):
        deployment = deploy("routing", replicas=1, standby=2)
        serving = row(deployment)
        row(deployment, standby=True)
        row(deployment, standby=True)
        assert [r.pk for r in ready_replicas(deployment_ids=[deployment.pk])] == [serving.pk]
        route = load_routing_table().models[deployment.version.model.name]
        assert [replica.id for version in route.versions for replica in version.replicas] == [serving.pk]
        observed = observe_deployment(deployment, AutoscalePolicy())
        assert observed.ready == 1


class TestPromotion:
    def test_scale_up_promotes_ready_standbys_in_the_same_write(self):
        deployment = deploy("scale-up", replicas=1, standby=2)
        row(deployment)
        first, second = row(deployment, standby=True), row(deployment, standby=True)
        deployment_scale(actor=None, deployment=deployment, replicas=3, reasons=["test"], action="deployment.scale")
        assert standbys(deployment) == set()
        promoted = AuditEntry.objects.filter(action="replica.promote", target__in=[str(first.pk), str(second.pk)])
        assert {e.after["reason"] for e in promoted} == {"scale-up"}
        assert promoted.count() == 2
        # The pool refills: the next two claims are standbys.
        assert [replica_claim(deployment=deployment, host="h").standby for _ in range(2)] == [True, True]

    def test_raising_min_replicas_above_the_count_promotes_too(self):
        deployment = deploy("bounds-up", replicas=1, standby=1)
        row(deployment)
        warm = row(deployment, standby=True)
        deployment_bounds_set(actor=None, deployment=deployment, min_replicas=2)
        assert standbys(deployment) == set()
        assert AuditEntry.objects.filter(action="replica.promote", target=str(warm.pk)).exists()

    def test_a_stale_or_loading_standby_is_not_promoted(self):
        deployment = deploy("stale", replicas=1, standby=2)
        row(deployment)
        row(deployment, standby=True, stale=True)
        row(deployment, state="starting", standby=True)
        deployment_scale(actor=None, deployment=deployment, replicas=2, reasons=["test"], action="deployment.scale")
        assert len(standbys(deployment)) == 2
        assert not AuditEntry.objects.filter(action="replica.promote", after__deployment=deployment.pk).exists()

    def test_a_failed_serving_replica_swaps_places_with_a_ready_standby(self):
        deployment = deploy("failover", replicas=1, standby=1)
        failed = row(deployment, state="failed")
        warm = row(deployment, standby=True)
        assert deployments_promote_standbys(deployment_ids=[deployment.pk]) == [warm.pk]
        # The failed one restarts as the pool's standby: counts stay, nothing is drained.
        assert standbys(deployment) == {failed.pk}
        assert replica_surplus(deployment=deployment) == 0
        entry = AuditEntry.objects.get(action="replica.promote", target=str(warm.pk))
        assert (entry.after["in_place_of"], entry.after["reason"]) == (failed.pk, "replacement")
        assert deployments_promote_standbys(deployment_ids=[deployment.pk]) == []

    def test_a_lost_serving_replica_is_replaced_and_the_pool_refilled(self):
        deployment = deploy("lost", replicas=1, standby=1)
        row(deployment, state="stopped")  # its host's rows were released
        warm = row(deployment, standby=True)
        assert deployments_promote_standbys(deployment_ids=[deployment.pk]) == [warm.pk]
        claimed = replica_claim(deployment=deployment, host="h")
        assert claimed is not None
        assert claimed.standby

    def test_nothing_is_promoted_for_a_deployment_no_longer_serving(self):
        deployment = deploy("draining", replicas=1, standby=1)
        row(deployment, state="failed")
        row(deployment, standby=True)
        Deployment.objects.filter(pk=deployment.pk).update(status="draining")
        assert deployments_promote_standbys(deployment_ids=[deployment.pk]) == []


class TestScaleIn:
    def test_lowering_the_standby_count_drains_standbys_and_no_serving_replica(self):
        deployment = deploy("fewer-standbys", replicas=1, standby=2)
        serving = row(deployment)
        ready_standby, loading_standby = row(deployment, standby=True), row(deployment, state="starting", standby=True)
        deployment_standby_set(actor=None, deployment=deployment, standby=1)
        mine = [serving.pk, ready_standby.pk, loading_standby.pk]
        assert replica_surplus_pick(deployment=deployment, replica_ids=mine) == loading_standby.pk  # the cold one first
        assert replica_surplus_pick(deployment=deployment, replica_ids=[serving.pk]) is None
        assert AuditEntry.objects.get(action="deployment.standby", target=str(deployment.pk)).after == {"standby": 1}

    def test_scale_in_drains_a_serving_replica_and_keeps_the_pool(self):
        deployment = deploy("scale-in", replicas=2, standby=1)
        older, newer = row(deployment), row(deployment)
        warm = row(deployment, standby=True)
        deployment_scale(actor=None, deployment=deployment, replicas=1, reasons=["test"], action="deployment.scale")
        assert replica_surplus_pick(deployment=deployment, replica_ids=[older.pk, newer.pk, warm.pk]) == newer.pk
        assert standbys(deployment) == {warm.pk}  # demotes nothing

    @pytest.mark.parametrize("bad", [-1, 32768, True, "2"])
    def test_a_bad_standby_count_is_refused_naming_the_field(self, bad: Any):
        deployment = deploy("bad-standby")
        with pytest.raises(InvalidInput) as exc:
            deployment_standby_set(actor=None, deployment=deployment, standby=bad)
        assert exc.value.field == "standby"

    def test_a_deployment_with_no_serving_replica_needs_a_standby(self):
        model = fake_model("no-serving")
        with pytest.raises(InvalidInput) as exc:
            deployment_create(version=model.versions.get(), replicas=0, min_replicas=0)
        assert exc.value.field == "replicas"
        pool = deployment_create(version=model.versions.get(), replicas=0, min_replicas=0, standby=1)
        with pytest.raises(InvalidInput, match="at least one standby"):
            deployment_standby_set(actor=None, deployment=pool, standby=0)


class TestWarmSwapService:
    def test_the_swap_adopts_the_warm_pool_and_promotes_its_standbys(self):
        old = deploy("warm-swap", replicas=2, standby=1, versions=("1", "2"))
        Deployment.objects.filter(pk=old.pk).update(status="running")
        row(old)
        row(old)
        target = old.version.model.versions.get(version="2")
        pool = deployment_prewarm(actor=None, deployment=old, version=target)
        assert (pool.replicas, pool.standby, pool.traffic_weight) == (0, 2, 0)
        assert deployment_prewarm(actor=None, deployment=old, version=target).pk == pool.pk  # one pool
        warm = {row(pool, standby=True).pk, row(pool, standby=True).pk}
        assert load_routing_table().models[old.version.model.name].versions  # the pool routes nothing:
        assert not ready_replicas(deployment_ids=[pool.pk]).exists()
        new = deployment_swap_version(actor=None, deployment=old, version=target)
        assert new.pk == pool.pk
        new.refresh_from_db()
        assert (new.replicas, new.standby, new.min_replicas, new.max_replicas) == (2, 1, 1, old.max_replicas)
        assert {r.pk for r in ready_replicas(deployment_ids=[new.pk])} == warm
        [swap] = [s for s in open_swaps() if s.old_id == old.pk]
        assert sorted(swap.entry.after["promoted"]) == sorted(warm)
        swap_step()
        assert swap_get(swap_id=swap.entry.pk).shifted_at is not None
        old.refresh_from_db()
        new.refresh_from_db()
        assert (old.traffic_weight, new.traffic_weight) == (0, 100)

    def test_a_swap_with_no_warm_pool_carries_the_standby_count_over(self):
        old = deploy("cold-swap", replicas=1, standby=3, versions=("1", "2"))
        new = deployment_swap_version(actor=None, deployment=old, version=old.version.model.versions.get(version="2"))
        assert (new.replicas, new.standby) == (1, 3)

    def test_the_command_prewarms(self):
        old = deploy("prewarm-command", replicas=1, versions=("1", "2"))
        call_command("swap_version", old.version.model.name, "2", "--prewarm", "--standby", "2", "--no-wait")
        pool = Deployment.objects.get(version__model=old.version.model, version__version="2")
        assert (pool.replicas, pool.standby, pool.traffic_weight) == (0, 2, 0)


# --- The supervisor, stepped in process with fake engines ---------------------------


@pytest.fixture
def make_supervisor(settings, tmp_path) -> Iterator[Callable[..., Supervisor]]:
    settings.WORKER_ENGINE_LAUNCHER = BUSY_LAUNCHER
    settings.WORKER_HEARTBEAT_SECONDS = 0.2
    settings.WORKER_DRAIN_TIMEOUT = 10
    settings.WORKER_MAX_BACKOFF = 1
    settings.ROUTING_REFRESH_SECONDS = 0.2  # a swap drains 2 * this + 1 s after its shift
    made: list[Supervisor] = []

    def make(model: str, slots: int = 4) -> Supervisor:
        supervisor = Supervisor(
            host=f"warm-{uuid.uuid4().hex[:8]}", slots=[str(i) for i in range(slots)], log_dir=tmp_path,
            models=frozenset({model}), report=lambda m: None,
        )  # fmt: skip
        made.append(supervisor)
        return supervisor

    yield make
    for supervisor in made:
        supervisor.close()


def step_until(supervisor: Supervisor, condition: Callable[[], Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        supervisor.step()
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def counts(deployment: Deployment) -> tuple[int, int]:
    """(ready serving, ready standby) replicas."""
    ready = Replica.objects.filter(deployment=deployment, state="ready")
    return ready.filter(standby=False).count(), ready.filter(standby=True).count()


class TestSupervisor:
    def test_standbys_start_ready_unrouted_and_scale_up_promotes_them_then_refills(self, make_supervisor):
        deployment = deploy("sup-scale", replicas=1, standby=1)
        supervisor = make_supervisor(deployment.version.model.name)
        step_until(supervisor, lambda: counts(deployment) == (1, 1))
        [warm] = standbys(deployment)
        route = load_routing_table().models[deployment.version.model.name]
        assert warm not in {r.id for v in route.versions for r in v.replicas}
        # Heart-beaten like any other: it stays fresh.
        before = Replica.objects.get(pk=warm).last_heartbeat
        step_until(supervisor, lambda: Replica.objects.get(pk=warm).last_heartbeat != before)
        deployment_scale(actor=None, deployment=deployment, replicas=2, reasons=["test"], action="deployment.scale")
        assert counts(deployment) == (2, 0)  # served at once, by the promoted standby
        assert warm in {r.pk for r in ready_replicas(deployment_ids=[deployment.pk])}
        step_until(supervisor, lambda: counts(deployment) == (2, 1))  # the pool refilled
        assert Replica.objects.filter(deployment=deployment).exclude(state="stopped").count() == 3

    def test_a_killed_serving_engine_is_replaced_by_the_standby(self, make_supervisor):
        deployment = deploy("sup-fail", replicas=1, standby=1)
        supervisor = make_supervisor(deployment.version.model.name)
        step_until(supervisor, lambda: counts(deployment) == (1, 1))
        [serving] = ready_replicas(deployment_ids=[deployment.pk])
        [warm] = standbys(deployment)
        os.killpg(supervisor.engines[serving.pk].pid, signal.SIGKILL)
        step_until(supervisor, lambda: warm in {r.pk for r in ready_replicas(deployment_ids=[deployment.pk])})
        # The failed one restarts as the standby: the pool refills with no cold serving start.
        step_until(supervisor, lambda: counts(deployment) == (1, 1))
        assert standbys(deployment) == {serving.pk}
        assert Replica.objects.filter(deployment=deployment).count() == 2

    def test_lowering_the_standby_count_drains_the_standbys(self, make_supervisor):
        deployment = deploy("sup-fewer", replicas=1, standby=2)
        supervisor = make_supervisor(deployment.version.model.name)
        step_until(supervisor, lambda: counts(deployment) == (1, 2))
        [serving] = ready_replicas(deployment_ids=[deployment.pk])
        deployment_standby_set(actor=None, deployment=deployment, standby=0)
        step_until(supervisor, lambda: counts(deployment) == (1, 0) and not supervisor.engines.keys() - {serving.pk})
        assert Replica.objects.get(pk=serving.pk).state == "ready"

    def test_a_warm_hot_swap_promotes_the_new_versions_standbys(self, make_supervisor):
        old = deploy("sup-swap", replicas=1, versions=("1", "2"))
        supervisor = make_supervisor(old.version.model.name)
        step_until(supervisor, lambda: counts(old) == (1, 0))
        target = old.version.model.versions.get(version="2")
        pool = deployment_prewarm(actor=None, deployment=old, version=target)
        step_until(supervisor, lambda: counts(pool) == (0, 1))
        [warm] = standbys(pool)
        deployment_swap_version(actor=None, deployment=old, version=target)
        [swap] = [s for s in open_swaps() if s.old_id == old.pk]
        step_until(supervisor, lambda: swap_get(swap_id=swap.entry.pk).outcome is not None)
        done = swap_get(swap_id=swap.entry.pk)
        assert done is not None
        assert done.outcome == "completed"
        # Served by the standby readied before: no replica of the new version was started cold.
        assert list(Replica.objects.filter(deployment=pool).values_list("id", "standby", "state")) == [
            (warm, False, "ready")
        ]
        assert Deployment.objects.get(pk=old.pk).status == "stopped"
