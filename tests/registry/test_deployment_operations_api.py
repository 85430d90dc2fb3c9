"""The management API's deployment operations: hot-swap (start, follow, cancel), replicas and
their bounds, the autoscaling policy, and shadow traffic; each audited, each for platform admins."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from billing.models import UsageRecord
from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica
from rollout.hotswap import (
    deployment_swap_drain,
    deployment_swap_finish,
    deployment_swap_shift,
    deployment_swap_version,
)
from serving.models import ShadowPolicy, ShadowRecord
from tests.support.api import client_for

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def empty_audit_log(db) -> None:
    """Session fixtures elsewhere commit deployments (and their audit entries); this test's
    transaction hides them."""
    AuditEntry.objects.all().delete()


def running(model: Model, version: str) -> Deployment:
    return Deployment.objects.get(version__model=model, version__version=version)


class TestSwap:
    def test_it_starts_a_swap_and_shows_its_phase(self, ml, chat_model):
        old = running(chat_model, "v1")
        response = ml.post(f"/api/v1/deployments/{old.pk}/swap", {"version": "v3"}, format="json")
        assert response.status_code == 202, response.content
        body = response.json()
        assert (body["from_version"], body["to_version"], body["phase"]) == ("v1", "v3", "starting")
        new = Deployment.objects.get(pk=body["new_deployment"])
        assert (new.version.version, new.traffic_weight, new.status) == ("v3", 0, "pending")
        assert ml.get(f"/api/v1/deployments/{old.pk}/swap").json()["id"] == body["id"]
        assert ml.get(f"/api/v1/deployments/{new.pk}/swap").json()["id"] == body["id"]
        assert AuditEntry.objects.filter(action="deployment.swap", target=str(old.pk)).count() == 1

    def test_a_second_swap_while_one_is_under_way_is_a_409(self, ml, chat_model):
        old = running(chat_model, "v1")
        assert ml.post(f"/api/v1/deployments/{old.pk}/swap", {"version": "v3"}, format="json").status_code == 202
        again = ml.post(f"/api/v1/deployments/{old.pk}/swap", {"version": "v3"}, format="json")
        assert again.status_code == 409

    @pytest.mark.parametrize(("version", "why"), [("v1", "serves v1 already"), ("v9", "has no version"), ("", "blank")])
    def test_a_bad_version_is_a_400_naming_it(self, ml, chat_model, version, why):
        old = running(chat_model, "v1")
        response = ml.post(f"/api/v1/deployments/{old.pk}/swap", {"version": version}, format="json")
        assert response.status_code == 400
        assert "version" in response.json()
        assert not AuditEntry.objects.exists()

    def test_cancel_stops_the_new_deployment_and_keeps_the_old(self, ml, chat_model):
        old = running(chat_model, "v1")
        started = ml.post(f"/api/v1/deployments/{old.pk}/swap", {"version": "v3"}, format="json").json()
        cancelled = ml.delete(f"/api/v1/deployments/{old.pk}/swap")
        assert cancelled.status_code == 200
        assert (cancelled.json()["phase"], cancelled.json()["outcome"]) == ("cancelled", "cancelled")
        assert Deployment.objects.get(pk=started["new_deployment"]).status == "stopped"
        assert (running(chat_model, "v1").status, running(chat_model, "v1").traffic_weight) == ("running", 100)
        assert ml.delete(f"/api/v1/deployments/{old.pk}/swap").status_code == 409  # over already

    def test_a_swap_adopts_a_warm_pool_of_the_new_version(self, ml, chat_model):
        old = running(chat_model, "v1")
        body = {"model_name": "gpt-tiny", "version": "v3", "traffic_percent": 0,
                "resources": {"replicas": 0, "standby": 1}}  # fmt: skip
        pool = ml.post("/api/v1/deployments", body, format="json").json()
        Replica.objects.create(deployment_id=pool["id"], host="h", state="ready", standby=True,
                               endpoint="http://127.0.0.1:9", last_heartbeat=timezone.now())  # fmt: skip
        started = ml.post(f"/api/v1/deployments/{old.pk}/swap", {"version": "v3"}, format="json")
        assert started.status_code == 202, started.content
        assert started.json()["new_deployment"] == pool["id"]
        adopted = Deployment.objects.get(pk=pool["id"])
        assert (adopted.replicas, adopted.traffic_weight) == (old.replicas, 0)
        assert not Replica.objects.filter(deployment=adopted, standby=True).exists()  # promoted

    def test_a_deployment_never_swapped_is_a_404(self, ml, chat_model):
        assert ml.get(f"/api/v1/deployments/{running(chat_model, 'v1').pk}/swap").status_code == 404
        assert ml.get("/api/v1/deployments/999999/swap").status_code == 404


def swapped_through(old: Deployment, to: str) -> Deployment:
    """``old`` hot-swapped to ``to``, then stepped to completed as the supervisors would."""
    version = ModelVersion.objects.get(model=old.version.model, version=to)
    new = deployment_swap_version(actor=None, deployment=old, version=version)
    Replica.objects.create(deployment=new, host="h", state="ready", endpoint="http://x", last_heartbeat=timezone.now())
    entry = AuditEntry.objects.filter(action="deployment.swap", target=str(old.pk)).latest("id")
    assert deployment_swap_shift(swap=entry, heartbeat_after=timezone.now() - timedelta(minutes=1))
    deployment_swap_drain(swap=entry)
    deployment_swap_finish(swap=entry, outcome="completed", reason="every old replica stopped")
    return new


class TestRollback:
    URL = "/api/v1/models/gpt-tiny/rollback"

    def test_it_shows_the_plan_then_swaps_back_to_the_version_before(self, ml, chat_model):
        assert ml.get(self.URL).status_code == 404  # never changed
        new = swapped_through(running(chat_model, "v1"), "v3")
        plan = ml.get(self.URL).json()
        assert plan | {"changed_at": "?"} == {
            "model": "gpt-tiny", "serving_version": "v3", "previous_version": "v1", "change": "hot-swap",
            "changed_at": "?", "via": "hot-swap", "deployment": new.pk, "available": True, "reason": "",
        }  # fmt: skip
        response = ml.post(self.URL, {"version": "v1"}, format="json")
        assert response.status_code == 202, response.content
        body = response.json()
        assert (body["rollback"]["previous_version"], body["weights"]) == ("v1", None)
        swap = body["swap"]
        assert (swap["old_deployment"], swap["from_version"], swap["to_version"], swap["phase"]) == (
            new.pk, "v3", "v1", "starting"
        )  # fmt: skip
        entry = AuditEntry.objects.get(action="model.rollback", target="gpt-tiny")
        assert (entry.actor_name, entry.after["swap_to"]) == ("ml", swap["new_deployment"])
        # Under way: GET says why not, and a second POST is a 409.
        again = ml.get(self.URL).json()
        assert again["available"] is False
        assert "under way" in again["reason"]
        assert ml.post(self.URL, {"version": "v1"}, format="json").status_code == 409

    def test_after_a_promotion_it_moves_the_traffic_at_once(self, ml, chat_model):
        Deployment.objects.filter(pk=running(chat_model, "v2").pk).update(status="running")
        v1 = running(chat_model, "v1")
        Replica.objects.create(deployment=v1, host="h", state="ready", last_heartbeat=timezone.now())
        Deployment.objects.filter(pk=v1.pk).update(traffic_weight=0)
        Deployment.objects.filter(version__model=chat_model, version__version="v2").update(traffic_weight=100)
        AuditEntry.objects.create(
            action="canary.promote", target_type="canary", target="gpt-tiny",
            before={}, after={"base_version": "v1", "canary_version": "v2"},
        )  # fmt: skip
        response = ml.post(self.URL, {"version": "v1"}, format="json")
        assert response.status_code == 200, response.content
        assert (response.json()["weights"], response.json()["swap"]) == ({"v1": 100, "v2": 0}, None)
        assert running(chat_model, "v1").traffic_weight == 100

    def test_a_version_other_than_the_previous_one_is_a_400_and_nothing_to_roll_back_a_409(self, ml, chat_model):
        assert ml.post(self.URL, {"version": "v1"}, format="json").status_code == 409
        swapped_through(running(chat_model, "v1"), "v3")
        response = ml.post(self.URL, {"version": "v2"}, format="json")
        assert response.status_code == 400
        assert "would roll back to v1, not v2" in response.json()["version"][0]
        assert ml.post(self.URL, {}, format="json").status_code == 400
        assert not AuditEntry.objects.filter(action="model.rollback").exists()
        assert ml.get("/api/v1/models/nope/rollback").status_code == 404


class TestReplicas:
    def test_it_sets_bounds_and_the_count_in_one_call(self, ml, chat_model):
        deployment = running(chat_model, "v1")
        body = {"min_replicas": 1, "max_replicas": 4, "replicas": 3}
        response = ml.put(f"/api/v1/deployments/{deployment.pk}/replicas", body, format="json")
        assert response.status_code == 200, response.content
        assert (response.json()["resources"]["max_replicas"], response.json()["resources"]["replicas"]) == (4, 3)
        deployment.refresh_from_db()
        assert (deployment.min_replicas, deployment.max_replicas, deployment.replicas) == (1, 4, 3)
        actions = set(AuditEntry.objects.values_list("action", flat=True))
        assert actions == {"deployment.bounds", "deployment.scale"}

    def test_lowering_max_below_the_count_moves_the_count(self, ml, chat_model):
        deployment = running(chat_model, "v1")
        Deployment.objects.filter(pk=deployment.pk).update(max_replicas=4, replicas=4)
        response = ml.put(f"/api/v1/deployments/{deployment.pk}/replicas", {"max_replicas": 2}, format="json")
        assert response.status_code == 200
        deployment.refresh_from_db()
        assert (deployment.max_replicas, deployment.replicas) == (2, 2)

    def test_it_sets_the_standby_count(self, ml, chat_model):
        deployment = running(chat_model, "v1")
        response = ml.put(f"/api/v1/deployments/{deployment.pk}/replicas", {"standby": 2}, format="json")
        assert response.status_code == 200, response.content
        assert response.json()["resources"]["standby"] == 2
        deployment.refresh_from_db()
        assert deployment.standby == 2
        entry = AuditEntry.objects.get(action="deployment.standby")
        assert (entry.before, entry.after) == ({"standby": 0}, {"standby": 2})

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"standby": -1}, "standby"),
            ({"standby": 40000}, "standby"),
            ({"standby": "many"}, "standby"),
            ({"replicas": 11}, "replicas"),  # above max_replicas (10)
            ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
            ({"min_replicas": 0}, "min_replicas"),
            ({}, "non_field_errors"),
        ],
    )
    def test_a_bad_value_is_a_400_and_changes_nothing(self, ml, chat_model, body, field):
        deployment = running(chat_model, "v1")
        before = Deployment.objects.values("replicas", "min_replicas", "max_replicas").get(pk=deployment.pk)
        response = ml.put(f"/api/v1/deployments/{deployment.pk}/replicas", body, format="json")
        assert response.status_code == 400
        assert field in response.json()
        assert Deployment.objects.values("replicas", "min_replicas", "max_replicas").get(pk=deployment.pk) == before
        assert not AuditEntry.objects.exists()


class TestAdapters:
    def test_it_sets_the_adapters_per_batch(self, ml, chat_model):
        deployment = running(chat_model, "v1")
        response = ml.put(f"/api/v1/deployments/{deployment.pk}/adapters", {"max_adapters": 4}, format="json")
        assert response.status_code == 200, response.content
        assert response.json()["resources"]["max_adapters"] == 4
        deployment.refresh_from_db()
        assert deployment.max_adapters == 4
        entry = AuditEntry.objects.get(action="deployment.adapters")
        assert (entry.target, entry.before, entry.after) == (
            str(deployment.pk),
            {"max_adapters": 0},
            {"max_adapters": 4},
        )
        # 0 turns LoRA off (no adapter is deployed on v1).
        response = ml.put(f"/api/v1/deployments/{deployment.pk}/adapters", {"max_adapters": 0}, format="json")
        assert response.status_code == 200
        assert response.json()["resources"]["max_adapters"] == 0

    @pytest.mark.parametrize(
        ("version", "body", "why"),
        [
            ("v1", {"max_adapters": 65}, "less than or equal to 64"),
            ("v1", {"max_adapters": -1}, "greater than or equal to 0"),
            ("v1", {}, "required"),
            ("v3", {"max_adapters": 2}, "is stopped"),
        ],
    )
    def test_a_bad_value_is_a_400_naming_max_adapters(self, ml, chat_model, version, body, why):
        deployment = running(chat_model, version)
        response = ml.put(f"/api/v1/deployments/{deployment.pk}/adapters", body, format="json")
        assert response.status_code == 400
        assert why in str(response.json()["max_adapters"])
        assert Deployment.objects.get(pk=deployment.pk).max_adapters == 0
        assert not AuditEntry.objects.exists()

    def test_an_unknown_deployment_is_a_404(self, ml):
        assert ml.put("/api/v1/deployments/999999/adapters", {"max_adapters": 1}, format="json").status_code == 404


class TestAutoscale:
    def test_it_sets_the_policy(self, ml, chat_model):
        deployment = running(chat_model, "v1")
        policy = {"enabled": True, "target_queue_per_replica": 2, "cooldown_seconds": 30}
        response = ml.put(f"/api/v1/deployments/{deployment.pk}/autoscale", policy, format="json")
        assert response.status_code == 200, response.content
        assert response.json()["autoscale"]["target_queue_per_replica"] == 2
        deployment.refresh_from_db()
        assert deployment.autoscale["enabled"] is True
        assert AuditEntry.objects.get(action="deployment.autoscale").after["autoscale"]["cooldown_seconds"] == 30

    @pytest.mark.parametrize(
        ("policy", "field"),
        [({"enabled": "yes"}, "enabled"), ({"surge": 3}, "surge"), ({"cooldown_seconds": -1}, "cooldown_seconds")],
    )
    def test_a_bad_key_is_a_400_naming_it(self, ml, chat_model, policy, field):
        deployment = running(chat_model, "v1")
        response = ml.put(f"/api/v1/deployments/{deployment.pk}/autoscale", policy, format="json")
        assert response.status_code == 400
        assert field in response.json()
        assert not AuditEntry.objects.exists()


class TestShadow:
    def test_it_sets_shows_and_deletes_a_policy(self, ml, chat_model):
        response = ml.put("/api/v1/models/gpt-tiny/shadow", {"version": "v2", "percent": "12.5"}, format="json")
        assert response.status_code == 200, response.content
        assert response.json()["policy"] == {"version": "v2", "percent": "12.50", "enabled": True}
        assert ShadowPolicy.objects.get(model=chat_model).percent == pytest.approx(12.5)
        assert ml.get("/api/v1/models/gpt-tiny/shadow").json()["policy"]["version"] == "v2"
        assert ml.delete("/api/v1/models/gpt-tiny/shadow").status_code == 204
        assert ml.delete("/api/v1/models/gpt-tiny/shadow").status_code == 404
        assert ml.get("/api/v1/models/gpt-tiny/shadow").json()["policy"] is None
        assert list(AuditEntry.objects.order_by("id").values_list("action", flat=True)) == [
            "shadow.set",
            "shadow.delete",
        ]

    @pytest.mark.parametrize(
        ("body", "field"),
        [({"version": "v9", "percent": 5}, "version"), ({"version": "v2", "percent": 101}, "percent"),
         ({"version": "v2"}, "percent"),
         ({"version": "v1", "percent": 5}, "version")],  # v1 answers every request: no copy would go to it
    )  # fmt: skip
    def test_a_bad_policy_is_a_400_naming_the_field(self, ml, chat_model, body, field):
        response = ml.put("/api/v1/models/gpt-tiny/shadow", body, format="json")
        assert response.status_code == 400
        assert field in response.json()
        assert not ShadowPolicy.objects.exists()

    def test_the_comparison_sets_the_candidate_beside_the_primary_on_the_same_requests(self, ml, chat_model, alice_org):
        from accounts.services import api_key_create

        key = api_key_create(organization=alice_org, name="k").api_key
        now = timezone.now()
        for i in range(10):
            request_id = uuid.uuid4()
            UsageRecord.objects.create(
                request_id=request_id, api_key=key, organization=alice_org, model="gpt-tiny", model_version="v1",
                completion_tokens=10, latency_ms=100 + i, status_code=200, created_at=now,
            )  # fmt: skip
            ShadowRecord.objects.create(
                request_id=request_id, model="gpt-tiny", candidate_version="v2", primary_version="v1",
                endpoint="chat", stream=False, status_code=500 if i < 2 else 200, latency_ms=300 + i,
                completion_tokens=20, created_at=now,
            )  # fmt: skip
        old = ShadowRecord.objects.create(
            request_id=uuid.uuid4(), model="gpt-tiny", candidate_version="v2", primary_version="v1", endpoint="chat",
            stream=False, status_code=200, latency_ms=1, created_at=now - timedelta(hours=30),
        )  # fmt: skip
        comparison = ml.get("/api/v1/models/gpt-tiny/shadow?hours=24").json()["comparison"]
        assert comparison["candidate_versions"] == ["v2"]
        candidate, primary = comparison["candidate"], comparison["primary"]
        assert (candidate["requests"], candidate["failed"], candidate["error_rate"]) == (10, 2, 0.2)
        assert (primary["requests"], primary["failed"]) == (10, 0)
        assert candidate["latency_p50_ms"] > primary["latency_p99_ms"]
        assert (candidate["mean_completion_tokens"], primary["mean_completion_tokens"]) == (20, 10)
        assert old.latency_ms not in (candidate["latency_p50_ms"], candidate["latency_p99_ms"])
        assert ml.get("/api/v1/models/gpt-tiny/shadow?hours=x").status_code == 400


OPERATIONS: list[tuple[str, str, Any]] = [
    ("post", "/api/v1/deployments/{pk}/swap", {"version": "v3"}),
    ("get", "/api/v1/deployments/{pk}/swap", None),
    ("delete", "/api/v1/deployments/{pk}/swap", None),
    ("put", "/api/v1/deployments/{pk}/replicas", {"replicas": 1}),
    ("put", "/api/v1/deployments/{pk}/adapters", {"max_adapters": 2}),
    ("put", "/api/v1/deployments/{pk}/autoscale", {"enabled": True}),
    ("get", "/api/v1/models/gpt-tiny/shadow", None),
    ("put", "/api/v1/models/gpt-tiny/shadow", {"version": "v2", "percent": 5}),
    ("delete", "/api/v1/models/gpt-tiny/shadow", None),
    ("get", "/api/v1/models/gpt-tiny/rollback", None),
    ("post", "/api/v1/models/gpt-tiny/rollback", {"version": "v1"}),
]


class TestAccess:
    @pytest.mark.parametrize(("method", "path", "body"), OPERATIONS)
    @pytest.mark.parametrize(("who", "statuses"), [("alice", {403}), ("anonymous", {401, 403})])
    def test_only_platform_admins_may(self, people, chat_model, method, path, body, who, statuses):
        url = path.format(pk=running(chat_model, "v1").pk)
        response = getattr(client_for(people[who]), method)(url, body, format="json")
        assert response.status_code in statuses
        assert not AuditEntry.objects.exists()
        assert not ShadowPolicy.objects.exists()
        assert Deployment.objects.filter(version__model=chat_model).count() == 3

    def test_the_operations_are_in_the_schema(self, ml):
        paths = ml.get("/api/schema/", HTTP_ACCEPT="application/json").json()["paths"]
        assert {"get", "post", "delete"} <= paths["/api/v1/deployments/{id}/swap"].keys()
        assert "put" in paths["/api/v1/deployments/{id}/replicas"]
        assert "put" in paths["/api/v1/deployments/{id}/adapters"]
        assert "put" in paths["/api/v1/deployments/{id}/autoscale"]
        assert {"get", "put", "delete"} <= paths["/api/v1/models/{name}/shadow"].keys()
        assert {"get", "post"} <= paths["/api/v1/models/{name}/rollback"].keys()
