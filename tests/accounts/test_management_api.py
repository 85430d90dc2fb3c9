"""The management REST API: what each role may do, and that tenants never see each other."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from accounts.models import ApiKey, Membership, Role
from accounts.services import api_key_create, membership_set, organization_create, platform_organization
from tests.support.api import client_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(people):
    alice, bob, carol, ml = (people[n] for n in ("alice", "bob", "carol", "ml"))
    org_a = organization_create(name="Alice Corp")
    org_b = organization_create(name="Bob Ltd")
    membership_set(user=alice, organization=org_a, role=Role.ORG_ADMIN)
    membership_set(user=carol, organization=org_a, role=Role.ORG_MEMBER)
    membership_set(user=bob, organization=org_b, role=Role.ORG_ADMIN)
    platform = platform_organization()
    membership_set(user=ml, organization=platform, role=Role.PLATFORM_ADMIN)
    key_a = api_key_create(organization=org_a, name="a").api_key
    key_b = api_key_create(organization=org_b, name="b").api_key
    return {
        "alice": alice,
        "bob": bob,
        "carol": carol,
        "ml": ml,
        "a": org_a,
        "b": org_b,
        "key_a": key_a,
        "key_b": key_b,
    }


class TestTenantIsolation:
    """Alice (admin of A) on every endpoint of B: nothing, not even that it exists."""

    def test_listing_shows_only_her_org(self, world):
        names = [o["name"] for o in client_for(world["alice"]).get("/api/orgs/").json()]
        assert names == ["Alice Corp"]

    @pytest.mark.parametrize(
        ("method", "path", "body"),
        [
            ("get", "/api/orgs/{b}/", None),
            ("patch", "/api/orgs/{b}/", {"name": "Mine now"}),
            ("get", "/api/orgs/{b}/members/", None),
            ("post", "/api/orgs/{b}/members/", {"username": "alice", "role": "org_admin"}),
            ("get", "/api/orgs/{b}/members/{member_b}/", None),
            ("patch", "/api/orgs/{b}/members/{member_b}/", {"role": "org_member"}),
            ("delete", "/api/orgs/{b}/members/{member_b}/", None),
            ("get", "/api/orgs/{b}/keys/", None),
            ("post", "/api/orgs/{b}/keys/", {"name": "sneaky"}),
            ("get", "/api/orgs/{b}/keys/{key_b}/", None),
            ("patch", "/api/orgs/{b}/keys/{key_b}/", {"name": "x"}),
            ("post", "/api/orgs/{b}/keys/{key_b}/revoke/", None),
            ("post", "/api/orgs/{b}/keys/{key_b}/rotate/", {"grace_seconds": 0}),
            # B's key reached through A's URL is not found either.
            ("get", "/api/orgs/{a}/keys/{key_b}/", None),
            ("post", "/api/orgs/{a}/keys/{key_b}/revoke/", None),
        ],
    )
    def test_every_endpoint_answers_404(self, world, method, path, body):
        member_b = Membership.objects.get(organization=world["b"]).pk
        url = path.format(a=world["a"].pk, b=world["b"].pk, key_b=world["key_b"].pk, member_b=member_b)
        response = getattr(client_for(world["alice"]), method)(url, body, format="json")
        assert response.status_code == 404, response.content
        world["key_b"].refresh_from_db()
        assert world["key_b"].is_active
        assert world["key_b"].name == "b"
        assert world["b"].name == "Bob Ltd"
        assert ApiKey.objects.filter(organization=world["b"]).count() == 1

    def test_anonymous_is_refused(self, world):
        assert APIClient().get("/api/orgs/").status_code in {401, 403}


class TestRoles:
    def test_an_org_admin_issues_a_key_shown_once(self, world):
        response = client_for(world["alice"]).post(
            f"/api/orgs/{world['a'].pk}/keys/",
            {"name": "ci", "rate_limit_rpm": 120, "allowed_models": ["m"], "monthly_token_quota": 5000},
            format="json",
        )
        assert response.status_code == 201, response.content
        body = response.json()
        assert body["key"].startswith("sk-")
        assert (body["rate_limit_rpm"], body["allowed_models"], body["monthly_token_quota"]) == (120, ["m"], 5000)
        listed = client_for(world["alice"]).get(f"/api/orgs/{world['a'].pk}/keys/").json()
        assert all("key" not in k and "key_hash" not in k for k in listed)

    def test_a_member_reads_but_does_not_write(self, world):
        carol = client_for(world["carol"])
        assert carol.get(f"/api/orgs/{world['a'].pk}/keys/").status_code == 200
        assert carol.post(f"/api/orgs/{world['a'].pk}/keys/", {"name": "x"}, format="json").status_code == 403
        assert carol.post(f"/api/orgs/{world['a'].pk}/keys/{world['key_a'].pk}/revoke/").status_code == 403

    def test_only_platform_admins_set_org_limits_and_create_orgs(self, world):
        alice = client_for(world["alice"])
        assert alice.patch(f"/api/orgs/{world['a'].pk}/", {"rate_limit_rpm": 10}, format="json").status_code == 403
        assert alice.patch(f"/api/orgs/{world['a'].pk}/", {"name": "Alice Inc"}, format="json").status_code == 200
        assert alice.post("/api/orgs/", {"name": "New"}, format="json").status_code == 403
        ml = client_for(world["ml"])
        changed = ml.patch(f"/api/orgs/{world['a'].pk}/", {"monthly_spend_cap": "12.50", "tier": "free"}, format="json")
        assert changed.status_code == 200
        assert (changed.json()["monthly_spend_cap"], changed.json()["tier"]) == ("12.500000", "free")
        assert ml.post("/api/orgs/", {"name": "New"}, format="json").status_code == 201
        assert {"Alice Inc", "Bob Ltd", "Platform", "New"} <= {o["name"] for o in ml.get("/api/orgs/").json()}

    def test_an_org_admin_cannot_grant_platform_admin(self, world):
        response = client_for(world["alice"]).post(
            f"/api/orgs/{world['a'].pk}/members/", {"username": "carol", "role": "platform_admin"}, format="json"
        )
        assert response.status_code == 403
        assert Membership.objects.get(user=world["carol"]).role == "org_member"

    def test_members_are_managed_by_org_admins(self, world):
        alice = client_for(world["alice"])
        invited = alice.post(
            f"/api/orgs/{world['a'].pk}/members/", {"username": "bob", "role": "org_member"}, format="json"
        )
        assert invited.status_code == 202
        accepted = client_for(world["bob"]).post(f"/api/invitations/{invited.json()['id']}/accept/")
        assert accepted.status_code == 201, accepted.content
        member_id = accepted.json()["id"]
        promoted = alice.patch(f"/api/orgs/{world['a'].pk}/members/{member_id}/", {"role": "org_admin"}, format="json")
        assert promoted.json()["role"] == "org_admin"
        assert alice.delete(f"/api/orgs/{world['a'].pk}/members/{member_id}/").status_code == 204

    def test_bad_limits_are_a_400(self, world):
        response = client_for(world["alice"]).post(
            f"/api/orgs/{world['a'].pk}/keys/", {"name": "x", "budget_alert_percent": 150}, format="json"
        )
        assert response.status_code == 400


class TestKeyLifecycleServices:
    def test_revoke(self, world):
        response = client_for(world["alice"]).post(f"/api/orgs/{world['a'].pk}/keys/{world['key_a'].pk}/revoke/")
        assert response.status_code == 200
        assert response.json()["is_active"] is False
        assert response.json()["revoked_at"] is not None

    def test_rotate(self, world):
        response = client_for(world["alice"]).post(
            f"/api/orgs/{world['a'].pk}/keys/{world['key_a'].pk}/rotate/", {"grace_seconds": 3600}, format="json"
        )
        assert response.status_code == 201
        new, old = response.json()["new"], response.json()["old"]
        assert new["key"].startswith("sk-")
        assert old["rotated_to"] == new["id"]
        assert old["expires_at"] is not None
        again = client_for(world["alice"]).post(f"/api/orgs/{world['a'].pk}/keys/{world['key_a'].pk}/rotate/")
        assert again.status_code == 400

    def test_the_schema_documents_the_api(self, world):
        schema = client_for(world["ml"]).get("/api/schema/", HTTP_ACCEPT="application/json").json()
        assert "/api/orgs/{org_pk}/keys/{id}/rotate/" in schema["paths"]


class TestLimitInput:
    """Limits are 64-bit and bounded by what the limiter counts exactly; errors name the field."""

    def test_a_platform_admin_sets_a_large_tpm(self, world):
        ml = client_for(world["ml"])
        created = ml.post(f"/api/orgs/{world['a'].pk}/keys/", {"name": "big", "rate_limit_tpm": 10**11}, format="json")
        assert created.status_code == 201, created.content
        assert ApiKey.objects.get(pk=created.json()["id"]).rate_limit_tpm == 10**11
        org = ml.patch(f"/api/orgs/{world['a'].pk}/", {"rate_limit_tpm": 10**11}, format="json")
        assert org.status_code == 200
        assert org.json()["rate_limit_tpm"] == 10**11

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"rate_limit_tpm": 10**16}, "rate_limit_tpm"),
            ({"rate_limit_rpm": 0}, "rate_limit_rpm"),
            ({"max_concurrent": 2**63}, "max_concurrent"),
            ({"monthly_token_quota": 10**16}, "monthly_token_quota"),
            ({"monthly_spend_cap": "100000000"}, "monthly_spend_cap"),
            ({"monthly_spend_cap": "0"}, "monthly_spend_cap"),
            ({"budget_alert_percent": 0}, "budget_alert_percent"),
            ({"name": "x" * 256}, "name"),
            ({"allowed_models": ["m" * 256]}, "allowed_models"),
            ({"expires_at": "2000-01-01T00:00:00Z"}, "expires_at"),
        ],
    )
    def test_out_of_range_input_is_a_400_naming_the_field(self, world, body, field):
        ml = client_for(world["ml"])
        response = ml.post(f"/api/orgs/{world['a'].pk}/keys/", {"name": "k", **body}, format="json")
        assert response.status_code == 400, response.content
        assert field in response.json()
        if field != "name":
            patched = ml.patch(f"/api/orgs/{world['a'].pk}/keys/{world['key_a'].pk}/", body, format="json")
            assert patched.status_code == 400, patched.content
            assert field in patched.json()

    def test_organisation_limits_are_bounded_too(self, world):
        response = client_for(world["ml"]).patch(
            f"/api/orgs/{world['a'].pk}/", {"monthly_token_quota": 10**16}, format="json"
        )
        assert response.status_code == 400
        assert "monthly_token_quota" in response.json()
