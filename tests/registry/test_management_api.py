"""The registry's management API under /api/v1/: versions from real artifacts, deployments,
traffic splits, and the audit entry each write leaves (and a refused one does not)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from core import keys
from core.redis import sync_redis
from registry import artifacts
from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica
from registry.services import deployment_create, traffic_set
from serving.gateway.asgi import DATA_PLANE_PREFIXES
from tests.support.api import client_for

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def empty_audit_log(db) -> None:
    """Session fixtures elsewhere commit deployments (and so audit entries); this test's
    transaction hides them, and rolling back brings them back."""
    AuditEntry.objects.all().delete()


def put_artifact(store: artifacts.ArtifactStore, tmp_path: Path, key: str, weights: bytes = b"w" * 100):
    source = tmp_path / "src" / key
    source.mkdir(parents=True)
    (source / "config.json").write_text('{"max_position_embeddings": 2048}')
    (source / "model.safetensors").write_bytes(weights)
    return store.put_directory(source=source, key=key)


def register_body(uri: str, **overrides: Any) -> dict[str, Any]:
    return {
        "name": "gpt-tiny",
        "version": "v2.1",
        "framework": "pytorch",
        "artifact_uri": uri,
        "gpu_requirements": {"type": "A100", "count": 4, "vram_gb": 320},
        "config": {"max_seq_len": 8192, "vocab_size": 100256},
        **overrides,
    }


class TestRegister:
    def test_it_registers_a_version_hashed_through_the_store(self, ml, store, tmp_path):
        stored = put_artifact(store, tmp_path, "gpt-tiny/v2.1")
        response = ml.post("/api/v1/models", register_body(stored.uri), format="json")
        assert response.status_code == 201, response.content
        body = response.json()
        assert (body["name"], body["version"], body["status"]) == ("gpt-tiny", "v2.1", "registered")
        assert (body["artifact_sha256"], body["artifact_size"]) == (stored.sha256, stored.size)
        assert body["gpu_requirements"] == {"type": "A100", "count": 4, "vram_gb": 320}
        assert body["config"] == {"max_seq_len": 8192, "vocab_size": 100256}
        assert body["deployments"] == []
        assert {"id", "created_at", "framework", "artifact_uri"} <= body.keys()
        version = ModelVersion.objects.get(pk=body["id"])
        assert (version.gpu_type, version.gpu_count, version.gpu_vram_gb) == ("A100", 4, 320)
        assert version.model.task == "chat"

    def test_a_missing_artifact_is_a_400_naming_artifact_uri(self, ml, store):
        response = ml.post("/api/v1/models", register_body("local://gpt-tiny/nowhere"), format="json")
        assert response.status_code == 400
        assert "no artifact at local://gpt-tiny/nowhere" in response.json()["artifact_uri"][0]
        assert not Model.objects.filter(name="gpt-tiny").exists()
        assert not AuditEntry.objects.exists()

    @pytest.mark.parametrize("uri", ["s3://models/gpt-4/v2.1/weights.safetensors", "local://../outside", "local://"])
    def test_a_uri_the_store_cannot_use_is_a_400_naming_artifact_uri(self, ml, store, uri):
        response = ml.post("/api/v1/models", register_body(uri), format="json")
        assert response.status_code == 400
        assert "artifact_uri" in response.json()
        assert not ModelVersion.objects.filter(model__name="gpt-tiny").exists()

    def test_an_artifact_without_files_is_a_400(self, ml, store, tmp_path):
        (tmp_path / "store" / "gpt-tiny" / "v2.1" / "empty-folder").mkdir(parents=True)
        response = ml.post("/api/v1/models", register_body("local://gpt-tiny/v2.1"), format="json")
        assert response.status_code == 400
        assert "artifact_uri" in response.json()

    def test_an_unreadable_artifact_is_a_400(self, ml, store, tmp_path, monkeypatch):
        stored = put_artifact(store, tmp_path, "gpt-tiny/v2.1")

        def denied(path: Path) -> str:
            # Tests run as root, for whom file modes deny nothing: fail the read itself.
            raise PermissionError(13, "Permission denied", str(path))

        monkeypatch.setattr(artifacts, "file_sha256", denied)
        response = ml.post("/api/v1/models", register_body(stored.uri), format="json")
        assert response.status_code == 400
        assert "cannot be read (Permission denied)" in response.json()["artifact_uri"][0]

    def test_registering_the_same_again_is_a_200_and_changes_nothing(self, ml, store, tmp_path):
        stored = put_artifact(store, tmp_path, "gpt-tiny/v2.1")
        first = ml.post("/api/v1/models", register_body(stored.uri), format="json")
        again = ml.post("/api/v1/models", register_body(stored.uri), format="json")
        assert (first.status_code, again.status_code) == (201, 200)
        assert again.json() == first.json()
        assert AuditEntry.objects.filter(action="model_version.register").count() == 1

    @pytest.mark.parametrize(
        "change",
        [{"config": {"max_seq_len": 4096}}, {"framework": "transformers"}, {"gpu_requirements": {"type": "H100"}}],
    )
    def test_registering_other_values_is_a_409(self, ml, store, tmp_path, change):
        stored = put_artifact(store, tmp_path, "gpt-tiny/v2.1")
        first = ml.post("/api/v1/models", register_body(stored.uri), format="json").json()
        response = ml.post("/api/v1/models", register_body(stored.uri, **change), format="json")
        assert response.status_code == 409
        assert "gpt-tiny:v2.1 is registered already" in response.json()["detail"]
        assert ml.get("/api/v1/models/gpt-tiny").json()["versions"] == [first]

    def test_changed_artifact_files_are_a_409(self, ml, store, tmp_path):
        stored = put_artifact(store, tmp_path, "gpt-tiny/v2.1")
        assert ml.post("/api/v1/models", register_body(stored.uri), format="json").status_code == 201
        (store.local_path(stored.uri) / "model.safetensors").write_bytes(b"retrained")
        response = ml.post("/api/v1/models", register_body(stored.uri), format="json")
        assert response.status_code == 409
        assert "artifact_sha256" in response.json()["detail"]

    def test_a_version_of_another_task_is_a_400(self, ml, store, tmp_path):
        Model.objects.create(name="gpt-tiny", task="embedding")
        stored = put_artifact(store, tmp_path, "gpt-tiny/v2.1")
        response = ml.post("/api/v1/models", register_body(stored.uri, task="chat"), format="json")
        assert response.status_code == 400
        assert response.json() == {"task": ["gpt-tiny is a embedding model."]}
        assert not ModelVersion.objects.filter(model__name="gpt-tiny").exists()

    def test_a_body_missing_fields_is_a_400_naming_them(self, ml, store):
        response = ml.post("/api/v1/models", {"name": "gpt-tiny"}, format="json")
        assert response.status_code == 400
        assert {"version", "framework", "artifact_uri"} <= response.json().keys()

    def test_models_are_listed_with_versions_and_deployments(self, ml, store, tmp_path):
        stored = put_artifact(store, tmp_path, "gpt-tiny/v2.1")
        version_id = ml.post("/api/v1/models", register_body(stored.uri), format="json").json()["id"]
        deployment = deployment_create(version=ModelVersion.objects.get(pk=version_id), traffic_weight=100)
        listed = {m["name"]: m for m in ml.get("/api/v1/models").json()}
        one = ml.get("/api/v1/models/gpt-tiny").json()
        assert listed["gpt-tiny"] == one
        assert one["task"] == "chat"
        [version] = one["versions"]
        assert version["id"] == version_id
        assert version["deployments"] == [
            {"id": deployment.pk, "status": "pending", "traffic_percent": 100, "replicas": 1, "is_canary": False,
             "created_at": version["deployments"][0]["created_at"]},
        ]  # fmt: skip

    def test_an_unknown_model_is_a_404(self, ml):
        assert ml.get("/api/v1/models/nothing-here").status_code == 404


def weights(model: Model) -> dict[int, int]:
    return dict(Deployment.objects.filter(version__model=model).values_list("id", "traffic_weight"))


def version_of(model: Model, version: str) -> ModelVersion:
    return ModelVersion.objects.get(model=model, version=version)


class TestDeploymentCreate:
    def test_it_deploys_a_version(self, ml, chat_model, people):
        body = {"model_name": "gpt-tiny", "version": "v3", "traffic_percent": 10,
                "resources": {"gpu": "A100", "replicas": 4}}  # fmt: skip
        response = ml.post("/api/v1/deployments", body, format="json")
        assert response.status_code == 201, response.content
        created = response.json()
        assert (created["model_name"], created["version"], created["status"]) == ("gpt-tiny", "v3", "pending")
        assert created["traffic_percent"] == 10
        assert created["resources"] == {
            "gpu": "A100", "replicas": 4, "min_replicas": 1, "max_replicas": 4, "standby": 0, "max_adapters": 0,
        }  # fmt: skip
        assert created["replicas"] == []
        deployment = Deployment.objects.get(pk=created["id"])
        assert (deployment.replicas, deployment.gpu_type, deployment.traffic_weight) == (4, "A100", 10)
        entry = AuditEntry.objects.get(action="deployment.create")
        assert (entry.actor, entry.target_type, entry.target, entry.before) == (
            people["ml"], "deployment", str(deployment.pk), None,
        )  # fmt: skip
        assert entry.after["replicas"] == 4
        assert (entry.after["model"], entry.after["version"]) == ("gpt-tiny", "v3")

    def test_it_deploys_with_a_warm_pool_or_as_one(self, ml, chat_model):
        body = {"model_name": "gpt-tiny", "version": "v3", "traffic_percent": 0,
                "resources": {"replicas": 1, "standby": 2}}  # fmt: skip
        response = ml.post("/api/v1/deployments", body, format="json")
        assert response.status_code == 201, response.content
        assert response.json()["resources"]["standby"] == 2
        assert Deployment.objects.get(pk=response.json()["id"]).standby == 2
        assert (
            AuditEntry.objects.get(action="deployment.create", target=str(response.json()["id"])).after["standby"] == 2
        )
        # No serving replica, only standbys: a version readied before a swap to it.
        body["resources"] = {"replicas": 0, "standby": 1}
        response = ml.post("/api/v1/deployments", body, format="json")
        assert response.status_code == 201, response.content
        assert response.json()["resources"] == {"gpu": "", "replicas": 0, "min_replicas": 0, "max_replicas": 1,
                                                "standby": 1, "max_adapters": 0}  # fmt: skip

    def test_resources_default_to_one_replica_on_the_versions_gpu(self, ml, chat_model):
        ModelVersion.objects.filter(model=chat_model, version="v3").update(gpu_type="L4")
        response = ml.post("/api/v1/deployments", {"model_name": "gpt-tiny", "version": "v3", "traffic_percent": 0})
        assert response.status_code == 201, response.content
        assert response.json()["resources"] == {
            "gpu": "L4", "replicas": 1, "min_replicas": 1, "max_replicas": 1, "standby": 0, "max_adapters": 0,
        }  # fmt: skip

    def test_a_base_that_takes_lora_adapters(self, ml, chat_model):
        body = {"model_name": "gpt-tiny", "version": "v3", "traffic_percent": 0,
                "resources": {"replicas": 1, "max_adapters": 4}}  # fmt: skip
        response = ml.post("/api/v1/deployments", body, format="json")
        assert response.status_code == 201, response.content
        assert response.json()["resources"]["max_adapters"] == 4
        assert Deployment.objects.get(pk=response.json()["id"]).max_adapters == 4
        assert (
            AuditEntry.objects.get(action="deployment.create", target=str(response.json()["id"])).after["max_adapters"]
            == 4
        )
        body["resources"]["max_adapters"] = 65
        assert ml.post("/api/v1/deployments", body, format="json").status_code == 400
        Model.objects.filter(pk=chat_model.pk).update(task="embedding")
        body["resources"]["max_adapters"] = 2
        response = ml.post("/api/v1/deployments", body, format="json")
        assert response.status_code == 400
        assert "Only a chat or completion model" in str(response.json()["resources"])

    def test_deployments_are_listed_with_their_replicas_states(self, ml, chat_model):
        deployment = Deployment.objects.get(version=version_of(chat_model, "v1"))
        Replica.objects.create(deployment=deployment, host="gpu-1", endpoint="http://gpu-1:8001", state="ready")
        Replica.objects.create(deployment=deployment, host="gpu-2", state="starting")
        listed = {d["id"]: d for d in ml.get("/api/v1/deployments", {"model": "gpt-tiny"}).json()}
        assert set(listed) == set(weights(chat_model))
        assert [(r["host"], r["state"]) for r in listed[deployment.pk]["replicas"]] == [
            ("gpu-1", "ready"), ("gpu-2", "starting"),
        ]  # fmt: skip
        assert (listed[deployment.pk]["version"], listed[deployment.pk]["status"]) == ("v1", "running")
        assert ml.get("/api/v1/deployments", {"model": "another"}).json() == []

    @pytest.mark.parametrize(
        ("change", "field"),
        [
            ({"model_name": "nothing-here"}, "model_name"),
            ({"version": "v9"}, "version"),
            ({"traffic_percent": 101}, "traffic_percent"),
            ({"traffic_percent": -1}, "traffic_percent"),
            ({"traffic_percent": None}, "traffic_percent"),
            ({"resources": {"replicas": 0}}, "resources"),
            ({"resources": {"replicas": 3, "max_replicas": 2}}, "resources"),
            ({"resources": {"replicas": 1, "standby": -1}}, "resources"),
            ({"resources": {"replicas": 1, "standby": 32768}}, "resources"),
            ({"resources": {"replicas": 0, "standby": 0}}, "resources"),
            ({"resources": {"replicas": 1, "min_replicas": 2}}, "resources"),
        ],
    )
    def test_a_bad_deployment_is_a_400_naming_the_field(self, ml, chat_model, change, field):
        body = {"model_name": "gpt-tiny", "version": "v3", "traffic_percent": 10, "resources": {"replicas": 1}}
        response = ml.post("/api/v1/deployments", {**body, **change}, format="json")
        assert response.status_code == 400
        assert field in response.json()
        assert Deployment.objects.filter(version__model=chat_model).count() == 3
        assert not AuditEntry.objects.exists()


class TestTrafficSplit:
    def test_it_sets_the_split_and_returns_it(self, ml, chat_model):
        response = ml.put("/api/v1/deployments/gpt-tiny/traffic", {"v1": 70, "v2": 30}, format="json")
        assert response.status_code == 200, response.content
        assert response.json() == {"v1": 70, "v2": 30}
        deployments = Deployment.objects.filter(version__model=chat_model)
        by_version = dict(deployments.values_list("version__version", "traffic_weight"))
        assert by_version == {"v1": 70, "v2": 30, "v3": 0}

    def test_versions_not_named_get_nothing(self, ml, chat_model):
        response = ml.put("/api/v1/deployments/gpt-tiny/traffic", {"v2": 100}, format="json")
        assert response.json() == {"v1": 0, "v2": 100}

    def test_a_version_with_two_deployments_shares_its_percentage(self, ml, chat_model):
        first = Deployment.objects.get(version=version_of(chat_model, "v1"))
        second = Deployment.objects.create(version=first.version, status="running")
        response = ml.put("/api/v1/deployments/gpt-tiny/traffic", {"v1": 51, "v2": 49}, format="json")
        assert response.json() == {"v1": 51, "v2": 49}
        # The older deployment takes the odd point.
        assert (weights(chat_model)[first.pk], weights(chat_model)[second.pk]) == (26, 25)

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"v1": 60, "v2": 30}, "traffic"),
            ({"v1": 60, "v2": 50}, "traffic"),
            ({}, "traffic"),
            ([50, 50], "traffic"),
            ({"v1": 110, "v2": -10}, "v1"),
            ({"v1": 50, "v2": -0.5, "v3": 50.5}, "v2"),
            ({"v1": 50.0, "v2": 50}, "v1"),
            ({"v1": "50", "v2": 50}, "v1"),
            ({"v1": True, "v2": 99}, "v1"),
            ({"v1": 50, "v9": 50}, "v9"),
            ({"v1": 50, "v3": 50}, "v3"),
        ],
    )
    def test_a_bad_split_is_a_400_naming_the_field_and_changes_nothing(self, ml, chat_model, body, field):
        before = weights(chat_model)
        response = ml.put("/api/v1/deployments/gpt-tiny/traffic", body, format="json")
        assert response.status_code == 400
        assert field in response.json(), response.json()
        assert weights(chat_model) == before
        assert not AuditEntry.objects.exists()

    def test_an_unknown_model_is_a_404(self, ml, chat_model):
        response = ml.put("/api/v1/deployments/nothing-here/traffic", {"v1": 100}, format="json")
        assert response.status_code == 404

    def test_the_gateways_are_told_after_commit(self, ml, chat_model, django_capture_on_commit_callbacks):
        pubsub = sync_redis().pubsub()
        pubsub.subscribe(keys.routing_invalidation_channel())
        try:
            subscribed = pubsub.get_message(timeout=2)
            assert subscribed is not None
            assert subscribed["type"] == "subscribe"
            with django_capture_on_commit_callbacks(execute=False) as refused:
                ml.put("/api/v1/deployments/gpt-tiny/traffic", {"v1": 50, "v2": 40}, format="json")
            assert refused == []
            with django_capture_on_commit_callbacks(execute=True) as callbacks:
                response = ml.put("/api/v1/deployments/gpt-tiny/traffic", {"v1": 50, "v2": 50}, format="json")
                assert response.status_code == 200
                # Nothing goes out before the commit.
                assert pubsub.get_message(timeout=0.2) is None
            assert len(callbacks) == 1
            message = pubsub.get_message(timeout=2)
            assert message is not None
            assert (message["channel"].decode(), message["data"]) == (keys.routing_invalidation_channel(), b"traffic")
        finally:
            pubsub.close()


class TestAudit:
    def test_each_write_is_recorded_with_before_and_after(self, ml, people, store, tmp_path):
        stored = put_artifact(store, tmp_path, "gpt-tiny/v2.1")
        version_id = ml.post("/api/v1/models", register_body(stored.uri), format="json").json()["id"]
        deploy = {"model_name": "gpt-tiny", "version": "v2.1", "traffic_percent": 0, "resources": {"replicas": 1}}
        deployment_id = ml.post("/api/v1/deployments", deploy, format="json").json()["id"]
        ml.put("/api/v1/deployments/gpt-tiny/traffic", {"v2.1": 100}, format="json")

        page = ml.get("/api/v1/audit").json()
        assert page["count"] == 4
        entries = page["results"]
        assert [e["action"] for e in entries] == [
            "traffic.set", "deployment.create", "model_version.register", "model.create",
        ]  # fmt: skip
        assert {(e["actor"], e["actor_name"]) for e in entries} == {(people["ml"].pk, "ml")}
        traffic, deployed, registered, created = entries
        assert (traffic["target_type"], traffic["target"]) == ("model", "gpt-tiny")
        assert (traffic["before"], traffic["after"]) == ({"v2.1": 0}, {"v2.1": 100})
        assert (deployed["target"], deployed["before"], deployed["after"]["traffic_weight"]) == (
            str(deployment_id), None, 0,
        )  # fmt: skip
        assert (registered["target_type"], registered["target"], registered["before"]) == (
            "model_version", "gpt-tiny:v2.1", None,
        )  # fmt: skip
        assert registered["after"]["artifact_sha256"] == stored.sha256
        assert ModelVersion.objects.get(pk=version_id).artifact_sha256 == stored.sha256
        assert (created["target"], created["after"]) == ("gpt-tiny", {"name": "gpt-tiny", "task": "chat"})

    @pytest.mark.parametrize("write", ["traffic", "deployment"])
    def test_a_write_rolled_back_leaves_no_entry(self, chat_model, people, monkeypatch, write):
        """The entry is written in the write's transaction: a failure after it undoes both."""

        def unreachable(reason: str) -> None:
            raise RuntimeError("redis is on fire")

        monkeypatch.setattr("registry.services.publish_routing_change", unreachable)
        before = weights(chat_model)
        writes = {
            "traffic": lambda: traffic_set(actor=people["ml"], model=chat_model, weights={"v2": 100}),
            "deployment": lambda: deployment_create(actor=people["ml"], version=version_of(chat_model, "v3")),
        }
        with pytest.raises(RuntimeError, match="on fire"):
            writes[write]()
        assert weights(chat_model) == before
        assert not AuditEntry.objects.exists()

    def test_the_log_is_filtered_searched_and_paged(self, ml, people, chat_model):
        bob = get_user_model().objects.create_user(username="bob", is_superuser=True)
        # ml's split changes one (v1 served everything): a write that changes nothing leaves no entry.
        traffic_set(actor=people["ml"], model=chat_model, weights={"v1": 90, "v2": 10})
        traffic_set(actor=bob, model=chat_model, weights={"v2": 100})
        deployment_create(actor=bob, version=version_of(chat_model, "v3"))

        def actions(**params: Any) -> list[tuple[str, str]]:
            return [(e["action"], e["actor_name"]) for e in ml.get("/api/v1/audit", params).json()["results"]]

        assert actions(action="traffic.set") == [("traffic.set", "bob"), ("traffic.set", "ml")]
        assert actions(actor="bob") == [("deployment.create", "bob"), ("traffic.set", "bob")]
        assert actions(target="gpt-tiny") == [("traffic.set", "bob"), ("traffic.set", "ml")]
        assert actions(q="DEPLOY") == [("deployment.create", "bob")]
        assert actions(q="ml") == [("traffic.set", "ml")]
        page = ml.get("/api/v1/audit", {"page_size": 2}).json()
        assert (page["count"], len(page["results"]), page["previous"]) == (3, 2, None)
        assert "page=2" in page["next"]
        assert len(ml.get(page["next"]).json()["results"]) == 1

    def test_an_entry_outlives_its_actor(self, ml, chat_model):
        leaver = get_user_model().objects.create_user(username="leaver", is_superuser=True)
        traffic_set(actor=leaver, model=chat_model, weights={"v2": 100})
        leaver.delete()
        [entry] = ml.get("/api/v1/audit").json()["results"]
        assert (entry["actor"], entry["actor_name"]) == (None, "leaver")

    def test_the_operator_is_recorded_as_nobody(self, chat_model):
        deployment_create(version=version_of(chat_model, "v3"))
        entry = AuditEntry.objects.get()
        assert (entry.actor, entry.actor_name) == (None, "")


