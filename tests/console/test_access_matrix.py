"""Every page of the console and the portal, walked as each kind of visitor: anonymous, a
member of another organisation, an organisation member, an organisation admin and a platform
admin. The URLs come from the URLconf itself, so a page added later is walked too."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import URLPattern, reverse

from accounts.models import Membership, Role
from accounts.services import api_key_create, invitation_create, organization_create
from billing.services import invoice_draft, price_set
from console.pages import urls as page_urls
from registry.models import Deployment, Model, ModelVersion, Replica
from rollout.hotswap import deployment_swap_version
from tests.support import batches

pytestmark = pytest.mark.django_db

ROLES = ("anonymous", "outsider", "member", "org_admin", "platform_admin")
# Portal pages only an organisation's admins may open (members get 403).
PORTAL_ADMIN_ONLY = {
    "portal-key-create", "portal-key-edit", "portal-key-revoke", "portal-key-rotate", "portal-invoices",
    "portal-invoice", "portal-invoice-pdf", "portal-invoice-csv", "portal-member-invite", "portal-member-role",
    "portal-member-remove",
    "portal-invitation-cancel", "portal-batch-cancel", "portal-batch-create", "portal-webhook-rotate",
    "portal-cache-budget",
}  # fmt: skip
# Pages of any signed-in user, under no organisation (answering one's own invitations).
SIGNED_IN_ANY = {"portal-invitation-accept", "portal-invitation-decline"}
# Answers that mean "let in": the page (200), the page with the query refused on it (400), or a
# view for POST only (405).
LET_IN = {200, 400, 405}


@pytest.fixture
def world(store) -> dict[str, Any]:
    users = get_user_model().objects
    org, other = organization_create(name="Walk Org"), organization_create(name="Other Org")
    people: dict[str, Any] = {"anonymous": None}
    for role, organization, membership in (
        ("outsider", other, Role.ORG_ADMIN), ("member", org, Role.ORG_MEMBER), ("org_admin", org, Role.ORG_ADMIN),
    ):  # fmt: skip
        people[role] = users.create_user(username=f"walk-{role}", password="pw-1234567890")
        Membership.objects.create(user=people[role], organization=organization, role=membership)
    people["platform_admin"] = users.create_superuser(username="walk-root", password="pw-1234567890")
    model = Model.objects.create(name="walk-model", task="chat")
    versions = [
        ModelVersion.objects.create(
            model=model,
            version=v,
            framework="pytorch",
            artifact_uri=f"local://walk/{v}",
            artifact_sha256="0" * 64,
            artifact_size=1,
        )
        for v in ("1", "2")
    ]
    deployment = Deployment.objects.create(version=versions[0], status="running", traffic_weight=100)
    replica = Replica.objects.create(deployment=deployment, host="walk-host", state="ready")
    deployment_swap_version(actor=None, deployment=deployment, version=versions[1])
    from rollout.hotswap import open_swaps

    key = api_key_create(organization=org, name="walk").api_key
    kwargs = {
        "org_id": org.pk,
        "key_id": key.pk,
        "invoice_id": invoice_draft(organization=org, period=dt.date(2026, 1, 1)).pk,
        "name": model.name,
        "version": "1",
        "pk": deployment.pk,
        "swap_id": open_swaps()[-1].entry.pk,
        "action": "pause",
        "replica_id": replica.pk,
        "membership_id": Membership.objects.get(user=people["member"]).pk,
        "invitation_id": invitation_create(organization=org, username="walk-invited").pk,
        "batch_id": batches.batch(org, key, lines={"succeeded": 1, "pending": 1}).public_id,
        "file_id": batches.stored_file(org, b"{}\n").public_id,
        "price_id": price_set(model=model, input_per_million="1", output_per_million="2").pk,
    }
    return {"people": people, "kwargs": kwargs}


def pages() -> list[URLPattern]:
    return [p for p in page_urls.urlpatterns if isinstance(p, URLPattern)]


def expected(name: str, path: str, role: str) -> set[int]:
    if role == "anonymous":
        return {302}
    if path.startswith("/console/"):
        return LET_IN if role == "platform_admin" else {403}
    if name == "portal-home":
        return {200, 302}
    if name in SIGNED_IN_ANY:
        return LET_IN
    if role == "outsider":
        return {404}
    if role == "member" and name in PORTAL_ADMIN_ONLY:
        return {403}
    return LET_IN


def test_every_page_is_walked():
    names = {p.name for p in pages()}
    assert {"overview", "models", "audit", "deployments", "canaries", "portal-usage", "portal-keys",
            "portal-invoices", "portal-members", "playground", "quickstart", "batches", "portal-batches",
            "portal-webhooks"} <= names  # fmt: skip


@pytest.mark.parametrize("role", ROLES)
def test_each_visitor_gets_what_their_role_allows(world, role):
    who = world["people"][role]
    client = Client()
    if who is not None:
        client.force_login(who)
    wrong = []
    for pattern in pages():
        wanted = {k: v for k, v in world["kwargs"].items() if k in pattern.pattern.regex.groupindex}
        path = reverse(f"console:{pattern.name}", kwargs=wanted)
        response = client.get(path)
        allowed = expected(str(pattern.name), path, role)
        to_login = response.status_code == 302 and response["Location"].startswith("/accounts/login/")
        # A page that sends a signed-in visitor on (e.g. an action's GET back to its page) lets them in.
        sent_on = response.status_code == 302 and not to_login and allowed >= LET_IN
        if response.status_code not in allowed and not sent_on:
            wrong.append((path, response.status_code, sorted(allowed)))
        elif role == "anonymous":
            assert to_login, path
    assert wrong == []


def test_posts_are_refused_to_whoever_may_not_write(world):
    """A forged POST is refused like the page itself: console writes by anyone but a platform
    admin, a portal admin write by a plain member."""
    posts = [
        (f"/console/deployments/models/{world['kwargs']['name']}/traffic/", {"w-1": "100"}),
        (f"/console/canaries/{world['kwargs']['name']}/pause/", {}),
        (f"/console/deployments/replicas/{world['kwargs']['replica_id']}/restart/", {"confirm": "yes"}),
        (f"/portal/{world['kwargs']['org_id']}/keys/new/", {"name": "forged"}),
        (f"/portal/{world['kwargs']['org_id']}/keys/{world['kwargs']['key_id']}/revoke/", {"confirm": "1"}),
        (f"/portal/{world['kwargs']['org_id']}/members/invite/", {"username": "forged", "role": "org_admin"}),
        (f"/portal/{world['kwargs']['org_id']}/members/{world['kwargs']['membership_id']}/remove/", {}),
        (f"/portal/{world['kwargs']['org_id']}/batches/{world['kwargs']['batch_id']}/cancel/", {"confirm": "yes"}),
        (f"/portal/{world['kwargs']['org_id']}/batches/new/", {"endpoint": "/v1/chat/completions"}),
        (f"/portal/{world['kwargs']['org_id']}/webhooks/rotate/", {}),
    ]
    member = Client()
    member.force_login(world["people"]["member"])
    for path, body in posts:
        assert member.post(path, body).status_code == 403, path
    anonymous = Client()
    for path, body in posts:
        response = anonymous.post(path, body)
        assert response.status_code == 302, path
        assert response["Location"].startswith("/accounts/login/"), path
