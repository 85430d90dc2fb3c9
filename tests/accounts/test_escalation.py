"""What org admins may not do: widen their plan, touch platform admins, probe usernames."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.core.exceptions import PermissionDenied

from accounts.models import ApiKey, Invitation, Membership, Role, Tier
from accounts.services import (
    api_key_create,
    invitation_create,
    membership_set,
    organization_create,
    organization_update,
    platform_organization,
)
from core.errors import InvalidInput
from tests.support.api import client_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(people):
    alice, bob, carol, ml = (people[n] for n in ("alice", "bob", "carol", "ml"))
    free = organization_create(name="Alice Corp", tier=Tier.FREE)
    paid = organization_create(name="Bob Ltd", tier=Tier.PAID)
    membership_set(user=alice, organization=free, role=Role.ORG_ADMIN)
    membership_set(user=bob, organization=paid, role=Role.ORG_ADMIN)
    platform = platform_organization()
    membership_set(user=ml, organization=platform, role=Role.PLATFORM_ADMIN)
    return {"alice": alice, "bob": bob, "carol": carol, "ml": ml, "free": free, "paid": paid}


def keys_url(org) -> str:
    return f"/api/orgs/{org.pk}/keys/"


class TestKeysStayWithinThePlan:
    @pytest.mark.parametrize(
        ("body", "field", "ceiling"),
        [
            ({"tier": "paid"}, "tier", "free"),
            ({"rate_limit_rpm": 61}, "rate_limit_rpm", "60"),
            ({"rate_limit_tpm": 100_001}, "rate_limit_tpm", "100000"),
            ({"max_concurrent": 5}, "max_concurrent", "4"),
            ({"max_concurrent": None}, "max_concurrent", "4"),
        ],
    )
    def test_an_org_admin_cannot_create_a_key_above_the_plan(self, world, body, field, ceiling):
        response = client_for(world["alice"]).post(keys_url(world["free"]), {"name": "k", **body}, format="json")
        assert response.status_code == 400, response.content
        assert ceiling in response.json()[field][0]
        assert not ApiKey.objects.filter(organization=world["free"]).exists()

    def test_omitted_limits_default_to_the_plan(self, world):
        response = client_for(world["alice"]).post(keys_url(world["free"]), {"name": "k"}, format="json")
        assert response.status_code == 201, response.content
        body = response.json()
        assert (body["tier"], body["rate_limit_rpm"], body["rate_limit_tpm"], body["max_concurrent"]) == (
            "free",
            60,
            100_000,
            4,
        )

    def test_the_organisations_own_limits_are_the_ceiling(self, world):
        organization_update(organization=world["free"], monthly_token_quota=1000, rate_limit_rpm=500)
        alice = client_for(world["alice"])
        nulled = alice.post(keys_url(world["free"]), {"name": "k", "monthly_token_quota": None}, format="json")
        assert nulled.status_code == 400
        assert "1000" in nulled.json()["monthly_token_quota"][0]
        raised = alice.post(keys_url(world["free"]), {"name": "k", "monthly_token_quota": 1001}, format="json")
        assert raised.status_code == 400
        # The organisation's own RPM (set by a platform admin) replaces the tier's ceiling.
        ok = alice.post(
            keys_url(world["free"]), {"name": "k", "rate_limit_rpm": 500, "monthly_token_quota": 900}, format="json"
        )
        assert ok.status_code == 201, ok.content
        defaulted = alice.post(keys_url(world["free"]), {"name": "d"}, format="json").json()
        assert defaulted["monthly_token_quota"] == 1000

    @pytest.mark.parametrize(
        ("change", "field"),
        [
            ({"tier": "paid"}, "tier"),
            ({"rate_limit_rpm": 1000}, "rate_limit_rpm"),
            ({"rate_limit_tpm": 10**9}, "rate_limit_tpm"),
            ({"max_concurrent": None}, "max_concurrent"),
        ],
    )
    def test_an_org_admin_cannot_raise_a_key_above_the_plan(self, world, change, field):
        key = api_key_create(organization=world["free"], name="k", max_concurrent=2, actor=world["alice"]).api_key
        response = client_for(world["alice"]).patch(f"{keys_url(world['free'])}{key.pk}/", change, format="json")
        assert response.status_code == 400, response.content
        assert field in response.json()
        key.refresh_from_db()
        assert (key.tier, key.rate_limit_rpm, key.rate_limit_tpm, key.max_concurrent) == ("free", 60, 100_000, 2)

    def test_an_org_admin_cannot_null_a_quota_the_plan_sets(self, world):
        organization_update(organization=world["paid"], monthly_token_quota=10_000, monthly_spend_cap=Decimal(50))
        key = api_key_create(organization=world["paid"], name="k", actor=world["bob"]).api_key
        assert (key.monthly_token_quota, key.monthly_spend_cap) == (10_000, Decimal(50))
        bob = client_for(world["bob"])
        for field in ("monthly_token_quota", "monthly_spend_cap"):
            response = bob.patch(f"{keys_url(world['paid'])}{key.pk}/", {field: None}, format="json")
            assert response.status_code == 400
            assert field in response.json()
        narrowed = bob.patch(f"{keys_url(world['paid'])}{key.pk}/", {"monthly_token_quota": 10}, format="json")
        assert narrowed.status_code == 200

    def test_a_platform_admin_may_set_anything(self, world):
        ml = client_for(world["ml"])
        created = ml.post(
            keys_url(world["free"]),
            {"name": "vip", "tier": "paid", "rate_limit_rpm": 100_000, "max_concurrent": None},
            format="json",
        )
        assert created.status_code == 201, created.content
        key_url = f"{keys_url(world['free'])}{created.json()['id']}/"
        assert ml.patch(key_url, {"rate_limit_tpm": 10**12}, format="json").status_code == 200
        # The org admin may still rename it, and send back the values it already has.
        alice = client_for(world["alice"])
        renamed = alice.patch(key_url, {"name": "renamed", "tier": "paid", "rate_limit_rpm": 100_000}, format="json")
        assert renamed.status_code == 200, renamed.content
        assert alice.patch(key_url, {"rate_limit_rpm": 100_001}, format="json").status_code == 400

    def test_a_paid_org_admin_gets_the_paid_ceilings(self, world):
        bob = client_for(world["bob"])
        ok = bob.post(keys_url(world["paid"]), {"name": "k", "tier": "paid", "rate_limit_rpm": 10_000}, format="json")
        assert ok.status_code == 201
        assert ok.json()["max_concurrent"] == 256
        refused = bob.post(keys_url(world["paid"]), {"name": "k", "rate_limit_rpm": 10_001}, format="json")
        assert refused.status_code == 400
        assert "10000" in refused.json()["rate_limit_rpm"][0]

    def test_the_operator_is_not_bound(self, world):
        # create_api_key and bootstrap act as platform admins (actor=None).
        key = api_key_create(
            organization=world["free"], name="demo", rate_limit_rpm=600, rate_limit_tpm=1_000_000, tier=Tier.PAID
        ).api_key
        assert (key.tier, key.rate_limit_rpm, key.max_concurrent) == ("paid", 600, None)


class TestPlatformAdminsAreOutOfReach:
    @pytest.fixture
    def ml_in_free(self, world):
        return membership_set(user=world["ml"], organization=world["free"], role=Role.PLATFORM_ADMIN)

    def test_an_org_admin_cannot_demote_a_platform_admin_by_posting_a_membership(self, world, ml_in_free):
        response = client_for(world["alice"]).post(
            f"/api/orgs/{world['free'].pk}/members/", {"username": "ml", "role": "org_member"}, format="json"
        )
        assert response.status_code == 403
        assert Membership.objects.get(pk=ml_in_free.pk).role == Role.PLATFORM_ADMIN
        assert not Invitation.objects.filter(username="ml").exists()

    def test_nor_by_patching_or_deleting_it(self, world, ml_in_free):
        alice = client_for(world["alice"])
        url = f"/api/orgs/{world['free'].pk}/members/{ml_in_free.pk}/"
        assert alice.patch(url, {"role": "org_member"}, format="json").status_code == 403
        assert alice.delete(url).status_code == 403
        assert Membership.objects.get(pk=ml_in_free.pk).role == Role.PLATFORM_ADMIN

    def test_a_platform_admin_with_a_plain_membership_is_protected_too(self, world):
        plain = membership_set(user=world["ml"], organization=world["free"], role=Role.ORG_MEMBER)
        url = f"/api/orgs/{world['free'].pk}/members/{plain.pk}/"
        assert client_for(world["alice"]).patch(url, {"role": "org_admin"}, format="json").status_code == 403

    def test_the_service_refuses_too(self, world, ml_in_free):
        with pytest.raises(PermissionDenied):
            membership_set(user=world["ml"], organization=world["free"], role=Role.ORG_MEMBER, actor=world["alice"])
        with pytest.raises(PermissionDenied):
            invitation_create(organization=world["free"], username="ml", actor=world["alice"])
        with pytest.raises(PermissionDenied):  # org admins invite; they never add directly
            membership_set(user=world["carol"], organization=world["free"], role=Role.ORG_MEMBER, actor=world["alice"])


class TestInvitations:
    def test_the_answer_is_the_same_for_existing_and_unknown_usernames(self, world):
        alice = client_for(world["alice"])
        url = f"/api/orgs/{world['free'].pk}/members/"
        existing = alice.post(url, {"username": "carol", "role": "org_member"}, format="json")
        unknown = alice.post(url, {"username": "nobody-at-all", "role": "org_member"}, format="json")
        assert existing.status_code == unknown.status_code == 202
        strip = lambda body: {k: v for k, v in body.items() if k not in {"id", "username", "created_at"}}  # noqa: E731
        assert strip(existing.json()) == strip(unknown.json())
        assert existing.json().keys() == unknown.json().keys()
        assert not Membership.objects.filter(user=world["carol"]).exists()

    def test_the_invited_user_sees_and_accepts_it(self, world):
        alice = client_for(world["alice"])
        invited = alice.post(
            f"/api/orgs/{world['free'].pk}/members/", {"username": "carol", "role": "org_admin"}, format="json"
        ).json()
        carol = client_for(world["carol"])
        listed = carol.get("/api/invitations/").json()
        assert [(i["id"], i["organization_name"], i["role"], i["invited_by"]) for i in listed] == [
            (invited["id"], "Alice Corp", "org_admin", "alice")
        ]
        assert client_for(world["bob"]).get("/api/invitations/").json() == []
        assert client_for(world["bob"]).post(f"/api/invitations/{invited['id']}/accept/").status_code == 404
        accepted = carol.post(f"/api/invitations/{invited['id']}/accept/")
        assert accepted.status_code == 201
        assert Membership.objects.get(user=world["carol"], organization=world["free"]).role == "org_admin"
        assert carol.get("/api/invitations/").json() == []
        assert carol.post(f"/api/invitations/{invited['id']}/accept/").status_code == 404

    def test_inviting_again_updates_the_pending_invitation(self, world):
        alice = client_for(world["alice"])
        url = f"/api/orgs/{world['free'].pk}/members/"
        first = alice.post(url, {"username": "carol"}, format="json").json()
        second = alice.post(url, {"username": "carol", "role": "org_admin"}, format="json").json()
        assert first["id"] == second["id"]
        assert Invitation.objects.get().role == "org_admin"

    def test_nobody_invites_a_platform_admin(self, world):
        response = client_for(world["alice"]).post(
            f"/api/orgs/{world['free'].pk}/members/", {"username": "carol", "role": "platform_admin"}, format="json"
        )
        assert response.status_code == 403

    def test_a_platform_admin_adds_existing_users_directly(self, world):
        ml = client_for(world["ml"])
        url = f"/api/orgs/{world['free'].pk}/members/"
        added = ml.post(url, {"username": "carol", "role": "org_member"}, format="json")
        assert added.status_code == 201
        assert Membership.objects.get(user=world["carol"], organization=world["free"]).role == "org_member"
        assert ml.post(url, {"username": "nobody-at-all"}, format="json").status_code == 400

    def test_the_schema_documents_invitations(self, world):
        schema = client_for(world["ml"]).get("/api/schema/", HTTP_ACCEPT="application/json").json()
        assert "/api/invitations/" in schema["paths"]
        assert "/api/invitations/{id}/accept/" in schema["paths"]
        assert {"201", "202"} <= set(schema["paths"]["/api/orgs/{org_pk}/members/"]["post"]["responses"])


class TestOrganisationNames:
    @pytest.mark.parametrize("name", ["Bob Ltd", "bob ltd", "BOB-LTD", "bob-ltd!"])
    def test_a_rename_onto_another_organisation_is_a_400(self, world, name):
        response = client_for(world["alice"]).patch(f"/api/orgs/{world['free'].pk}/", {"name": name}, format="json")
        assert response.status_code == 400
        assert "name" in response.json()
        world["free"].refresh_from_db()
        assert world["free"].name == "Alice Corp"

    def test_the_service_says_so_instead_of_an_integrity_error(self, world):
        with pytest.raises(InvalidInput, match="name"):
            organization_update(organization=world["free"], name="Bob Ltd")

    def test_creating_a_colliding_organisation_is_a_400_naming_the_field(self, world):
        response = client_for(world["ml"]).post("/api/orgs/", {"name": "bob ltd"}, format="json")
        assert response.status_code == 400
        assert list(response.json()) == ["name"]

    def test_a_free_rename_still_works(self, world):
        response = client_for(world["alice"]).patch(
            f"/api/orgs/{world['free'].pk}/", {"name": "Alice Inc"}, format="json"
        )
        assert response.status_code == 200
        assert response.json()["slug"] == "alice-corp"  # the slug is a stable identifier
