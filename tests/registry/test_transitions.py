from __future__ import annotations

import pytest

from core.transitions import IllegalTransition
from registry.models import Deployment, Model, ModelVersion, Replica, Task
from registry.services import deployment_transition, model_version_transition, replica_transition

pytestmark = pytest.mark.django_db


@pytest.fixture
def version() -> ModelVersion:
    model = Model.objects.create(name="tiny", task=Task.CHAT)
    return ModelVersion.objects.create(
        model=model,
        version="1",
        framework="transformers",
        artifact_uri="local://tiny/1",
        artifact_sha256="0" * 64,
        artifact_size=1,
    )


class TestModelVersionTransitions:
    def test_it_walks_the_lifecycle(self, version):
        for status in ("loading", "active", "deprecated"):
            model_version_transition(version=version, status=status)
            version.refresh_from_db()
            assert version.status == status

    def test_it_refuses_skipping_loading(self, version):
        with pytest.raises(IllegalTransition, match="'registered' to 'active'"):
            model_version_transition(version=version, status="active")
        version.refresh_from_db()
        assert version.status == "registered"

    def test_it_refuses_reviving_to_active_directly(self, version):
        for status in ("loading", "active", "deprecated"):
            model_version_transition(version=version, status=status)
        with pytest.raises(IllegalTransition):
            model_version_transition(version=version, status="active")

    def test_it_refuses_unknown_status(self, version):
        with pytest.raises(IllegalTransition):
            model_version_transition(version=version, status="exploded")

    def test_it_uses_the_stored_state_not_a_stale_copy(self, version):
        stale = ModelVersion.objects.get(pk=version.pk)
        model_version_transition(version=version, status="loading")
        model_version_transition(version=version, status="active")
        # The stale copy still says "registered", for which "loading" would be legal.
        with pytest.raises(IllegalTransition):
            model_version_transition(version=stale, status="loading")


class TestDeploymentAndReplicaTransitions:
    def test_deployment_cannot_stop_while_running(self, version):
        deployment = Deployment.objects.create(version=version)
        deployment_transition(deployment=deployment, status="running")
        with pytest.raises(IllegalTransition):
            deployment_transition(deployment=deployment, status="stopped")
        deployment_transition(deployment=deployment, status="draining")
        deployment_transition(deployment=deployment, status="stopped")
        deployment.refresh_from_db()
        assert deployment.status == "stopped"

    def test_replica_ready_records_endpoint_in_same_update(self, version):
        replica = Replica.objects.create(deployment=Deployment.objects.create(version=version), host="h1")
        replica_transition(replica=replica, state="ready", endpoint="http://127.0.0.1:9000", pid=42)
        replica.refresh_from_db()
        assert (replica.state, replica.endpoint, replica.pid) == ("ready", "http://127.0.0.1:9000", 42)

    def test_replica_cannot_go_from_failed_to_ready(self, version):
        replica = Replica.objects.create(deployment=Deployment.objects.create(version=version), host="h1")
        replica_transition(replica=replica, state="failed")
        with pytest.raises(IllegalTransition):
            replica_transition(replica=replica, state="ready")


class TestReadyAtOnce:
    def test_two_replicas_of_a_new_version_ready_at_once_on_two_hosts_are_both_marked_ready(self, django_db_blocker):
        """Host A marks its replica ready (the version goes active, the deployment running) while
        host B, on its own connection, marks its own: B must wait and see A's changes, not move
        the version again (it did: an illegal move, and B's replica stayed starting for good)."""
        import threading
        import time
        import uuid

        from django.db import connection, transaction

        from registry.services import deployment_create, replica_mark_ready
        from tests.support.gateway import committed

        name = f"ready-at-once-{uuid.uuid4().hex[:6]}"

        def create() -> tuple[int, int]:
            model = Model.objects.create(name=name, task=Task.CHAT)
            version = ModelVersion.objects.create(
                model=model, version="1", framework="fake", artifact_uri=f"local://{name}/1", artifact_sha256="0" * 64,
                artifact_size=1, status=ModelVersion.Status.LOADING,
            )  # fmt: skip
            deployment = deployment_create(version=version, replicas=2, max_replicas=2)
            first = Replica.objects.create(deployment=deployment, host="a")
            second = Replica.objects.create(deployment=deployment, host="b")
            return first.pk, second.pk

        first, second = committed(django_db_blocker, create)
        holding, errors = threading.Event(), []
        release = threading.Event()

        def host(replica_id: int, hold: bool) -> None:
            try:
                with transaction.atomic():
                    replica_mark_ready(replica=Replica.objects.get(pk=replica_id), endpoint="http://10.0.0.1:1", pid=1)
                    if hold:  # A has made the version live and not committed yet
                        holding.set()
                        release.wait(10)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                connection.close()

        try:
            with django_db_blocker.unblock():
                a = threading.Thread(target=host, args=(first, True))
                a.start()
                assert holding.wait(10)
                b = threading.Thread(target=host, args=(second, False))
                b.start()
                time.sleep(0.5)  # B is under way (waiting on A's locks) before A commits
                release.set()
                a.join(10)
                b.join(10)
            assert not errors, errors
            states = committed(django_db_blocker, lambda: sorted(
                Replica.objects.filter(pk__in=[first, second]).values_list("state", flat=True)))  # fmt: skip
            assert states == ["ready", "ready"]
        finally:
            release.set()

            def drop() -> None:
                Deployment.objects.filter(version__model__name=name).delete()
                ModelVersion.objects.filter(model__name=name).delete()
                Model.objects.filter(name=name).delete()

            committed(django_db_blocker, drop)
