"""The audit log records what changed: a write that changed nothing leaves no entry (issue 23),
while creations, events and a hot-swap's step markers are always recorded."""

from __future__ import annotations

import pytest

from registry.models import AuditEntry, Deployment, Model
from registry.services import CANARY_CONTROLLER, audit_record, deployment_bounds_set, traffic_set
from rollout.autoscaler import deployment_autoscale_set
from rollout.hotswap import SWAP_DRAIN, deployment_swap_drain, deployment_swap_version
from serving.shadow.services import shadow_policy_set
from tests.support.registry import make_version

pytestmark = pytest.mark.django_db


def entries(action: str, target: str) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(action=action, target=target).order_by("id"))


class TestNoEntryForNothingChanged:
    def test_the_same_traffic_split_again_records_nothing(self, chat_model, people):
        traffic_set(actor=people["ml"], model=chat_model, weights={"v1": 100})
        assert entries("traffic.set", chat_model.name) == []

    def test_a_real_split_change_records_one_entry_with_before_and_after(self, chat_model, people):
        traffic_set(actor=people["ml"], model=chat_model, weights={"v1": 90, "v2": 10})
        traffic_set(actor=people["ml"], model=chat_model, weights={"v1": 90, "v2": 10})

        [entry] = entries("traffic.set", chat_model.name)
        assert entry.before == {"v1": 100, "v2": 0}
        assert entry.after == {"v1": 90, "v2": 10}
        assert entry.actor_name == "ml"

    def test_the_same_autoscale_policy_again_records_nothing(self, chat_model, people):
        deployment = Deployment.objects.get(version__model=chat_model, version__version="v1")
        policy = {"enabled": True, "target_p99_ms": 800}
        deployment_autoscale_set(actor=people["ml"], deployment=deployment, autoscale=policy)
        deployment_autoscale_set(actor=people["ml"], deployment=deployment, autoscale=policy)
        deployment_autoscale_set(actor=people["ml"], deployment=deployment, autoscale={**policy, "enabled": False})

        found = entries("deployment.autoscale", str(deployment.pk))
        assert [e.after["autoscale"]["enabled"] for e in found] == [True, False]

    def test_the_same_scale_bounds_again_record_nothing(self, chat_model, people):
        deployment = Deployment.objects.get(version__model=chat_model, version__version="v1")
        deployment_bounds_set(actor=people["ml"], deployment=deployment, min_replicas=1, max_replicas=3)
        deployment_bounds_set(actor=people["ml"], deployment=deployment, min_replicas=1, max_replicas=3)
        assert len(entries("deployment.bounds", str(deployment.pk))) == 1

    def test_the_same_shadow_policy_again_records_nothing(self, chat_model, people):
        candidate = chat_model.versions.get(version="v2")
        for _ in range(2):
            shadow_policy_set(model=chat_model, candidate=candidate, percent=5, actor=people["ml"])
        assert len(entries("shadow.set", chat_model.name)) == 1

    def test_the_rule_is_in_audit_record_itself(self, people):
        same = {"replicas": 2}
        assert audit_record(actor=people["ml"], action="x.set", target_type="model", target="t", before=same,
                            after=dict(same)) is None  # fmt: skip
        assert not AuditEntry.objects.filter(action="x.set").exists()


class TestEntriesThatStay:
    def test_a_creation_or_an_event_without_before_is_recorded(self, people):
        audit_record(actor=CANARY_CONTROLLER, action="x.event", target_type="model", target="t", before=None,
                     after=None)  # fmt: skip
        audit_record(actor=people["ml"], action="x.create", target_type="model", target="t", before=None,
                     after={"name": "t"})  # fmt: skip
        assert AuditEntry.objects.filter(action__in=["x.event", "x.create"]).count() == 2
        assert AuditEntry.objects.get(action="x.event").actor_name == "canary controller"

    def test_always_records_an_unchanged_entry(self, people):
        same = {"status": "stopped"}
        entry = audit_record(actor=None, action="x.step", target_type="deployment", target="1", before=same,
                             after=dict(same), always=True)  # fmt: skip
        assert entry is not None
        assert entry.before == entry.after == same

    def test_a_swap_drain_is_marked_even_when_the_old_deployment_stopped_already(self, people):
        """The drain's entry is the marker swap_step reads: without it the swap would never move on."""
        model = Model.objects.create(name="swap-noop", task="chat")
        old = Deployment.objects.create(version=make_version(model, "1"), status="running", traffic_weight=100)
        new_version = make_version(model, "2")
        deployment_swap_version(actor=people["ml"], deployment=old, version=new_version)
        swap = AuditEntry.objects.get(action="deployment.swap", target=str(old.pk))
        Deployment.objects.filter(pk=old.pk).update(status="stopped")

        assert deployment_swap_drain(swap=swap)

        drain = AuditEntry.objects.get(action=SWAP_DRAIN, after__swap=swap.pk)
        assert drain.before == drain.after == {"swap": swap.pk, "status": "stopped"}
        assert not deployment_swap_drain(swap=swap)


class TestTheApiFiltersByObject:
    def test_a_typed_target_brings_what_is_under_it_and_a_plain_one_stays_exact(self, ml, people, chat_model):
        v1 = Deployment.objects.get(version__model=chat_model, version__version="v1")
        deployment_bounds_set(actor=people["ml"], deployment=v1, min_replicas=1, max_replicas=2)
        traffic_set(actor=people["ml"], model=chat_model, weights={"v1": 50, "v2": 50})

        def actions(target: str) -> list[str]:
            return [e["action"] for e in ml.get("/api/v1/audit", {"target": target}).json()["results"]]

        assert actions(f"deployment:{v1.pk}") == ["deployment.bounds"]
        assert actions("model:gpt-tiny") == ["traffic.set", "deployment.bounds"]
        assert actions("gpt-tiny") == ["traffic.set"]
