"""Rollback of a model to the version it served before its last hot-swap or canary promotion
(rollout.rollback): which version, by which service, audited, and what is refused."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from core.errors import InvalidInput
from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica
from rollout.canary import canary_create, canary_promote
from rollout.hotswap import (
    SWAP,
    deployment_swap_drain,
    deployment_swap_finish,
    deployment_swap_shift,
    deployment_swap_version,
    open_swaps,
)
from rollout.rollback import VIA_HOT_SWAP, VIA_TRAFFIC, model_rollback, rollback_plan
from tests.support.registry import make_version

pytestmark = pytest.mark.django_db


@pytest.fixture
def ops():
    return get_user_model().objects.create_user(username="ops-rb", password="x")


def model_with(name: str, *versions: str) -> Model:
    """``name`` with ``versions`` registered and the first deployed, running at 100 %, one ready replica."""
    model = Model.objects.create(name=name, task="chat")
    made = [make_version(model, version) for version in versions]
    ready_on(Deployment.objects.create(version=made[0], status="running", traffic_weight=100))
    return model


def ready_on(deployment: Deployment) -> None:
    wanted = max(1, deployment.replicas)
    for _ in range(wanted - deployment.replica_set.filter(state="ready").count()):
        Replica.objects.create(
            deployment=deployment, host="h", state="ready", endpoint="http://x", last_heartbeat=timezone.now()
        )


def serving(model: Model) -> Deployment:
    return Deployment.objects.filter(
        version__model=model, status__in=("pending", "running"), traffic_weight__gt=0
    ).get()


def version(model: Model, name: str) -> ModelVersion:
    return ModelVersion.objects.get(model=model, version=name)


def swapped(model: Model, to: str) -> Deployment:
    """Hot-swap the deployment serving ``model`` to ``to``, through to completed; the new deployment."""
    old = serving(model)
    new = deployment_swap_version(actor=None, deployment=old, version=version(model, to))
    carried_through(old, new)
    return new


def carried_through(old: Deployment, new: Deployment) -> None:
    """The swap of ``old`` to ``new`` through its steps, as the supervisors would make them."""
    ready_on(new)
    entry = AuditEntry.objects.filter(action=SWAP, target=str(old.pk)).latest("id")
    assert deployment_swap_shift(swap=entry, heartbeat_after=timezone.now() - timedelta(minutes=1))
    deployment_swap_drain(swap=entry)
    Replica.objects.filter(deployment=old).update(state="stopped")
    deployment_swap_finish(swap=entry, outcome="completed", reason="every old replica stopped")
    new.refresh_from_db()


def weights(model: Model) -> dict[str, int]:
    rows = Deployment.objects.filter(version__model=model, status__in=("pending", "running"))
    return dict(rows.values_list("version__version", "traffic_weight"))


class TestAfterAHotSwap:
    def test_it_swaps_the_new_deployment_back_to_the_version_before(self, ops):
        model = model_with("rb-swap", "v1", "v2")
        v2 = swapped(model, "v2")
        plan = rollback_plan(model=model)
        assert plan is not None
        assert plan.available
        assert (plan.from_version, plan.to_version, plan.via, plan.deployment) == ("v2", "v1", VIA_HOT_SWAP, v2)
        assert (plan.change.kind, plan.change.deployment_id) == ("hot-swap", v2.pk)

        done = model_rollback(actor=ops, model=model, version="v1")

        # Through the hot-swap: a new v1 deployment at weight 0, the traffic on v2 until it is ready.
        assert done.swap_to is not None
        assert (done.swap_to.version.version, done.swap_to.traffic_weight) == ("v1", 0)
        assert weights(model) == {"v2": 100, "v1": 0}
        [swap] = [s for s in open_swaps() if s.model == model.name]
        assert (swap.old_id, swap.new_id, swap.from_version, swap.to_version) == (v2.pk, done.swap_to.pk, "v2", "v1")
        entry = AuditEntry.objects.get(action="model.rollback", target=model.name)
        assert (entry.target_type, entry.actor_name) == ("model", "ops-rb")
        assert entry.before == {"version": "v2", "weights": {"v2": 100}}
        assert entry.after == {
            "version": "v1", "via": "hot-swap", "undoes": plan.change.entry_id, "deployment": v2.pk,
            "swap_to": done.swap_to.pk,
        }  # fmt: skip
        # While that swap is under way, nothing more is offered.
        assert "under way" in rollback_plan(model=model).refusal

    def test_after_two_swaps_it_goes_back_one(self):
        model = model_with("rb-two", "v1", "v2", "v3")
        swapped(model, "v2")
        v3 = swapped(model, "v3")
        plan = rollback_plan(model=model)
        assert (plan.to_version, plan.deployment) == ("v2", v3)

    def test_the_rollback_once_done_is_the_change_to_undo(self, ops):
        model = model_with("rb-undo", "v1", "v2")
        swapped(model, "v2")
        v2 = serving(model)
        new = model_rollback(actor=ops, model=model, version="v1").swap_to
        assert new is not None
        carried_through(v2, new)  # the rollback's swap, like any other
        plan = rollback_plan(model=model)
        assert (plan.from_version, plan.to_version, plan.deployment) == ("v1", "v2", new)

    def test_a_swap_not_shifted_yet_is_no_change(self):
        model = model_with("rb-starting", "v1", "v2")
        deployment_swap_version(actor=None, deployment=serving(model), version=version(model, "v2"))
        assert rollback_plan(model=model) is None


class TestAfterACanaryPromotion:
    def promoted(self, name: str) -> Model:
        model = model_with(name, "v1", "v2")
        ready_on(Deployment.objects.create(version=version(model, "v2"), status="running", traffic_weight=0))
        canary = canary_create(actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=60)
        canary_promote(actor=None, canary=canary)
        assert weights(model) == {"v1": 0, "v2": 100}
        return model

    def test_the_ready_base_takes_all_the_traffic_back_at_once(self, ops):
        model = self.promoted("rb-canary")
        plan = rollback_plan(model=model)
        assert (plan.from_version, plan.to_version, plan.via, plan.change.kind) == (
            "v2", "v1", VIA_TRAFFIC, "canary promotion"
        )  # fmt: skip
        done = model_rollback(actor=ops, model=model, version="v1")
        assert done.weights == {"v1": 100, "v2": 0}
        assert weights(model) == {"v1": 100, "v2": 0}
        entry = AuditEntry.objects.get(action="model.rollback", target=model.name)
        assert entry.after == {"version": "v1", "via": "traffic", "undoes": plan.change.entry_id,
                               "weights": {"v1": 100, "v2": 0}}  # fmt: skip
        assert AuditEntry.objects.filter(action="traffic.set", target=model.name, actor_name="ops-rb").exists()
        # The rollback is now the latest change: undoing it would go to v2 again.
        again = rollback_plan(model=model)
        assert (again.change.kind, again.to_version, again.available) == ("rollback", "v2", True)

    def test_a_base_whose_replicas_are_not_ready_gets_no_traffic(self, ops):
        model = self.promoted("rb-not-ready")
        base = Deployment.objects.get(version__model=model, version__version="v1")
        Replica.objects.filter(deployment=base).update(last_heartbeat=timezone.now() - timedelta(minutes=10))
        plan = rollback_plan(model=model)
        assert plan.refusal == (
            f"v1's deployment #{base.pk} has 0 of 1 replica ready: traffic would reach replicas that cannot serve it."
        )
        with pytest.raises(InvalidInput) as exc:
            model_rollback(actor=ops, model=model, version="v1")
        assert exc.value.field == "model"
        assert weights(model) == {"v1": 0, "v2": 100}
        assert not AuditEntry.objects.filter(action="model.rollback").exists()

    def test_a_base_stopped_since_is_brought_back_by_a_hot_swap(self, ops):
        model = self.promoted("rb-base-gone")
        Deployment.objects.filter(version__model=model, version__version="v1").update(status="stopped")
        plan = rollback_plan(model=model)
        assert (plan.via, plan.deployment, plan.available) == (VIA_HOT_SWAP, serving(model), True)
        done = model_rollback(actor=ops, model=model, version="v1")
        assert done.swap_to is not None
        assert done.swap_to.version.version == "v1"
        assert weights(model) == {"v1": 0, "v2": 100}  # until its replicas are ready


class TestRefusals:
    def test_nothing_to_roll_back_to(self, ops):
        model = model_with("rb-never", "v1", "v2")
        assert rollback_plan(model=model) is None
        with pytest.raises(InvalidInput, match="never changed: nothing to roll back to"):
            model_rollback(actor=ops, model=model, version="v1")
        assert not AuditEntry.objects.filter(action="model.rollback").exists()

    def test_a_previous_version_no_longer_registered(self):
        model = model_with("rb-gone", "v2")
        AuditEntry.objects.create(
            action="canary.promote", target_type="canary", target=model.name,
            before={}, after={"base_version": "v1", "canary_version": "v2"},
        )  # fmt: skip
        plan = rollback_plan(model=model)
        assert (plan.to_version, plan.available) == ("v1", False)
        assert plan.refusal == "v1 is no longer a registered version of rb-gone."

    def test_another_version_than_the_previous_one_is_refused(self, ops):
        model = model_with("rb-which", "v1", "v2", "v3")
        swapped(model, "v2")
        swapped(model, "v3")
        with pytest.raises(InvalidInput) as exc:
            model_rollback(actor=ops, model=model, version="v1")
        assert exc.value.field == "version"
        assert "would roll back to v2, not v1" in exc.value.message
        assert weights(model) == {"v3": 100}

    def test_an_active_canary_owns_the_split(self):
        model = model_with("rb-canary-on", "v1", "v2", "v3")
        swapped(model, "v2")
        ready_on(Deployment.objects.create(version=version(model, "v3"), status="running", traffic_weight=0))
        canary_create(actor=None, model=model, base_version="v2", canary_version="v3", interval_seconds=60)
        assert "canary sets rb-canary-on's traffic" in rollback_plan(model=model).refusal

    def test_a_deployment_that_took_over_and_stopped(self):
        model = model_with("rb-stopped", "v1", "v2")
        new = swapped(model, "v2")
        Deployment.objects.filter(pk=new.pk).update(status="stopped")
        assert rollback_plan(model=model).refusal == f"Deployment #{new.pk}, which took over from v1, no longer serves."
