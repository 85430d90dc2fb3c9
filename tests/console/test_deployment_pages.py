"""The console's deployments page: who may open it, and each form's success and refusals."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import Membership, Role
from accounts.services import api_key_create, organization_create
from billing.models import FailedAttempt, UsageRollup
from core import sketch
from core.formats import MISSING
from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica
from registry.selectors import last_changes
from registry.services import deployment_scale, replica_record_load_time, traffic_set
from rollout.canary_stats import percentile
from rollout.hotswap import (
    deployment_swap_drain,
    deployment_swap_finish,
    deployment_swap_shift,
    deployment_swap_version,
)
from rollout.served_requests import served_requests, served_summaries
from tests.support.registry import make_version
from tests.support.usage_records import make_record

pytestmark = pytest.mark.django_db


@pytest.fixture
def chat_model() -> Model:
    """gpt-tiny: v1 running at 100 %, v2 running at 0 %, v3 registered only."""
    model = Model.objects.create(name="gpt-tiny", task="chat")
    for name, weight in (("v1", 100), ("v2", 0)):
        Deployment.objects.create(
            version=make_version(model, name), status="running", traffic_weight=weight, max_replicas=4
        )
    make_version(model, "v3")
    return model


def deployment_of(model: Model, version: str) -> Deployment:
    return Deployment.objects.get(version__model=model, version__version=version)


def weights(model: Model) -> dict[str, int]:
    return dict(Deployment.objects.filter(version__model=model).values_list("version__version", "traffic_weight"))


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser(username="ops", password="x"))
    return client


class TestAccess:
    URLS = ("/console/deployments/", "/console/deployments/scaling/")

    def test_anonymous_visitors_go_to_the_login_page(self, chat_model):
        for url in self.URLS:
            response = Client().get(url)
            assert response.status_code == 302
            assert response["Location"].startswith("/accounts/login/")
        response = Client().post(f"/console/deployments/models/{chat_model.name}/traffic/", {})
        assert response.status_code == 302

    def test_organisation_users_are_refused(self, chat_model, alice_org):
        for role in (Role.ORG_ADMIN, Role.ORG_MEMBER):
            user = get_user_model().objects.create_user(username=f"u-{role}", password="x")
            Membership.objects.create(user=user, organization=alice_org, role=role)
            client = Client()
            client.force_login(user)
            for url in self.URLS:
                assert client.get(url).status_code == 403
            posted = client.post(f"/console/deployments/models/{chat_model.name}/traffic/", {"weight-v1": 50})
            assert posted.status_code == 403
        assert weights(chat_model) == {"v1": 100, "v2": 0}

    def test_a_platform_admin_role_is_enough(self, chat_model, alice_org):
        user = get_user_model().objects.create_user(username="ml-lead", password="x")
        Membership.objects.create(user=user, organization=alice_org, role=Role.PLATFORM_ADMIN)
        client = Client()
        client.force_login(user)
        assert client.get("/console/deployments/").status_code == 200

    def test_the_navigation_lists_deployments_and_canaries(self, admin_client, chat_model):
        html = admin_client.get("/console/deployments/").content.decode()
        assert f'href="{reverse("console:deployments")}"' in html
        assert f'href="{reverse("console:canaries")}"' in html


class TestBoard:
    def test_it_shows_deployments_replicas_and_load_times(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        replica = Replica.objects.create(
            deployment=deployment, host="gpu-7", endpoint="http://10.0.0.7:8001", state="ready"
        )
        replica_record_load_time(replica=replica, seconds=12.345, host="gpu-7")
        response = admin_client.get("/console/deployments/")
        assert response.status_code == 200
        html = response.content.decode()
        assert f'data-deployment="{deployment.pk}"' in html
        assert f'data-replica="{replica.pk}"' in html
        assert "gpu-7" in html
        assert "http://10.0.0.7:8001" in html
        assert "12.3 s" in html

    def test_it_filters_by_model_and_hides_stopped_deployments(self, admin_client, chat_model):
        other = Model.objects.create(name="embedder", task="embedding")
        Deployment.objects.create(version=make_version(other, "e1"), status="running")
        stopped = Deployment.objects.create(version=ModelVersion.objects.get(model=chat_model, version="v3"))
        Deployment.objects.filter(pk=stopped.pk).update(status="stopped")
        html = admin_client.get("/console/deployments/?model=gpt").content.decode()
        assert 'data-model="gpt-tiny"' in html
        assert 'data-model="embedder"' not in html
        assert f'data-deployment="{stopped.pk}"' not in html
        html = admin_client.get("/console/deployments/?model=gpt&stopped=1").content.decode()
        assert f'data-deployment="{stopped.pk}"' in html

    def test_it_paginates_models(self, admin_client):
        # Filtered to this test's models: other modules' committed models would shift the pages.
        for index in range(30):
            Model.objects.create(name=f"pagedm-{index:02d}", task="chat")
        first = admin_client.get("/console/deployments/?model=pagedm-").content.decode()
        assert 'data-model="pagedm-24"' in first
        assert 'data-model="pagedm-25"' not in first
        second = admin_client.get("/console/deployments/?model=pagedm-&page=2").content.decode()
        assert 'data-model="pagedm-25"' in second
        assert "Page 2 of 2" in second


class TestTrafficSplit:
    def test_it_sets_the_split_and_says_so(self, admin_client, chat_model):
        response = admin_client.post(
            f"/console/deployments/models/{chat_model.name}/traffic/", {"weight-v1": "70", "weight-v2": "30"}
        )
        assert response.status_code == 302
        assert weights(chat_model) == {"v1": 70, "v2": 30}
        page = admin_client.get(response["Location"]).content.decode()
        assert "Traffic of gpt-tiny split: v1 70 %, v2 30 %." in page
        assert AuditEntry.objects.filter(action="traffic.set", actor_name="ops").exists()

    def test_a_split_not_summing_to_100_is_refused_and_changes_nothing(self, admin_client, chat_model):
        response = admin_client.post(
            f"/console/deployments/models/{chat_model.name}/traffic/", {"weight-v1": "70", "weight-v2": "20"}
        )
        assert response.status_code == 200
        html = response.content.decode()
        assert "The percentages must sum to 100, not 90." in html
        assert 'value="70"' in html
        assert 'value="20"' in html
        assert weights(chat_model) == {"v1": 100, "v2": 0}
        assert not AuditEntry.objects.filter(action="traffic.set", target=chat_model.name).exists()

    def test_a_negative_or_missing_weight_is_a_field_error(self, admin_client, chat_model):
        response = admin_client.post(f"/console/deployments/models/{chat_model.name}/traffic/", {"weight-v1": "-5"})
        html = response.content.decode()
        assert "Ensure this value is greater than or equal to 0." in html
        assert "This field is required." in html
        assert weights(chat_model) == {"v1": 100, "v2": 0}

    def test_the_form_needs_the_csrf_token(self, chat_model):
        client = Client(enforce_csrf_checks=True)
        client.force_login(get_user_model().objects.create_superuser(username="ops2", password="x"))
        page = client.get("/console/deployments/").content.decode()
        assert 'name="csrfmiddlewaretoken"' in page
        response = client.post(
            f"/console/deployments/models/{chat_model.name}/traffic/", {"weight-v1": "50", "weight-v2": "50"}
        )
        assert response.status_code == 403
        assert weights(chat_model) == {"v1": 100, "v2": 0}


class TestDeployAndScale:
    def test_it_deploys_a_version(self, admin_client, chat_model):
        response = admin_client.post(
            f"/console/deployments/models/{chat_model.name}/deploy/",
            {f"deploy-{chat_model.pk}-version": "v3", f"deploy-{chat_model.pk}-traffic_percent": "0",
             f"deploy-{chat_model.pk}-replicas": "2"},
        )  # fmt: skip
        assert response.status_code == 302
        created = deployment_of(chat_model, "v3")
        assert (created.replicas, created.traffic_weight, created.status) == (2, 0, "pending")
        assert "Deployed gpt-tiny:v3" in admin_client.get(response["Location"]).content.decode()

    def test_it_deploys_a_base_that_takes_adapters_and_refuses_them_where_they_cannot_run(
        self, admin_client, chat_model
    ):
        prefix = f"deploy-{chat_model.pk}"
        response = admin_client.post(
            f"/console/deployments/models/{chat_model.name}/deploy/",
            {f"{prefix}-version": "v3", f"{prefix}-traffic_percent": "0", f"{prefix}-replicas": "1",
             f"{prefix}-max_adapters": "4"},
        )  # fmt: skip
        assert response.status_code == 302
        assert deployment_of(chat_model, "v3").max_adapters == 4
        chat_model.task = "embedding"
        chat_model.save(update_fields=["task"])
        response = admin_client.post(
            f"/console/deployments/models/{chat_model.name}/deploy/",
            {f"{prefix}-version": "v3", f"{prefix}-traffic_percent": "0", f"{prefix}-replicas": "1",
             f"{prefix}-max_adapters": "2"},
        )  # fmt: skip
        assert response.status_code == 200
        assert "Only a chat or completion model" in response.content.decode()

    def test_a_bad_deploy_shows_field_errors(self, admin_client, chat_model):
        response = admin_client.post(
            f"/console/deployments/models/{chat_model.name}/deploy/",
            {f"deploy-{chat_model.pk}-version": "v9", f"deploy-{chat_model.pk}-traffic_percent": "120",
             f"deploy-{chat_model.pk}-replicas": "0"},
        )  # fmt: skip
        html = response.content.decode()
        assert response.status_code == 200
        assert "Select a valid choice. v9 is not one of the available choices." in html
        assert "Ensure this value is less than or equal to 100." in html
        assert Deployment.objects.filter(version__model=chat_model).count() == 2

    def test_it_scales_within_new_bounds(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/scale/",
            {f"scale-{deployment.pk}-replicas": "3", f"scale-{deployment.pk}-min_replicas": "2",
             f"scale-{deployment.pk}-max_replicas": "6"},
        )  # fmt: skip
        assert response.status_code == 302
        deployment.refresh_from_db()
        assert (deployment.replicas, deployment.min_replicas, deployment.max_replicas) == (3, 2, 6)
        entry = AuditEntry.objects.get(action="deployment.scale", target=str(deployment.pk))
        assert entry.after["reasons"] == ["set by a platform admin"]

    def test_replicas_outside_the_bounds_are_refused_on_the_field(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/scale/",
            {f"scale-{deployment.pk}-replicas": "9", f"scale-{deployment.pk}-min_replicas": "1",
             f"scale-{deployment.pk}-max_replicas": "4"},
        )  # fmt: skip
        html = response.content.decode()
        assert "Must lie between 1 (min_replicas, at least 1) and 4." in html
        deployment.refresh_from_db()
        assert (deployment.replicas, deployment.max_replicas) == (1, 4)  # bounds rolled back with it

    def test_max_below_min_is_refused(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/scale/",
            {f"scale-{deployment.pk}-replicas": "1", f"scale-{deployment.pk}-min_replicas": "3",
             f"scale-{deployment.pk}-max_replicas": "2"},
        )  # fmt: skip
        assert "Must be at least min_replicas (3)." in response.content.decode()


class TestAdaptersPerBatch:
    def test_the_drawer_sets_the_adapters_per_batch_and_says_the_engines_roll(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        html = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        drawer = html[html.index(f'id="drawer-replicas-{deployment.pk}"') :].split("</dialog>")[0]
        assert f'action="/console/deployments/{deployment.pk}/adapters/"' in drawer
        assert f'name="adapters-{deployment.pk}-max_adapters"' in drawer
        assert "restarts them one replica at a time" in drawer
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/adapters/", {f"adapters-{deployment.pk}-max_adapters": "4"}
        )
        assert response.status_code == 302
        deployment.refresh_from_db()
        assert deployment.max_adapters == 4
        entry = AuditEntry.objects.get(action="deployment.adapters", target=str(deployment.pk))
        assert (entry.before, entry.after) == ({"max_adapters": 0}, {"max_adapters": 4})
        page = admin_client.get(response["Location"]).content.decode()
        assert "4 LoRA adapters per batch; its engines restart one replica at a time" in page

    def test_a_refused_value_shows_on_its_field_and_changes_nothing(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/adapters/", {f"adapters-{deployment.pk}-max_adapters": "65"}
        )
        assert response.status_code == 200
        html = response.content.decode()
        assert "Ensure this value is less than or equal to 64." in html
        assert "data-open-on-load" in html[html.index(f'id="drawer-replicas-{deployment.pk}"') :][:200]
        Deployment.objects.filter(pk=deployment.pk).update(status="draining")
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/adapters/", {f"adapters-{deployment.pk}-max_adapters": "2"}
        )
        assert f"Deployment {deployment.pk} is draining" in response.content.decode()
        assert Deployment.objects.get(pk=deployment.pk).max_adapters == 0
        assert not AuditEntry.objects.filter(action="deployment.adapters").exists()

    def test_not_offered_where_adapters_cannot_run_nor_to_organisation_users(self, admin_client, chat_model, alice_org):
        chat_model.task = "embedding"
        chat_model.save(update_fields=["task"])
        deployment = deployment_of(chat_model, "v1")
        html = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        assert "data-adapters-form" not in html
        user = get_user_model().objects.create_user(username="org-admin", password="x")
        Membership.objects.create(user=user, organization=alice_org, role=Role.ORG_ADMIN)
        client = Client()
        client.force_login(user)
        posted = client.post(
            f"/console/deployments/{deployment.pk}/adapters/", {f"adapters-{deployment.pk}-max_adapters": "2"}
        )
        assert posted.status_code == 403
        assert Deployment.objects.get(pk=deployment.pk).max_adapters == 0


def scaling(deployment: Deployment, replicas: int = 1, low: int = 1, high: int = 4, **policy: str) -> dict[str, str]:
    """The one scaling form as posted: the count and bounds, and the policy's fields given."""
    scale, auto = f"scale-{deployment.pk}-", f"autoscale-{deployment.pk}-"
    return {scale + "replicas": str(replicas), scale + "min_replicas": str(low), scale + "max_replicas": str(high),
            **{auto + name: value for name, value in policy.items()}}  # fmt: skip


