"""Restarting one replica on request: the service's rules, its audit entry, and the management
API's ``POST /api/v1/replicas/{id}/restart`` (platform admins only). The supervisor's side is
in tests/serving/test_supervisor.py."""

from __future__ import annotations

import pytest

from core.errors import InvalidInput
from registry.models import AuditEntry, Deployment, Model, Replica
from registry.services import (
    replica_claim,
    replica_release_host,
    replica_restart_request,
    replica_surplus,
    replica_transition,
)
from tests.support.api import client_for

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def empty_audit_log(db) -> None:
    """Session fixtures elsewhere commit deployments (and their audit entries); this test's
    transaction hides them."""
    AuditEntry.objects.all().delete()


def running(model: Model) -> Deployment:
    return Deployment.objects.get(version__model=model, version__version="v1")


@pytest.fixture
def replica(chat_model) -> Replica:
    """A ready replica of gpt-tiny:v1 (running, wanting one replica)."""
    return Replica.objects.create(
        deployment=running(chat_model), host="host-a", endpoint="http://127.0.0.1:9", pid=4242, state="ready"
    )


def restart_url(replica_id: int) -> str:
    return f"/api/v1/replicas/{replica_id}/restart"


class TestReplicaRestartRequest:
    def test_it_records_the_request_and_audits_it(self, people, replica):
        replica_restart_request(actor=people["ml"], replica=replica)
        replica.refresh_from_db()
        assert replica.restart_requested_at is not None
        assert replica.state == "ready"  # the supervisor moves it, not the request
        entry = AuditEntry.objects.get(action="replica.restart")
        assert (entry.target_type, entry.target, entry.actor_name) == ("replica", str(replica.pk), "ml")
        assert entry.before == {"state": "ready", "pid": 4242, "restart_requested_at": None}
        assert entry.after["restart_requested_at"] == replica.restart_requested_at.isoformat()
        assert {k: entry.after[k] for k in ("host", "model", "version", "deployment")} == {
            "host": "host-a", "model": "gpt-tiny", "version": "v1", "deployment": replica.deployment_id,
        }  # fmt: skip

    def test_a_second_request_is_refused_until_the_first_is_carried_out(self, replica):
        replica_restart_request(actor=None, replica=replica)
        with pytest.raises(InvalidInput, match="requested already") as refused:
            replica_restart_request(actor=None, replica=replica)
        assert refused.value.field == "replica"
        assert AuditEntry.objects.filter(action="replica.restart").count() == 1

    @pytest.mark.parametrize(
        ("state", "why"),
        [("starting", "starting already"), ("failed", "restarts a failed replica by itself"),
         ("draining", "draining"), ("stopped", "stopped")],
    )  # fmt: skip
    def test_only_a_ready_replica_can_be_restarted(self, replica, state, why):
        Replica.objects.filter(pk=replica.pk).update(state=state)
        with pytest.raises(InvalidInput, match=why):
            replica_restart_request(actor=None, replica=replica)
        assert Replica.objects.get(pk=replica.pk).restart_requested_at is None
        assert not AuditEntry.objects.exists()

    def test_a_replica_of_a_deployment_that_is_not_serving_is_refused(self, replica):
        Deployment.objects.filter(pk=replica.deployment_id).update(status="draining")
        with pytest.raises(InvalidInput, match="draining"):
            replica_restart_request(actor=None, replica=replica)
        assert not AuditEntry.objects.exists()

    def test_a_move_to_starting_clears_the_request(self, replica):
        replica_restart_request(actor=None, replica=replica)
        replica_transition(replica=replica, state="draining")
        assert Replica.objects.get(pk=replica.pk).restart_requested_at is not None
        replica_transition(replica=replica, state="starting", pid=4343)
        restarted = Replica.objects.get(pk=replica.pk)
        assert (restarted.state, restarted.pid, restarted.restart_requested_at) == ("starting", 4343, None)

    def test_a_released_replica_drops_its_request(self, replica):
        replica_restart_request(actor=None, replica=replica)
        assert replica_release_host(host="host-a") == 1
        released = Replica.objects.get(pk=replica.pk)
        assert (released.state, released.restart_requested_at) == ("stopped", None)

    def test_a_replica_draining_for_its_restart_keeps_its_place(self, replica):
        deployment = running(Model.objects.get(name="gpt-tiny"))
        replica_restart_request(actor=None, replica=replica)
        replica_transition(replica=replica, state="draining")
        # The same replica starts again: no other is claimed in its place, and it is no surplus.
        assert replica_claim(deployment=deployment, host="host-b") is None
        assert replica_surplus(deployment=deployment) == 0
        # Draining for any other reason, it leaves: the deployment claims a replacement.
        Replica.objects.filter(pk=replica.pk).update(restart_requested_at=None)
        assert replica_claim(deployment=deployment, host="host-b") is not None


class TestReplicaRestartApi:
    def test_it_answers_202_with_the_replica(self, ml, replica):
        response = ml.post(restart_url(replica.pk))
        assert response.status_code == 202, response.content
        body = response.json()
        assert (body["id"], body["deployment"], body["state"]) == (replica.pk, replica.deployment_id, "ready")
        assert body["restart_requested_at"] is not None
        assert AuditEntry.objects.filter(action="replica.restart", target=str(replica.pk), actor_name="ml").exists()

    def test_the_request_shows_in_the_deployments_list(self, ml, replica):
        ml.post(restart_url(replica.pk))
        listed = ml.get("/api/v1/deployments", {"model": "gpt-tiny"}).json()
        (shown,) = [r for d in listed for r in d["replicas"] if r["id"] == replica.pk]
        assert shown["restart_requested_at"] is not None

    @pytest.mark.parametrize("state", ["starting", "failed", "draining", "stopped"])
    def test_a_replica_that_is_not_ready_is_a_400_naming_it(self, ml, replica, state):
        Replica.objects.filter(pk=replica.pk).update(state=state)
        response = ml.post(restart_url(replica.pk))
        assert response.status_code == 400
        assert "cannot be restarted" in response.json()["replica"][0]
        assert not AuditEntry.objects.exists()

    def test_a_second_request_is_a_400(self, ml, replica):
        assert ml.post(restart_url(replica.pk)).status_code == 202
        again = ml.post(restart_url(replica.pk))
        assert again.status_code == 400
        assert "requested already" in again.json()["replica"][0]
        assert AuditEntry.objects.filter(action="replica.restart").count() == 1

    def test_an_unknown_replica_is_a_404(self, ml, db):
        assert ml.post(restart_url(999999)).status_code == 404

    def test_only_post_is_allowed(self, ml, replica):
        assert ml.get(restart_url(replica.pk)).status_code == 405

    @pytest.mark.parametrize(("who", "statuses"), [("alice", {403}), ("anonymous", {401, 403})])
    def test_only_platform_admins_may(self, people, replica, who, statuses):
        response = client_for(people[who]).post(restart_url(replica.pk))
        assert response.status_code in statuses
        assert Replica.objects.get(pk=replica.pk).restart_requested_at is None
        assert not AuditEntry.objects.exists()

    def test_it_is_in_the_schema(self, ml):
        paths = ml.get("/api/schema/", HTTP_ACCEPT="application/json").json()["paths"]
        operation = paths["/api/v1/replicas/{id}/restart"]["post"]
        assert {"202", "400", "404"} <= operation["responses"].keys()
