"""The deployments page's "Restart" of one replica: the button, the confirm step, the request
made through ``registry.services.replica_restart_request``, and "restart requested" shown until
the supervisor starts the replica again."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.messages import get_messages
from django.test import Client

from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica

pytestmark = pytest.mark.django_db


@pytest.fixture
def replicas() -> dict[str, Replica]:
    """restart-model:v1 running with a ready and a failed replica."""
    model = Model.objects.create(name="restart-model", task="chat")
    version = ModelVersion.objects.create(
        model=model, version="v1", framework="pytorch", artifact_uri="local://restart-model/v1",
        artifact_sha256="0" * 64, artifact_size=1,
    )  # fmt: skip
    deployment = Deployment.objects.create(version=version, status="running", traffic_weight=100, replicas=2)
    return {
        state: Replica.objects.create(deployment=deployment, host="host-a", endpoint="http://127.0.0.1:9", state=state)
        for state in ("ready", "failed")
    }


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser(username="ops-restart", password="x"))
    return client


def restart_url(replica: Replica) -> str:
    return f"/console/deployments/replicas/{replica.pk}/restart/"


def board(client: Client) -> str:
    return client.get("/console/deployments/", {"model": "restart-model"}).content.decode()


class TestReplicaRestartPage:
    def test_the_board_offers_restart_for_a_ready_replica_only(self, admin_client, replicas):
        html = board(admin_client)
        assert f'action="{restart_url(replicas["ready"])}"' in html
        assert f'action="{restart_url(replicas["failed"])}"' not in html

    @pytest.mark.parametrize("method", ["get", "post"])
    def test_it_asks_first(self, admin_client, replicas, method):
        response = getattr(admin_client, method)(restart_url(replicas["ready"]))
        assert response.status_code == 200
        html = response.content.decode()
        assert f"Restart replica #{replicas['ready'].pk}?" in html
        assert 'name="confirm" value="yes"' in html
        assert "csrfmiddlewaretoken" in html
        assert Replica.objects.get(pk=replicas["ready"].pk).restart_requested_at is None

    def test_confirmed_it_requests_the_restart_and_shows_it_until_carried_out(self, admin_client, replicas):
        ready = replicas["ready"]
        response = admin_client.post(restart_url(ready), {"confirm": "yes"})
        assert response.status_code == 302
        assert response["Location"].startswith("/console/deployments/?model=restart-model")
        assert "Restart of replica" in " ".join(str(m) for m in get_messages(response.wsgi_request))
        assert Replica.objects.get(pk=ready.pk).restart_requested_at is not None
        entry = AuditEntry.objects.get(action="replica.restart", target=str(ready.pk))
        assert entry.actor_name == "ops-restart"
        html = board(admin_client)
        assert "restart requested" in html
        assert f'action="{restart_url(ready)}"' not in html  # no second request offered
        # The supervisor starts it again: the request is gone, and the button is back once ready.
        Replica.objects.filter(pk=ready.pk).update(restart_requested_at=None)
        assert "restart requested" not in board(admin_client)

    def test_a_refusal_is_a_message_and_changes_nothing(self, admin_client, replicas):
        failed = replicas["failed"]
        response = admin_client.post(restart_url(failed), {"confirm": "yes"}, follow=True)
        assert response.status_code == 200
        assert "Not restarted" in response.content.decode()
        assert Replica.objects.get(pk=failed.pk).restart_requested_at is None
        assert not AuditEntry.objects.filter(action="replica.restart", target=str(failed.pk)).exists()

    def test_an_unknown_replica_is_a_404(self, admin_client, db):
        assert admin_client.post("/console/deployments/replicas/999999/restart/", {"confirm": "yes"}).status_code == 404