class TestAutoscaling:
    def test_it_sets_the_policy(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/scale/",
            scaling(deployment, enabled="on", target_queue_per_replica="2", target_p99_ms="1500"),
        )
        assert response.status_code == 302
        deployment.refresh_from_db()
        assert deployment.autoscale["enabled"] is True
        assert deployment.autoscale["target_queue_per_replica"] == 2.0
        assert deployment.autoscale["target_p99_ms"] == 1500.0
        assert deployment.autoscale["cooldown_seconds"] == 60.0  # blank: the default
        page = admin_client.get(response["Location"]).content.decode()
        assert f"Deployment {deployment.pk} wants 1 replica (between 1 and 4); autoscaling on." in page
        # The count was set again unchanged: only the policy is in the audit log.
        assert [e.action for e in AuditEntry.objects.filter(target=str(deployment.pk))] == ["deployment.autoscale"]

    def test_a_predictive_policy_shows_the_busiest_moment_its_profile_expects(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/scale/",
            scaling(deployment, enabled="on", predictive="on", predictive_lead_seconds="600"),
        )
        assert response.status_code == 302
        deployment.refresh_from_db()
        assert (deployment.autoscale["predictive"], deployment.autoscale["predictive_lead_seconds"]) == (True, 600.0)
        html = admin_client.get("/console/deployments/").content.decode()
        assert "predictive: no forecast until a day of usage is rolled up" in html
        # A week ago, 7,200 requests of 1 s in the hour after this one: 2 in flight.
        key = api_key_create(organization=organization_create(name="Outlook org"), name="k").api_key
        hour = timezone.now().replace(minute=0, second=0, microsecond=0)
        UsageRollup.objects.create(
            period=UsageRollup.Period.HOUR, start=hour - timedelta(weeks=1) + timedelta(hours=1),
            organization=key.organization, api_key=key, model=chat_model.name, model_version="v1", requests=7200,
            latency_histogram={str(sketch.bucket_of(1000)): 7200},
        )  # fmt: skip
        html = admin_client.get("/console/deployments/").content.decode()
        expected_at = hour + timedelta(hours=1, minutes=30)
        assert f"predictive: busiest next 2 in flight, {expected_at:%a %H:%M} UTC" in html

    def test_a_bad_value_is_refused_on_its_field_and_nothing_is_set(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/scale/",
            scaling(deployment, replicas=3, enabled="on", scale_in_utilisation="3"),
        )
        assert response.status_code == 200
        html = response.content.decode()
        assert "Must be at most 1." in html
        drawer = f"drawer-replicas-{deployment.pk}"
        assert f'id="{drawer}" aria-labelledby="{drawer}-title" data-open-on-load' in html
        deployment.refresh_from_db()
        assert (deployment.autoscale, deployment.replicas) == ({}, 1)  # the count waited for the policy
        assert not AuditEntry.objects.filter(target=str(deployment.pk)).exists()

    def test_a_count_changed_alone_leaves_the_policy_as_it_was(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        page = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        assert f'name="autoscale-{deployment.pk}-cooldown_seconds" value="60.0"' in page  # the defaults, as posted
        defaults = {"target_queue_per_replica": "4.0", "target_in_flight_per_replica": "16.0",
                    "cooldown_seconds": "60.0", "scale_in_quiet_seconds": "300.0",
                    "scale_in_utilisation": "0.5"}  # fmt: skip
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/scale/", scaling(deployment, replicas=2, **defaults)
        )
        assert response.status_code == 302
        deployment.refresh_from_db()
        assert (deployment.replicas, deployment.autoscale) == (2, {})
        assert [e.action for e in AuditEntry.objects.filter(target=str(deployment.pk))] == ["deployment.scale"]
        page = admin_client.get(response["Location"]).content.decode()
        assert f"Deployment {deployment.pk} wants 2 replicas (between 1 and 4); autoscaling off." in page

    def test_a_lora_adapter_has_a_count_and_no_policy(self, admin_client, chat_model):
        adapter = ModelVersion.objects.create(
            model=chat_model, version="lora-1", framework="lora", artifact_uri="local://gpt-tiny/lora-1",
            artifact_sha256="0" * 64, artifact_size=1,
        )  # fmt: skip
        deployment = Deployment.objects.create(version=adapter, status="running", traffic_weight=0)
        html = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        drawer = html[html.index(f'id="drawer-replicas-{deployment.pk}"') :].split("</dialog>")[0]
        assert f'name="scale-{deployment.pk}-replicas"' in drawer
        assert "<legend>Autoscaling</legend>" not in drawer
        assert "autoscale the base's deployment" in drawer
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/scale/", scaling(deployment, replicas=1, high=2, enabled="on")
        )
        assert response.status_code == 302
        deployment.refresh_from_db()
        assert (deployment.max_replicas, deployment.autoscale) == (2, {})  # the policy's fields ignored

    def test_decisions_show_with_their_reasons_and_figures(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        deployment_scale(
            actor=None, deployment=deployment, replicas=3,
            reasons=["queue 9.0 per replica > target 4"], observations={"queue_per_replica": 9.0},
        )  # fmt: skip
        for url in ("/console/deployments/", f"/console/deployments/scaling/?model={chat_model.name}"):
            html = admin_client.get(url).content.decode()
            assert "queue 9.0 per replica &gt; target 4" in html
            assert "queue_per_replica: 9.0" in html
            assert "1 → 3" in html
            assert "autoscaler" in html
        assert "queue 9.0" not in admin_client.get("/console/deployments/scaling/?model=other").content.decode()


class TestHotSwap:
    def test_it_starts_a_swap_and_shows_its_phase(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/swap/", {f"swap-{deployment.pk}-version": "v3"}
        )
        assert response.status_code == 302
        entry = AuditEntry.objects.get(action="deployment.swap", target=str(deployment.pk))
        html = admin_client.get(response["Location"]).content.decode()
        assert "Hot-swap of deployment" in html
        assert f'data-swap-id="{entry.pk}"' in html
        assert 'data-swap-open="true"' in html
        status = admin_client.get(f"/console/deployments/swaps/{entry.pk}/status/").json()
        assert status["phase"] == "starting"
        assert status["open"] is True

    def test_swapping_to_the_same_version_is_refused(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        response = admin_client.post(
            f"/console/deployments/{deployment.pk}/swap/", {f"swap-{deployment.pk}-version": "v1"}
        )
        assert response.status_code == 200
        assert f"Deployment {deployment.pk} serves gpt-tiny:v1 already." in response.content.decode()
        assert not AuditEntry.objects.filter(action="deployment.swap", target=str(deployment.pk)).exists()

    def test_a_swap_is_cancelled(self, admin_client, chat_model):
        deployment = deployment_of(chat_model, "v1")
        new = deployment_swap_version(
            actor=None, deployment=deployment, version=ModelVersion.objects.get(model=chat_model, version="v3")
        )
        entry = AuditEntry.objects.get(action="deployment.swap")
        response = admin_client.post(f"/console/deployments/swaps/{entry.pk}/cancel/")
        assert response.status_code == 302
        new.refresh_from_db()
        assert new.status == "stopped"
        assert admin_client.get(f"/console/deployments/swaps/{entry.pk}/status/").json()["phase"] == "cancelled"
        again = admin_client.post(f"/console/deployments/swaps/{entry.pk}/cancel/", follow=True)
        assert "The swap was not cancelled: The swap is over already." in again.content.decode()


def hot_swapped(model: Model, old: Deployment, to: str) -> Deployment:
    """``old`` hot-swapped to ``to`` through to completed, as the supervisors would step it."""
    new = deployment_swap_version(actor=None, deployment=old, version=ModelVersion.objects.get(model=model, version=to))
    Replica.objects.create(deployment=new, host="h", state="ready", endpoint="http://x", last_heartbeat=timezone.now())
    entry = AuditEntry.objects.filter(action="deployment.swap", target=str(old.pk)).latest("id")
    assert deployment_swap_shift(swap=entry, heartbeat_after=timezone.now() - timedelta(minutes=1))
    deployment_swap_drain(swap=entry)
    deployment_swap_finish(swap=entry, outcome="completed", reason="every old replica stopped")
    new.refresh_from_db()
    return new


def words(response: Any) -> str:
    """A page's HTML with its whitespace runs as single spaces: the text as read."""
    return " ".join(response.content.decode().split())


class TestRollback:
    URL = "/console/deployments/models/gpt-tiny/rollback/"

    def test_after_a_hot_swap_it_is_offered_confirmed_and_started(self, admin_client, chat_model):
        v3 = hot_swapped(chat_model, deployment_of(chat_model, "v1"), "v3")
        html = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        assert f'<a class="button secondary" href="{self.URL}" data-rollback="v1"' in html
        assert "Roll back to v1…" in html
        page = words(admin_client.get(self.URL))
        assert "Roll back gpt-tiny to v1?" in page
        assert "gpt-tiny serves v3 since the hot-swap of" in page
        assert f"deployment #{v3.pk} (v3) is hot-swapped back: v1 starts on 1 new replica beside it" in page
        assert 'name="version" value="v1"' in page
        # A POST without the confirmation only asks.
        assert admin_client.post(self.URL, {"version": "v1"}).status_code == 200
        assert not AuditEntry.objects.filter(action="model.rollback").exists()

        response = admin_client.post(self.URL, {"confirm": "yes", "version": "v1"})
        assert response.status_code == 302
        new = Deployment.objects.get(version__model=chat_model, version__version="v1", status="pending")
        assert (new.traffic_weight, deployment_of(chat_model, "v3").traffic_weight) == (0, 100)
        entry = AuditEntry.objects.get(action="model.rollback", target="gpt-tiny")
        assert (entry.actor_name, entry.after["via"], entry.after["swap_to"]) == ("ops", "hot-swap", new.pk)
        page = admin_client.get(response["Location"]).content.decode()
        assert (
            f"Rollback of gpt-tiny to v1 started: deployment {new.pk} is starting, and takes the traffic of "
            f"deployment {v3.pk} once every replica is ready."
        ) in page
        assert 'data-swap-open="true"' in page  # the swap it started, followed as any other
        assert "No rollback to v1 now: A hot-swap of gpt-tiny (v3 → v1) is under way" in page

    def test_after_a_promotion_the_ready_base_takes_the_traffic_back_at_once(self, admin_client, chat_model):
        Replica.objects.create(
            deployment=deployment_of(chat_model, "v1"), host="h", state="ready", last_heartbeat=timezone.now()
        )
        traffic_set(actor=None, model=chat_model, weights={"v2": 100})
        AuditEntry.objects.create(
            action="canary.promote", target_type="canary", target="gpt-tiny", actor_name="canary controller",
            before={}, after={"base_version": "v1", "canary_version": "v2", "status": "promoted"},
        )  # fmt: skip
        page = words(admin_client.get(self.URL))
        assert "gpt-tiny serves v2 since the canary promotion of" in page
        assert "(by canary controller)" in page
        assert "all of gpt-tiny's traffic moves to it at once" in page
        response = admin_client.post(self.URL, {"confirm": "yes", "version": "v1"}, follow=True)
        assert "Rolled gpt-tiny back to v1: it serves all the traffic." in response.content.decode()
        assert weights(chat_model) == {"v1": 100, "v2": 0}

    def test_not_offered_where_nothing_changed_and_explained_where_it_cannot(self, admin_client, chat_model):
        html = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        assert "data-rollback" not in html
        assert "never changed: there is no earlier version to roll back to" in words(admin_client.get(self.URL))
        response = admin_client.post(self.URL, {"confirm": "yes", "version": "v1"}, follow=True)
        assert "Not rolled back: gpt-tiny&#x27;s serving version never changed" in response.content.decode()

        v3 = hot_swapped(chat_model, deployment_of(chat_model, "v1"), "v3")
        Deployment.objects.filter(pk=v3.pk).update(status="stopped")
        html = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        assert 'href="/console/deployments/models/gpt-tiny/rollback/"' not in html
        why = f"Deployment #{v3.pk}, which took over from v1, no longer serves."
        assert f"No rollback to v1 now: {why}" in html
        page = words(admin_client.get(self.URL))
        assert f"It cannot be rolled back now: {why}" in page
        assert 'name="confirm"' not in page

    def test_a_version_other_than_the_one_confirmed_changes_nothing(self, admin_client, chat_model):
        hot_swapped(chat_model, deployment_of(chat_model, "v1"), "v3")
        response = admin_client.post(self.URL, {"confirm": "yes", "version": "v2"}, follow=True)
        assert "Not rolled back: gpt-tiny would roll back to v1, not v2" in response.content.decode()
        assert not AuditEntry.objects.filter(action="model.rollback").exists()
        assert weights(chat_model)["v3"] == 100

    def test_only_platform_admins_may(self, chat_model, alice_org):
        hot_swapped(chat_model, deployment_of(chat_model, "v1"), "v3")
        response = Client().post(self.URL, {"confirm": "yes", "version": "v1"})
        assert response.status_code == 302
        assert response["Location"].startswith("/accounts/login/")
        user = get_user_model().objects.create_user(username="rb-member", password="x")
        Membership.objects.create(user=user, organization=alice_org, role=Role.ORG_ADMIN)
        client = Client()
        client.force_login(user)
        assert client.get(self.URL).status_code == 403
        assert client.post(self.URL, {"confirm": "yes", "version": "v1"}).status_code == 403
        assert not AuditEntry.objects.filter(action="model.rollback").exists()


def test_unknown_things_are_404(admin_client: Any) -> None:
    assert admin_client.post("/console/deployments/models/nope/traffic/", {}).status_code == 404
    assert admin_client.post("/console/deployments/999999/scale/", {}).status_code == 404
    assert admin_client.get("/console/deployments/swaps/999999/status/").status_code == 404
    assert admin_client.get("/console/deployments/models/nope/rollback/").status_code == 404


def usage(key: Any, model: str, version: str, rows: list[tuple[int, int]], *, at: Any, cache: str = "miss") -> None:
    """Usage records of ``model``:``version`` admitted at ``at``: (status, latency ms) each."""
    for status, latency in rows:
        make_record(key, at=at, model=model, version=version, status=status, latency=latency, cache=cache)


LIVE = timedelta(minutes=5)


@pytest.fixture
def api_key() -> Any:
    org = organization_create(name=f"Live table {uuid.uuid4().hex[:6]}")
    return api_key_create(organization=org, name="traffic").api_key


class TestLiveTable:
    """Requests/s, p99 and errors per deployment over the last minutes, counted as canaries count."""

    def test_served_summaries_count_as_the_canary_controller_does(self, chat_model, api_key):
        now = timezone.now()
        answered = [(200, ms) for ms in range(1, 101)]  # p99 (nearest rank) of 1..100 ms is 99
        usage(api_key, "gpt-tiny", "v1", [*answered, (500, 5000), (429, 1)], at=now - timedelta(seconds=30))
        usage(api_key, "gpt-tiny", "v1", [(200, 1)] * 7, at=now - timedelta(seconds=20), cache="hit")  # no engine
        usage(api_key, "gpt-tiny", "v1", [(500, 1)] * 9, at=now - timedelta(minutes=9))  # before the window
        FailedAttempt.objects.create(
            request_id=uuid.uuid4(), organization_id=api_key.organization_id, model="gpt-tiny", model_version="v1",
            status_code=502, created_at=now - timedelta(seconds=10),
        )  # fmt: skip
        since = now - timedelta(minutes=5)
        found = served_summaries(versions=[("gpt-tiny", "v1"), ("gpt-tiny", "v2")], since=since, now=now)
        v1 = found[("gpt-tiny", "v1")]
        assert (v1.requests, v1.errors, v1.p99_latency_ms) == (103, 2, 99)
        assert v1.per_second == pytest.approx(103 / 300)
        assert v1.error_percent == pytest.approx(100 * 2 / 103)
        # The same requests as the controller's own read of the window.
        samples = served_requests(model="gpt-tiny", version="v1", since=since)
        assert len(samples) == v1.requests
        assert sum(s.server_error for s in samples) == v1.errors
        assert percentile([s.latency_ms for s in samples if s.answered], 0.99) == v1.p99_latency_ms
        v2 = found[("gpt-tiny", "v2")]
        assert (v2.requests, v2.errors, v2.p99_latency_ms, v2.error_percent) == (0, 0, None, None)

    def test_one_request_is_one_request(self, admin_client, chat_model, api_key):
        v1 = deployment_of(chat_model, "v1")
        usage(api_key, "gpt-tiny", "v1", [(200, 40)], at=timezone.now() - timedelta(minutes=1))
        html = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        row = html[html.index(f'data-deployment="{v1.pk}"') :].split("</tr>")[0]
        assert 'data-live="rate" title="1 request">' in row

    def test_the_board_shows_each_deployments_figures_and_the_endpoint_follows(self, admin_client, chat_model, api_key):
        v1, v2 = deployment_of(chat_model, "v1"), deployment_of(chat_model, "v2")
        Replica.objects.create(deployment=v1, host="h", state="ready")
        Replica.objects.create(deployment=v1, host="h", state="starting")
        Deployment.objects.filter(pk=v1.pk).update(replicas=3)
        usage(api_key, "gpt-tiny", "v1", [(200, 40)] * 297 + [(503, 40)] * 3, at=timezone.now() - timedelta(minutes=1))
        html = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        row = html[html.index(f'data-deployment="{v1.pk}"') :].split("</tr>")[0]
        assert '<td class="num" data-live="rate" title="300 requests">1.00/s</td>' in row
        assert '<td class="num" data-live="p99">40 ms</td>' in row
        assert '<span data-live="errors">1.0 %</span>' in row
        assert '<span data-live="replicas">1/3 ready</span>' in row
        assert 'data-lifecycle="serving"' in row
        quiet = html[html.index(f'data-deployment="{v2.pk}"') :].split("</tr>")[0]
        assert f'<td class="num" data-live="p99">{MISSING}</td>' in quiet
        assert 'data-lifecycle="deployed"' in quiet
        # What the page polls: the same cells.
        live = admin_client.get(f"/console/deployments/live/?ids={v1.pk},{v2.pk}").json()["deployments"]
        assert live[str(v1.pk)] | {"rate": "?"} == {
            "status": "Running", "state": "running", "replicas": "1/3 ready", "rate": "?", "p99": "40 ms",
            "errors": "1.0 %", "cancelled": "", "requests": "300",
        }  # fmt: skip
        assert live[str(v1.pk)]["rate"] in ("1.00/s", "0.99/s")  # the window moved on a little
        assert live[str(v2.pk)]["errors"] == MISSING

    def test_the_warm_pool_shows_beside_the_serving_replicas(self, admin_client, chat_model):
        v1 = deployment_of(chat_model, "v1")
        Deployment.objects.filter(pk=v1.pk).update(replicas=1, standby=2)
        Replica.objects.create(deployment=v1, host="h", state="ready")
        Replica.objects.create(deployment=v1, host="h", state="ready", standby=True)
        Replica.objects.create(deployment=v1, host="h", state="starting", standby=True)
        live = admin_client.get(f"/console/deployments/live/?ids={v1.pk}").json()["deployments"]
        assert live[str(v1.pk)]["replicas"] == "1/1 ready, 1/2 standby"

    def test_a_clients_cancel_is_no_error_and_shows_apart(self, admin_client, chat_model, api_key):
        """Issue 34, defect 12: 2 answered, 2 failed, 26 cancelled by their clients (499): the
        error % is of the 4 requests the server decided, the cancels a count of their own."""
        v1, v2 = deployment_of(chat_model, "v1"), deployment_of(chat_model, "v2")
        now = timezone.now()
        usage(api_key, "gpt-tiny", "v1", [(200, 40)] * 2 + [(502, 40)] * 2 + [(499, 900)] * 26,
              at=now - timedelta(minutes=1))  # fmt: skip
        usage(api_key, "gpt-tiny", "v2", [(499, 900)] * 26, at=now - timedelta(minutes=1))  # the audit's model
        found = served_summaries(versions=[("gpt-tiny", "v1"), ("gpt-tiny", "v2")], since=now - LIVE, now=now)
        v1_served, v2_served = found[("gpt-tiny", "v1")], found[("gpt-tiny", "v2")]
        assert v1_served.error_percent == pytest.approx(50.0)
        assert (v1_served.requests, v1_served.errors, getattr(v1_served, "cancelled", None)) == (30, 2, 26)
        assert (v2_served.errors, getattr(v2_served, "cancelled", None), v2_served.error_percent) == (0, 26, None)
        live = admin_client.get(f"/console/deployments/live/?ids={v1.pk},{v2.pk}").json()["deployments"]
        assert (live[str(v1.pk)]["errors"], live[str(v1.pk)].get("cancelled")) == ("50.0 %", "26 cancelled")
        assert (live[str(v2.pk)]["errors"], live[str(v2.pk)].get("cancelled")) == (MISSING, "26 cancelled")
        html = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        row = html[html.index(f'data-deployment="{v2.pk}"') :].split("</tr>")[0]
        assert 'data-live="cancelled">26 cancelled<' in row

    def test_the_endpoint_refuses_bad_ids(self, admin_client):
        assert admin_client.get("/console/deployments/live/?ids=1,x").status_code == 400
        many = ",".join(str(i) for i in range(500))
        assert "at most" in admin_client.get(f"/console/deployments/live/?ids={many}").json()["error"]
        assert admin_client.get("/console/deployments/live/?ids=").json() == {"deployments": {}}

    def test_last_change_says_what_and_who(self, admin_client, chat_model):
        v1, v2 = deployment_of(chat_model, "v1"), deployment_of(chat_model, "v2")
        ops = get_user_model().objects.get(username="ops")
        deployment_scale(actor=ops, deployment=v1, replicas=2, reasons=["test"], action="deployment.scale")
        traffic_set(actor=ops, model=chat_model, weights={"v1": 50, "v2": 50})
        changes = last_changes(deployments=[v1, v2])
        assert changes[v1.pk].action == changes[v2.pk].action == "traffic.set"  # newer than the scale
        deployment_scale(actor=None, deployment=v2, replicas=2, reasons=["test"], action="deployment.scale")
        html = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        row = html[html.index(f'data-deployment="{v2.pk}"') :].split("</tr>")[0]
        assert "scaled by the operator" in row
        row = html[html.index(f'data-deployment="{v1.pk}"') :].split("</tr>")[0]
        assert "traffic split set by ops" in row


class TestDrawers:
    def test_every_action_is_a_button_opening_its_drawer(self, admin_client, chat_model):
        v1 = deployment_of(chat_model, "v1")
        html = admin_client.get("/console/deployments/?model=gpt-tiny").content.decode()
        for kind, pk in (("deploy", chat_model.pk), ("traffic", chat_model.pk), ("swap", v1.pk),
                         ("replicas", v1.pk)):  # fmt: skip
            assert f'data-drawer="drawer-{kind}-{pk}"' in html
            assert f'<dialog class="drawer" id="drawer-{kind}-{pk}"' in html
        # One scaling control: the replicas, the count and the policy in one drawer, one form.
        for gone in ("scale", "autoscale"):
            assert f"drawer-{gone}-{v1.pk}" not in html
        row = html[html.index(f'data-deployment="{v1.pk}"') :].split("</tr>")[0]
        assert row.count("data-drawer=") == 2  # scaling, hot-swap
        drawer = html[html.index(f'id="drawer-replicas-{v1.pk}"') :].split("</dialog>")[0]
        assert "Replicas and scaling of deployment #" in drawer
        assert 'class="replicas"' in drawer
        # Beside it, apart (a roll of restarts, not a count): the LoRA adapters per batch.
        [form, adapters] = drawer.split('<form method="post"')[1:]
        assert f'action="/console/deployments/{v1.pk}/scale/"' in form
        assert f'action="/console/deployments/{v1.pk}/adapters/"' in adapters
        for name in ("scale-{}-replicas", "scale-{}-max_replicas", "autoscale-{}-enabled", "autoscale-{}-predictive"):
            assert f'name="{name.format(v1.pk)}"' in form
        assert "<legend>Autoscaling</legend>" in form
        assert "data-open-on-load" not in html
        # Each deployment's history and the model's, in the audit log filtered to them.
        audit = reverse("console:audit")
        assert f'<a href="{audit}?target=deployment:{v1.pk}" data-audit-of="deployment">history</a>' in html
        assert f'href="{audit}?target=model:gpt-tiny" data-audit-of="model"' in html
        assert f'<tr id="deployment-{v1.pk}" data-deployment="{v1.pk}">' in html  # the audit log links here

    def test_a_refused_form_opens_its_drawer_again(self, admin_client, chat_model):
        v1 = deployment_of(chat_model, "v1")
        html = admin_client.post(f"/console/deployments/{v1.pk}/scale/", scaling(v1, replicas=9)).content.decode()
        assert html.count("data-open-on-load") == 1
        assert f'id="drawer-replicas-{v1.pk}" aria-labelledby="drawer-replicas-{v1.pk}-title" data-open-on-load' in html
        assert "Must lie between 1 (min_replicas, at least 1) and 4." in html
