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