ENDPOINTS = [
    ("get", "/api/v1/models", None),
    ("post", "/api/v1/models", {"name": "gpt-tiny", "version": "v4", "framework": "pytorch",
                                "artifact_uri": "local://gpt-tiny/v4"}),
    ("get", "/api/v1/models/gpt-tiny", None),
    ("get", "/api/v1/deployments", None),
    ("post", "/api/v1/deployments", {"model_name": "gpt-tiny", "version": "v3", "traffic_percent": 0}),
    ("put", "/api/v1/deployments/gpt-tiny/traffic", {"v2": 100}),
    ("get", "/api/v1/audit", None),
]  # fmt: skip


class TestAccess:
    @pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
    @pytest.mark.parametrize(("who", "statuses"), [("alice", {403}), ("anonymous", {401, 403})])
    def test_only_platform_admins_may(self, people, chat_model, method, path, body, who, statuses):
        before = weights(chat_model)
        response = getattr(client_for(people[who]), method)(path, body, format="json")
        assert response.status_code in statuses
        assert weights(chat_model) == before
        assert ModelVersion.objects.filter(model=chat_model).count() == 3
        assert not AuditEntry.objects.exists()

    def test_a_superuser_may(self, chat_model):
        root = get_user_model().objects.create_user(username="root", is_superuser=True)
        assert client_for(root).get("/api/v1/deployments").status_code == 200

    @pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
    def test_the_data_plane_does_not_claim_the_paths(self, method, path, body):
        assert not path.startswith(DATA_PLANE_PREFIXES)

    def test_the_endpoints_are_in_the_schema(self, ml):
        paths = ml.get("/api/schema/", HTTP_ACCEPT="application/json").json()["paths"]
        assert {"get", "post"} <= paths["/api/v1/models"].keys()
        assert "get" in paths["/api/v1/models/{name}"]
        assert {"get", "post"} <= paths["/api/v1/deployments"].keys()
        assert "put" in paths["/api/v1/deployments/{model}/traffic"]
        assert "get" in paths["/api/v1/audit"]
