"""GET /api/orgs/{id}/usage/: an organisation's usage by day, model and key, for its members only."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from accounts.models import Role
from accounts.services import api_key_create, membership_set, organization_create, platform_organization
from billing.models import RollupProgress
from billing.rollups import rollups_build
from tests.support.api import client_for
from tests.support.usage_records import make_record

pytestmark = pytest.mark.django_db

DAY1 = datetime(2026, 6, 1, 10, tzinfo=UTC)
DAY2 = datetime(2026, 6, 2, 10, tzinfo=UTC)
WINDOW = "start_date=2026-06-01&end_date=2026-06-02"


@pytest.fixture
def world(people):
    alice, bob, carol, ml = (people[n] for n in ("alice", "bob", "carol", "ml"))
    org_a = organization_create(name="Alice Corp")
    org_b = organization_create(name="Bob Ltd")
    membership_set(user=alice, organization=org_a, role=Role.ORG_ADMIN)
    membership_set(user=carol, organization=org_a, role=Role.ORG_MEMBER)
    membership_set(user=bob, organization=org_b, role=Role.ORG_ADMIN)
    membership_set(user=ml, organization=platform_organization(), role=Role.PLATFORM_ADMIN)
    a1 = api_key_create(organization=org_a, name="a1").api_key
    a2 = api_key_create(organization=org_a, name="a2").api_key
    b1 = api_key_create(organization=org_b, name="b1").api_key
    for at in (DAY1, DAY2):
        make_record(a1, at=at, model="m", cost="0.001234")
        make_record(a2, at=at, model="m", status=500)
        make_record(b1, at=at, model="secret-model", cost="9")
    RollupProgress.objects.all().delete()
    rollups_build()
    return {"alice": alice, "bob": bob, "carol": carol, "ml": ml, "a": org_a, "b": org_b, "a1": a1, "a2": a2, "b1": b1}


def get(user, org, query: str = WINDOW):
    return client_for(user).get(f"/api/orgs/{org.pk}/usage/?{query}")


class TestOrganizationUsage:
    def test_a_member_sees_the_organisation_by_day_model_and_key(self, world):
        response = get(world["carol"], world["a"])
        assert response.status_code == 200, response.content
        body = response.json()
        assert body["object"] == "list"
        assert not body["has_more"]
        assert body["next_page"] is None
        found = [(r["date"], r["model"], r["api_key"], r["requests"], r["errors"]) for r in body["data"]]
        a1, a2 = world["a1"].pk, world["a2"].pk
        assert found == sorted(
            [("2026-06-01", "m", a1, 1, 0), ("2026-06-01", "m", a2, 1, 1),
             ("2026-06-02", "m", a1, 1, 0), ("2026-06-02", "m", a2, 1, 1)],
        )  # fmt: skip
        first = next(r for r in body["data"] if r["api_key"] == a1)
        assert first["object"] == "usage.daily"
        assert (first["api_key_name"], first["api_key_prefix"]) == ("a1", world["a1"].prefix)
        assert (first["input_tokens"], first["output_tokens"], first["cached_tokens"]) == (10, 5, 0)
        assert (first["cost"], first["currency"]) == ("0.001234000000", "USD")

    def test_a_clients_cancels_are_counted_apart_from_errors(self, world):
        """Issue 34, defect 12: a request its client cancelled (499) is not an error."""
        day3 = datetime(2026, 6, 3, 10, tzinfo=UTC)
        for status in [499] * 26 + [502] * 2:
            make_record(world["a1"], at=day3, model="stopped", status=status, error_code="")
        rollups_build()
        [row] = get(world["carol"], world["a"], "start_date=2026-06-03&end_date=2026-06-03").json()["data"]
        assert (row["requests"], row["errors"], row.get("cancelled")) == (28, 2, 26)

    def test_pages_follow_the_cursor(self, world):
        seen, query = [], f"{WINDOW}&limit=3"
        while True:
            body = get(world["alice"], world["a"], query).json()
            seen += [(r["date"], r["api_key"]) for r in body["data"]]
            if not body["has_more"]:
                break
            query = f"{WINDOW}&limit=3&after={body['next_page']}"
        assert len(seen) == 4
        assert seen == sorted(seen)

    def test_one_key_only(self, world):
        body = get(world["alice"], world["a"], f"{WINDOW}&api_key={world['a2'].pk}").json()
        assert {r["api_key"] for r in body["data"]} == {world["a2"].pk}
        # Another tenant's key through this organisation: nothing.
        assert get(world["alice"], world["a"], f"{WINDOW}&api_key={world['b1'].pk}").json()["data"] == []

    def test_another_tenant_gets_404(self, world):
        assert get(world["alice"], world["b"]).status_code == 404
        assert get(world["carol"], world["b"]).status_code == 404
        assert get(world["bob"], world["a"]).status_code == 404

    def test_a_platform_admin_sees_any_organisation(self, world):
        body = get(world["ml"], world["b"]).json()
        assert {r["model"] for r in body["data"]} == {"secret-model"}

    def test_anonymous_is_refused(self, world, client):
        assert client.get(f"/api/orgs/{world['a'].pk}/usage/").status_code in {401, 403}

    @pytest.mark.parametrize(
        ("query", "field"),
        [
            ("start_date=2026-06-03&end_date=2026-06-02", "start_date"),
            ("start_date=2026-13-01", "start_date"),
            ("end_date=yesterday", "end_date"),
            ("limit=0", "limit"),
            ("limit=101", "limit"),
            ("after=not-a-cursor", "after"),
            ("api_key=x", "api_key"),
        ],
    )
    def test_bad_parameters_are_400_naming_the_field(self, world, query, field):
        response = get(world["alice"], world["a"], query)
        assert response.status_code == 400
        assert field in response.json()

    def test_it_is_in_the_schema(self, world):
        schema = client_for(world["ml"]).get("/api/schema/", {"format": "json"}).json()
        operation = schema["paths"]["/api/orgs/{org_pk}/usage/"]["get"]
        assert {p["name"] for p in operation["parameters"]} >= {"start_date", "end_date", "limit", "after", "api_key"}
