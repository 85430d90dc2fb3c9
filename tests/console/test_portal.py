"""The customer portal with Django's test client: who may open what, keys (the secret shown
once), usage and budget figures from the rollups, invoices and their downloads."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.grants import KeyGrant
from accounts.models import ApiKey, Membership, Organization, Plan, Role, Tier
from accounts.services import api_key_create, api_key_hash, organization_create
from billing import invoicing
from billing.models import BudgetAlert, Invoice, UsageRollup
from billing.services import invoice_draft, invoice_finalize, invoice_mark_paid
from core import formats

pytestmark = pytest.mark.django_db

PASSWORD = "pw-portal-123456"


@dataclass
class World:
    org: Organization
    other_org: Organization
    admin: Any
    member: Any
    outsider: Any
    platform_admin: Any
    key: ApiKey
    other_key: ApiKey

    def client(self, who: str | None) -> Client:
        client = Client()
        if who is not None:
            client.force_login(getattr(self, who))
        return client


@pytest.fixture
def world() -> World:
    users = get_user_model().objects
    org = organization_create(name="Alice Corp")
    other_org = organization_create(name="Bob Corp")
    made = {
        "admin": users.create_user(username="alice-admin", password=PASSWORD),
        "member": users.create_user(username="alice-member", password=PASSWORD),
        "outsider": users.create_user(username="bob-admin", password=PASSWORD),
        "platform_admin": users.create_superuser(username="ml-team", password=PASSWORD),
    }
    Membership.objects.create(user=made["admin"], organization=org, role=Role.ORG_ADMIN)
    Membership.objects.create(user=made["member"], organization=org, role=Role.ORG_MEMBER)
    Membership.objects.create(user=made["outsider"], organization=other_org, role=Role.ORG_ADMIN)
    key = api_key_create(organization=org, name="production").api_key
    other_key = api_key_create(organization=other_org, name="bob's key").api_key
    return World(org=org, other_org=other_org, key=key, other_key=other_key, **made)


def url(name: str, org: Organization, **kwargs: int) -> str:
    return reverse(f"console:{name}", kwargs={"org_id": org.pk, **kwargs})


def rollup(key: ApiKey, day: datetime, model: str, *, requests: int, cost: str, tokens: tuple[int, int, int]) -> None:
    start = datetime.combine(day.date(), time.min, UTC)
    UsageRollup.objects.create(
        period=UsageRollup.Period.DAY, start=start, organization_id=key.organization_id, api_key=key, model=model,
        model_version="1", requests=requests, input_tokens=tokens[0], output_tokens=tokens[1],
        cached_tokens=tokens[2], cost=Decimal(cost),
    )  # fmt: skip


class TestWhoMayOpenWhat:
    @pytest.fixture
    def invoice(self, world: World) -> Invoice:
        return invoice_draft(organization=world.org, period=invoicing.month_start(timezone.now()))

    def pages(self, world: World, invoice: Invoice) -> dict[str, str]:
        org = world.org
        return {
            "usage": url("portal-usage", org),
            "keys": url("portal-keys", org),
            "key-create": url("portal-key-create", org),
            "key-revoke": url("portal-key-revoke", org, key_id=world.key.pk),
            "key-rotate": url("portal-key-rotate", org, key_id=world.key.pk),
            "invoices": url("portal-invoices", org),
            "invoice": url("portal-invoice", org, invoice_id=invoice.pk),
            "invoice-pdf": url("portal-invoice-pdf", org, invoice_id=invoice.pk),
            "invoice-csv": url("portal-invoice-csv", org, invoice_id=invoice.pk),
        }

    def test_anonymous_visitors_go_to_the_login_page(self, world, invoice):
        for page in self.pages(world, invoice).values():
            response = world.client(None).get(page)
            assert response.status_code == 302, page
            assert response["Location"].startswith("/accounts/login/?next=")

    def test_another_organisations_member_gets_404_everywhere(self, world, invoice):
        for page in self.pages(world, invoice).values():
            assert world.client("outsider").get(page).status_code == 404, page

    @pytest.mark.parametrize("who", ["admin", "platform_admin"])
    def test_admins_open_every_page(self, world, invoice, who):
        for name, page in self.pages(world, invoice).items():
            assert world.client(who).get(page).status_code == 200, name

    def test_members_see_usage_and_keys_but_manage_nothing(self, world, invoice):
        allowed = {"usage", "keys"}
        client = world.client("member")
        for name, page in self.pages(world, invoice).items():
            assert client.get(page).status_code == (200 if name in allowed else 403), name
        for name in ("key-create", "key-revoke", "key-rotate"):
            assert client.post(self.pages(world, invoice)[name], {"name": "x"}).status_code == 403
        world.key.refresh_from_db()
        assert world.key.is_active
        assert ApiKey.objects.filter(organization=world.org).count() == 1

    def test_the_navigation_offers_invoices_to_admins_only(self, world, invoice):
        invoices = url("portal-invoices", world.org)
        assert invoices in world.client("admin").get(url("portal-keys", world.org)).content.decode()
        member_page = world.client("member").get(url("portal-keys", world.org)).content.decode()
        assert invoices not in member_page
        assert url("portal-key-create", world.org) not in member_page

    def test_a_key_of_another_organisation_is_404(self, world):
        client = world.client("admin")
        for name in ("portal-key-revoke", "portal-key-rotate"):
            assert client.get(url(name, world.org, key_id=world.other_key.pk)).status_code == 404
            assert client.post(url(name, world.org, key_id=world.other_key.pk)).status_code == 404
        world.other_key.refresh_from_db()
        assert world.other_key.is_active
        assert world.other_key.rotated_to_id is None

    def test_an_invoice_of_another_organisation_is_404(self, world):
        theirs = invoice_draft(organization=world.other_org, period=invoicing.month_start(timezone.now()))
        for name in ("portal-invoice", "portal-invoice-pdf", "portal-invoice-csv"):
            assert world.client("admin").get(url(name, world.org, invoice_id=theirs.pk)).status_code == 404

    def test_forms_need_the_csrf_token(self, world):
        client = Client(enforce_csrf_checks=True)
        client.force_login(world.admin)
        assert client.post(url("portal-key-create", world.org), {"name": "no token"}).status_code == 403
        assert not ApiKey.objects.filter(name="no token").exists()


def secret_in(html: str) -> str:
    match = re.search(r'id="api-key-secret"[^>]*value="(sk-[^"]+)"', html)
    assert match, "no secret on the page"
    return match.group(1)


class TestKeys:
    def test_it_lists_the_organisations_keys_only(self, world):
        html = world.client("member").get(url("portal-keys", world.org)).content.decode()
        assert world.key.masked in html
        assert "production" in html
        assert world.other_key.masked not in html

    def test_each_key_shows_the_models_it_may_call_and_its_expiry(self, world):
        world.key.allowed_models = ["chat-a", "chat-b"]
        world.key.expires_at = datetime(2031, 1, 2, 3, 4, tzinfo=UTC)
        world.key.save(update_fields=["allowed_models", "expires_at"])
        html = world.client("member").get(url("portal-keys", world.org)).content.decode()
        row = re.search(rf'<tr id="key-{world.key.pk}">(.*?)</tr>', html, re.S)
        assert row
        assert "only chat-a, chat-b · expires 2031-01-02 03:04" in row.group(1)
        world.key.allowed_models = []
        world.key.save(update_fields=["allowed_models"])
        html = world.client("member").get(url("portal-keys", world.org)).content.decode()
        assert "tier · every model · expires" in html

    def test_each_key_shows_its_requests_and_spend_this_month(self, world):
        today = timezone.now().astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        for start, model, requests, cost in ((today, "m", 1200, "3.5"), (today.replace(day=1), "n", 300, "0.004")):
            UsageRollup.objects.create(period=UsageRollup.Period.DAY, start=start, organization=world.org,
                                       api_key=world.key, model=model, model_version="1", requests=requests,
                                       cost=Decimal(cost))  # fmt: skip
        UsageRollup.objects.create(period=UsageRollup.Period.DAY, start=today.replace(day=1) - timedelta(days=1),
                                   organization=world.org, api_key=world.key, model="m", model_version="1",
                                   requests=99, cost=Decimal(9))  # last month: not counted  # fmt: skip
        html = world.client("member").get(url("portal-keys", world.org)).content.decode()
        row = re.search(rf'<tr id="key-{world.key.pk}">(.*?)</tr>', html, re.S)
        assert row
        cells = dict(re.findall(r'<td class="num" data-col="(\w+)"[^>]*>([^<]*)</td>', row.group(1)))
        assert cells == {"requests": "1,500", "spend": "$3.50"}

    def test_a_keys_limits_are_the_ones_it_is_held_to_spend_cap_included(self, world):
        """Issue 40: a key with no cap of its own is held to its organisation's (its budget alerts are
        raised against it); the summary shows that cap, as configured, and whose it is."""
        Organization.objects.filter(pk=world.org.pk).update(monthly_spend_cap=Decimal("0.0002"))
        world.org.refresh_from_db()
        own = api_key_create(organization=world.org, name="own cap", monthly_spend_cap=Decimal("0.0001")).api_key
        assert world.key.monthly_spend_cap is None
        assert KeyGrant.of(ApiKey.objects.select_related("organization").get(pk=world.key.pk)).key_limits.spend_cap == (
            Decimal("0.0002")
        )  # what the limiter holds the key to
        html = world.client("member").get(url("portal-keys", world.org)).content.decode()
        held = re.search(rf'<tr id="key-{world.key.pk}">(.*?)</tr>', html, re.S)
        mine = re.search(rf'<tr id="key-{own.pk}">(.*?)</tr>', html, re.S)
        assert held
        assert mine
        assert '$0.0002/month <span class="muted">(the organisation\'s)</span>' in held.group(1)
        assert "$0.0001/month · " in mine.group(1)  # its own, lower: no mark
        assert "&lt; $" not in html

    def test_a_plan_ceiling_below_a_keys_own_limit_is_shown_as_the_plans(self, world):
        Plan.objects.update_or_create(
            tier=Tier.PAID, defaults={"name": "Paid", "rate_limit_rpm": 50, "monthly_spend_cap": Decimal("7.5")}
        )
        ApiKey.objects.filter(pk=world.key.pk).update(rate_limit_rpm=500)
        html = world.client("member").get(url("portal-keys", world.org)).content.decode()
        row = re.search(rf'<tr id="key-{world.key.pk}">(.*?)</tr>', html, re.S)
        assert row
        plan = Plan.objects.get(tier=Tier.PAID)
        assert row.group(1).count("(the plan's)") == 2 + (plan.max_concurrent is not None)  # the seeded plan's too
        assert '50 requests/min <span class="muted">(the plan\'s)</span>' in row.group(1)
        assert '$7.50/month <span class="muted">(the plan\'s)</span>' in row.group(1)

    def test_creating_a_key_shows_its_secret_once(self, world):
        client = world.client("admin")
        response = client.post(url("portal-key-create", world.org), {"name": "ci", "rate_limit_rpm": "30"})
        assert response.status_code == 200
        assert "no-store" in response["Cache-Control"]
        html = response.content.decode()
        secret = secret_in(html)
        assert "API key &#x27;ci&#x27; created." in html or "API key 'ci' created." in html
        created = ApiKey.objects.get(key_hash=api_key_hash(secret))
        assert (created.organization_id, created.name, created.rate_limit_rpm) == (world.org.pk, "ci", 30)
        # Never again: not on the list, not on a second visit, not in the session.
        for page in (
            url("portal-keys", world.org),
            url("portal-usage", world.org),
            url("portal-key-create", world.org),
        ):
            assert secret not in client.get(page).content.decode()
        assert secret not in str(dict(client.session.items()))
        assert created.masked in client.get(url("portal-keys", world.org)).content.decode()

    def test_a_keys_drawer_shows_its_dates_and_limits_and_admins_edit_it_within_the_plan(self, world):
        """Issue 40, item 10: the table keeps one line per key; the dates, limits and the edit
        form are in the key's drawer (as the console has)."""
        key = world.key
        html = world.client("member").get(url("portal-keys", world.org)).content.decode()
        drawer = html.split(f'id="drawer-key-{key.pk}"', 1)[1].split("</dialog>", 1)[0]
        assert "Created (UTC)" in drawer
        assert "data-key-facts" in drawer
        assert "/edit/" not in drawer  # members read, never edit
        admin = world.client("admin")
        drawer = admin.get(url("portal-keys", world.org)).content.decode().split(f'id="drawer-key-{key.pk}"', 1)[1]
        assert f'action="{url("portal-key-edit", world.org, key_id=key.pk)}"' in drawer.split("</dialog>", 1)[0]

        prefix = f"key-{key.pk}-"
        fields = {f"{prefix}name": "production-eu", f"{prefix}rate_limit_rpm": "45", f"{prefix}rate_limit_tpm": "9000"}
        response = admin.post(url("portal-key-edit", world.org, key_id=key.pk), fields, follow=True)
        assert response.redirect_chain == [(url("portal-keys", world.org), 302)]
        key.refresh_from_db()
        assert (key.name, key.rate_limit_rpm, key.rate_limit_tpm) == ("production-eu", 45, 9000)

        # Beyond the plan: refused on its field, the drawer open again, nothing saved.
        Plan.objects.update_or_create(tier=Tier.PAID, defaults={"name": "Paid", "rate_limit_rpm": 100})
        refused = admin.post(
            url("portal-key-edit", world.org, key_id=key.pk), {**fields, f"{prefix}rate_limit_rpm": "500"}
        )
        assert refused.status_code == 400
        drawer = refused.content.decode().split(f'id="drawer-key-{key.pk}"', 1)[1].split("</dialog>", 1)[0]
        assert "data-open-on-load" in drawer.split(">", 1)[0]
        assert "100" in drawer
        key.refresh_from_db()
        assert key.rate_limit_rpm == 45
        # Members cannot; another organisation's key is not found.
        assert world.client("member").post(url("portal-key-edit", world.org, key_id=key.pk), fields).status_code == 403
        other = url("portal-key-edit", world.org, key_id=world.other_key.pk)
        assert admin.post(other, fields).status_code == 404

    def test_an_empty_name_is_a_field_error(self, world):
        response = world.client("admin").post(url("portal-key-create", world.org), {"name": "  "})
        assert response.status_code == 200
        assert "This field is required." in response.content.decode()
        assert 'id="id_name-errors"' in response.content.decode()
        assert ApiKey.objects.filter(organization=world.org).count() == 1

    def test_a_limit_above_the_plan_is_a_field_error(self, world):
        Plan.objects.update_or_create(tier=Tier.PAID, defaults={"name": "Paid", "rate_limit_rpm": 100})
        page = world.client("admin").get(url("portal-key-create", world.org)).content.decode()
        assert "your plan allows at most 100" in page
        response = world.client("admin").post(
            url("portal-key-create", world.org), {"name": "big", "rate_limit_rpm": 500}
        )
        html = response.content.decode()
        assert response.status_code == 200
        assert "must be at most 100 under this organisation" in html
        assert 'id="id_rate_limit_rpm-errors"' in html
        assert not ApiKey.objects.filter(name="big").exists()

    def test_a_platform_admin_is_not_held_to_the_plan(self, world):
        Plan.objects.update_or_create(tier=Tier.PAID, defaults={"name": "Paid", "rate_limit_rpm": 100})
        response = world.client("platform_admin").post(
            url("portal-key-create", world.org), {"name": "big", "rate_limit_rpm": 500}
        )
        assert ApiKey.objects.get(key_hash=api_key_hash(secret_in(response.content.decode()))).rate_limit_rpm == 500

    def test_a_negative_limit_is_a_field_error(self, world):
        response = world.client("admin").post(url("portal-key-create", world.org), {"name": "x", "rate_limit_tpm": -5})
        assert "greater than or equal to 1" in response.content.decode()
        assert not ApiKey.objects.filter(name="x").exists()

    def test_revoking_asks_first_then_revokes(self, world):
        client = world.client("admin")
        revoke = url("portal-key-revoke", world.org, key_id=world.key.pk)
        confirm = client.get(revoke)
        assert confirm.status_code == 200
        assert "Revoke key" in confirm.content.decode()
        world.key.refresh_from_db()
        assert world.key.is_active  # a GET changes nothing
        response = client.post(revoke, follow=True)
        assert response.redirect_chain == [(url("portal-keys", world.org), 302)]
        assert "revoked." in response.content.decode()
        world.key.refresh_from_db()
        assert not world.key.is_active
        assert world.key.revoked_at is not None

    def test_rotating_shows_the_new_secret_once_and_keeps_the_old_key_for_the_grace(self, world):
        client = world.client("admin")
        rotate = url("portal-key-rotate", world.org, key_id=world.key.pk)
        assert "The old key stops working" in client.get(rotate).content.decode()
        before = timezone.now()
        response = client.post(rotate, {"grace_seconds": "3600"})
        assert response.status_code == 200
        assert "no-store" in response["Cache-Control"]
        new = ApiKey.objects.get(key_hash=api_key_hash(secret_in(response.content.decode())))
        world.key.refresh_from_db()
        assert world.key.rotated_to_id == new.pk
        assert new.name == "production"
        assert before + timedelta(minutes=59) < world.key.expires_at < timezone.now() + timedelta(minutes=61)
        # A second rotation of the old key is refused with a message, not an error page.
        again = client.post(rotate, {"grace_seconds": "0"}, follow=True)
        assert "cannot be rotated" in again.content.decode()
        assert ApiKey.objects.filter(organization=world.org).count() == 2

    def test_a_grace_not_offered_is_a_field_error(self, world):
        response = world.client("admin").post(
            url("portal-key-rotate", world.org, key_id=world.key.pk), {"grace_seconds": "-1"}
        )
        assert response.status_code == 200
        assert "Select a valid choice" in response.content.decode()
        world.key.refresh_from_db()
        assert world.key.rotated_to_id is None

    def test_the_list_filters_and_paginates(self, world):
        for n in range(30):
            api_key_create(organization=world.org, name=f"batch-{n:02d}")
        revoked = api_key_create(organization=world.org, name="old").api_key
        ApiKey.objects.filter(pk=revoked.pk).update(is_active=False)
        client = world.client("member")
        first = client.get(url("portal-keys", world.org)).content.decode()
        assert first.count('<tr id="key-') == 25
        assert "Page 1 of 2" in first
        second = client.get(url("portal-keys", world.org) + "?page=2").content.decode()
        assert second.count('<tr id="key-') == 7
        only_revoked = client.get(url("portal-keys", world.org) + "?state=revoked").content.decode()
        assert only_revoked.count('<tr id="key-') == 1
        assert "old" in only_revoked
        by_name = client.get(url("portal-keys", world.org) + "?q=batch-0").content.decode()
        assert by_name.count('<tr id="key-') == 10


class TestUsage:
    @pytest.fixture
    def usage(self, world: World) -> dict[str, Any]:
        today = timezone.now()
        second = api_key_create(organization=world.org, name="staging").api_key
        rollup(world.key, today, "chat-a", requests=3, cost="0.000120000001", tokens=(30, 60, 5))
        rollup(second, today, "chat-a", requests=2, cost="0.00008", tokens=(20, 40, 0))
        rollup(world.key, today - timedelta(days=2), "embed-b", requests=7, cost="0.0000014", tokens=(70, 0, 0))
        rollup(world.key, today - timedelta(days=40), "chat-a", requests=100, cost="1.5", tokens=(1, 1, 1))
        rollup(world.other_key, today, "chat-a", requests=999, cost="9", tokens=(9, 9, 9))  # another tenant
        return {"today": today.astimezone(UTC).date(), "second": second}

    def test_the_window_downloads_as_csv_per_day_model_and_key(self, world, usage):
        response = world.client("member").get(url("portal-usage-csv", world.org), {"range": "7"})
        assert response.status_code == 200
        assert response["Content-Type"] == "text/csv"
        assert "attachment" in response["Content-Disposition"]
        lines = response.content.decode().splitlines()
        assert lines[0] == ("date,model,api_key,api_key_name,requests,errors,cancelled,input_tokens,output_tokens,"
                            "cached_tokens,cost,currency")  # fmt: skip
        rows = sorted((tuple(line.split(",")) for line in lines[1:]), key=lambda r: (r[0], r[1], r[3]))
        today, two_days_ago = str(usage["today"]), str(usage["today"] - timedelta(days=2))
        assert [(r[0], r[1], r[3], r[4], r[10]) for r in rows] == [
            (two_days_ago, "embed-b", "production", "7", "0.0000014"),
            (today, "chat-a", "production", "3", "0.000120000001"),
            (today, "chat-a", "staging", "2", "0.00008"),
        ]  # the other organisation's 999 requests and the 40-day-old row are not in it
        assert world.client("outsider").get(url("portal-usage-csv", world.org)).status_code == 404
        page = world.client("member").get(url("portal-usage", world.org), {"range": "7"}).content.decode()
        assert 'id="usage-csv"' in page
        assert page.index('id="budget"') < page.index('id="total-requests"')  # the month's budget first

    def test_totals_and_charts_match_the_rollups(self, world, usage):
        response = world.client("member").get(url("portal-usage", world.org), {"range": "7"})
        assert response.status_code == 200
        totals = response.context["totals"]
        assert (totals.requests, totals.input_tokens, totals.output_tokens, totals.cached_tokens) == (12, 120, 100, 5)
        assert totals.cost == Decimal("0.000201400001")
        figures = response.context["figures"]
        today, two_days_ago = str(usage["today"]), str(usage["today"] - timedelta(days=2))
        cost = {trace["name"]: dict(zip(trace["x"], trace["y"], strict=True)) for trace in figures["cost"]["data"]}
        assert set(cost) == {"chat-a", "embed-b"}
        assert len(cost["chat-a"]) == 7  # every day of the window is on the axis
        assert cost["chat-a"][today] == pytest.approx(0.000200000001)
        assert cost["embed-b"][two_days_ago] == pytest.approx(0.0000014)
        requests = {t["name"]: dict(zip(t["x"], t["y"], strict=True)) for t in figures["requests"]["data"]}
        assert requests["chat-a"][today] == 5
        assert requests["embed-b"][two_days_ago] == 7
        tokens = {t["name"]: dict(zip(t["x"], t["y"], strict=True)) for t in figures["tokens"]["data"]}
        assert tokens["Input"] == {"chat-a": 50, "embed-b": 70}
        assert tokens["Output"]["chat-a"] == 100
        html = response.content.decode()
        assert 'id="figure-cost"' in html
        assert "plotly/plotly.min.js" in html

    def test_the_page_agrees_with_the_usage_api(self, world, usage):
        client = world.client("member")
        start = usage["today"] - timedelta(days=29)
        api = client.get(f"/api/orgs/{world.org.pk}/usage/", {"start_date": str(start), "limit": 100}).json()
        page = client.get(url("portal-usage", world.org), {"range": "30"}).context["totals"]
        assert page.requests == sum(row["requests"] for row in api["data"])
        assert page.cost == sum(Decimal(row["cost"]) for row in api["data"])

    def test_a_window_and_one_key(self, world, usage):
        client = world.client("admin")
        old = usage["today"] - timedelta(days=40)
        wide = client.get(url("portal-usage", world.org), {"start": str(old), "end": str(usage["today"])})
        assert wide.context["totals"].requests == 112
        one_key = client.get(url("portal-usage", world.org), {"range": "7", "api_key": usage["second"].pk})
        assert (one_key.context["totals"].requests, one_key.context["totals"].cost) == (2, Decimal("0.00008"))

    def test_a_window_ending_before_it_starts_is_a_field_error(self, world, usage):
        today = usage["today"]
        response = world.client("member").get(
            url("portal-usage", world.org), {"start": str(today), "end": str(today - timedelta(days=3))}
        )
        assert response.status_code == 200
        assert f"The last day ({today - timedelta(days=3)}) is before the first ({today})." in response.content.decode()
        assert response.context["start"] == today - timedelta(days=29)  # the default window meanwhile

    def test_a_key_of_another_organisation_is_not_a_choice(self, world, usage):
        response = world.client("admin").get(url("portal-usage", world.org), {"api_key": world.other_key.pk})
        assert "Select a valid choice" in response.content.decode()
        assert response.context["totals"].requests == 12 + 0  # the default window: this org only

    def test_the_budget_shows_the_month_so_far_and_its_alerts(self, world, usage):
        Organization.objects.filter(pk=world.org.pk).update(monthly_spend_cap=Decimal("0.0004"))
        month = invoicing.period_label(invoicing.month_start(usage["today"]))
        BudgetAlert.objects.create(
            organization=world.org, budget=BudgetAlert.Budget.SPEND, month=month, threshold_percent=50,
            limit=Decimal("0.0004"), used=Decimal("0.0002"), notified_at=timezone.now(),
        )  # fmt: skip
        BudgetAlert.objects.create(
            organization=world.other_org, budget=BudgetAlert.Budget.SPEND, month=month, threshold_percent=80,
            limit=Decimal(1), used=Decimal(1),
        )  # fmt: skip
        response = world.client("member").get(url("portal-usage", world.org))
        budget = response.context["budget"]
        spend = budget.lines[0]
        first = invoicing.month_start(usage["today"])
        in_month = Decimal("0.000200000001") + (
            Decimal("0.0000014") if usage["today"] - timedelta(days=2) >= first else Decimal(0)
        )
        assert (spend.limit, spend.used) == (Decimal("0.0004"), in_month)
        assert spend.percent == int(in_month * 100 / Decimal("0.0004"))
        assert [a.threshold_percent for a in budget.alerts] == [50]
        html = response.content.decode()
        assert 'id="budget-alerts"' in html
        assert "no limit" in html
        # Issue 40: the cap as configured and the spend with its digits, never "< $0.01 of < $0.01".
        budget = html[html.index('id="budget"') : html.index("Alerts this month")]
        assert '<td class="num">$0.0004</td>' in budget
        assert f'<td class="num">{formats.money(in_month)}</td>' in budget
        assert "&lt; $" not in html

    def test_the_alerts_table_reads_spend_as_money_and_a_quota_in_tokens(self, world):
        month = invoicing.period_label(invoicing.month_start(timezone.now().date()))
        BudgetAlert.objects.create(
            organization=world.org, budget=BudgetAlert.Budget.SPEND, month=month, threshold_percent=80,
            limit=Decimal("0.0002"), used=Decimal("0.000194"),
        )  # fmt: skip
        BudgetAlert.objects.create(
            organization=world.org, api_key=world.key, budget=BudgetAlert.Budget.TOKENS, month=month,
            threshold_percent=50, limit=Decimal(1_000_000), used=Decimal(512_345),
        )  # fmt: skip
        html = world.client("member").get(url("portal-usage", world.org)).content.decode()
        table = html[html.index('id="budget-alerts"') : html.index("</table>", html.index('id="budget-alerts"'))]
        tokens, spend = table.split("<tbody>")[1].split("</tr>")[:2]  # newest first
        assert "Spend cap" in spend
        assert '<td class="num">$0.00019</td>' in spend  # not "0.0002" without a sign
        assert '<td class="num">$0.0002</td>' in spend  # the cap as configured
        assert "Token quota" in tokens
        assert '<td class="num" title="512,345 tokens">512k tokens</td>' in tokens
        assert '<td class="num" title="1,000,000 tokens">1M tokens</td>' in tokens

    @pytest.mark.parametrize(
        ("own", "sentence"),
        [(80, "at 50, 80 and 100 % of a budget"), (90, "at 50, 80, 90 and 100 % of a budget"),
         (25, "at 25, 50, 80 and 100 % of a budget")],
    )  # fmt: skip
    def test_the_alert_thresholds_are_said_once_each(self, world, own, sentence):
        """Issue 40: "at 50, 80 and 100 % and at 80 %" (the organisation's own is one of the fixed)."""
        Organization.objects.filter(pk=world.org.pk).update(budget_alert_percent=own)
        html = world.client("member").get(url("portal-usage", world.org)).content.decode()
        assert f"Alerts are emailed to the billing address {sentence}." in html

    def test_no_usage_says_so(self, world):
        html = world.client("member").get(url("portal-usage", world.org)).content.decode()
        assert 'id="no-usage"' in html


class TestCacheFigures:
    def test_the_cache_section_shows_this_orgs_hits_savings_and_reports_and_the_models_estimate(self, world):
        import uuid

        from serving.models import CacheFeedback
        from serving.semcache import budget

        model = f"portal-cache-{uuid.uuid4().hex[:6]}"
        start = datetime.combine(timezone.now().date(), time.min, UTC)
        for key, hits, saved in ((world.key, 4, "0.0125"), (world.other_key, 50, "9")):
            UsageRollup.objects.create(
                period=UsageRollup.Period.DAY, start=start, organization_id=key.organization_id, api_key=key,
                model=model, model_version="1", requests=10, cache_hits=hits, saved=Decimal(saved), cost=Decimal(0),
            )  # fmt: skip
        for org, request in ((world.org, "a" * 32), (world.other_org, "b" * 32)):
            CacheFeedback.objects.create(request_id=request, organization=org, model=model, model_version="1",
                                         wording="typo", reported_by="key")  # fmt: skip
        budget.count_sync(model, "same", "served", 54)
        try:
            html = world.client("member").get(url("portal-usage", world.org)).content.decode()
        finally:
            budget.reset(model)
        row = re.search(rf'<tr data-model="{model}">(.*?)</tr>', html, re.S)
        assert row, html
        assert "prior of" not in html  # the estimate's internals stay in the console (issue 40, item 8)
        cells = dict(re.findall(r'data-col="([a-z]+)"[^>]*>(.*?)</td>', row.group(1), re.S))
        assert (cells["hits"], cells["feedback"], cells["semantic"]) == ("4", "1", "54")  # its own hits and reports
        assert "0.0125" in cells["saved"] or "0.01" in cells["saved"]
        assert "%" in cells["estimate"]

    def test_the_cache_section_shows_the_orgs_share_per_tier_and_the_models_estimate_against_its_bound(
        self, world, settings
    ):
        """Issue 39: per tier the organisation's own hits and their share of its requests; the model's
        audits, observed wrong rate and estimate; δ, and the organisation's stricter own bound."""
        settings.SEMANTIC_CACHE_PARAPHRASES = True  # off by default
        settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_SERVED, settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_WRONG = 600, 1
        import uuid

        from billing.models import UsageRecord
        from core.stats import wilson
        from serving.semcache import budget

        model = f"portal-tiers-{uuid.uuid4().hex[:6]}"
        at = timezone.now() - timedelta(minutes=1)
        for key, misses, paraphrases in ((world.key, 8, 2), (world.other_key, 2, 8)):
            UsageRecord.objects.bulk_create(
                UsageRecord(api_key=key, organization_id=key.organization_id, model=model, model_version="1",
                            status_code=200, created_at=at, cache=cache, cache_tier=tier)
                for cache, tier, n in (("miss", "", misses), ("semantic-hit", "paraphrase", paraphrases))
                for _ in range(n)
            )  # fmt: skip
        Organization.objects.filter(pk=world.org.pk).update(cache_wrong_hit_budget=Decimal("0.5"))
        budget.count_sync(model, budget.PARAPHRASE, "audits", 40)
        try:
            html = world.client("member").get(url("portal-usage", world.org)).content.decode()
        finally:
            budget.reset(model)
        assert re.search(rf'<tr data-model="{model}">.*?data-col="budget">1.00 %</td>', html, re.S)  # the model's δ
        tiers = re.search(rf'data-tiers-of="{model}">(.*?)</details>', html, re.S)
        assert tiers, html
        assert "your requests: δ 0.50 %" in tiers.group(1)
        row = re.search(r'<tr data-tier="paraphrase">(.*?)</tr>', tiers.group(1), re.S)
        assert row
        cells = dict(re.findall(r'data-col="([a-z]+)"[^>]*>(.*?)</td>', row.group(1), re.S))
        assert (cells["hits"], cells["share"], cells["audits"]) == ("2", "20.0 %", "40 (0)")  # its own 2 of 10
        assert cells["observed"] == f"0.00 % [0.00 % to {wilson(0, 40)[1] * 100:.2f} %]"
        low, high = wilson(1, 600 + 40)  # with the prior: 1 wrong of 600 judged offline
        assert 0.005 < high <= 0.01  # inside the model's δ, outside the organisation's own
        assert cells["estimate"] == f"0.16 % [{low * 100:.2f} % to {high * 100:.2f} %]"
        assert "closed: outside δ" in cells["state"]

    def test_org_admins_set_the_orgs_wrong_hit_budget(self, world):
        budget_url = url("portal-cache-budget", world.org)
        assert "cache-budget-form" in world.client("admin").get(url("portal-usage", world.org)).content.decode()
        assert "cache-budget-form" not in world.client("member").get(url("portal-usage", world.org)).content.decode()
        assert world.client("member").post(budget_url, {"cache_wrong_hit_budget": "0.5"}).status_code == 403
        response = world.client("admin").post(budget_url, {"cache_wrong_hit_budget": "0.5"})
        assert response.status_code == 302
        world.org.refresh_from_db()
        assert world.org.cache_wrong_hit_budget == Decimal("0.50")
        world.client("admin").post(budget_url, {"cache_wrong_hit_budget": "150"})
        world.org.refresh_from_db()
        assert world.org.cache_wrong_hit_budget == Decimal("0.50")  # refused
        world.client("admin").post(budget_url, {"cache_wrong_hit_budget": ""})
        world.org.refresh_from_db()
        assert world.org.cache_wrong_hit_budget is None


class TestInvoices:
    @pytest.fixture
    def invoice(self, world: World) -> Invoice:
        draft = invoice_draft(
            organization=world.org, period=invoicing.previous_month(invoicing.month_start(timezone.now()))
        )
        return invoice_finalize(invoice=draft)

    def test_the_list_shows_number_period_state_and_total(self, world, invoice):
        html = world.client("admin").get(url("portal-invoices", world.org)).content.decode()
        assert invoicing.display_number(invoice) in html
        assert f"{invoice.period:%Y-%m}" in html
        assert "Finalized" in html
        assert formats.money(invoice.total, invoice.currency) in html

    def test_the_list_says_who_is_billed_when_it_is_due_and_links_the_upcoming_one(self, world, invoice, settings):
        """Issue 40, item 10: period, due date, bill-to, payment status (Stripe's list)."""
        settings.INVOICE_DUE_DAYS = 30
        due = (invoice.finalized_at.astimezone(UTC) + timedelta(days=30)).date()
        client = world.client("admin")
        html = client.get(url("portal-invoices", world.org)).content.decode()
        assert f'<span class="status status-due">Due {due.isoformat()}</span>' in html
        assert "Alice Corp" in html.split('id="invoices"')[1]  # billed to, as frozen at finalizing
        assert f"{url('portal-usage', world.org)}#month-preview" in html
        detail = client.get(url("portal-invoice", world.org, invoice_id=invoice.pk)).content.decode()
        assert f'data-field="due">{due.isoformat()}<' in detail
        # Past its due day: overdue; once paid: paid.
        Invoice.objects.filter(pk=invoice.pk).update(finalized_at=invoice.finalized_at - timedelta(days=45))
        html = client.get(url("portal-invoices", world.org)).content.decode()
        assert '<span class="status status-overdue">Overdue since' in html
        invoice_mark_paid(invoice=Invoice.objects.get(pk=invoice.pk))
        html = client.get(url("portal-invoices", world.org)).content.decode()
        assert '<span class="status status-paid">Paid ' in html

    def test_the_list_filters_by_state(self, world, invoice):
        client = world.client("admin")
        assert (
            invoicing.display_number(invoice)
            not in client.get(url("portal-invoices", world.org), {"status": "paid"}).content.decode()
        )
        assert (
            invoicing.display_number(invoice)
            in client.get(url("portal-invoices", world.org), {"status": "finalized"}).content.decode()
        )

    def test_the_detail_shows_its_lines_and_totals(self, world, invoice):
        html = world.client("admin").get(url("portal-invoice", world.org, invoice_id=invoice.pk)).content.decode()
        assert 'id="invoice-lines"' in html
        assert f"<strong>{formats.money(invoice.total, invoice.currency)}</strong>" in html

    def test_the_detail_reads_the_tax_as_a_percentage_and_no_credit_without_a_sign(self, world, invoice):
        Invoice.objects.filter(pk=invoice.pk).update(tax_rate=Decimal("0.0750"), credit=Decimal("0.00"))
        html = world.client("admin").get(url("portal-invoice", world.org, invoice_id=invoice.pk)).content.decode()
        assert "Tax (7.5 %)" in html
        assert "-0.00" not in html

    @pytest.mark.parametrize(("rate", "text"), [("0.1000", "10"), ("0.0750", "7.5"), ("0", "0"), ("0.0001", "0.01")])
    def test_tax_percent(self, rate, text):
        assert Invoice(tax_rate=Decimal(rate)).tax_percent == text

    def test_the_pdf_downloads(self, world, invoice):
        response = world.client("admin").get(url("portal-invoice-pdf", world.org, invoice_id=invoice.pk))
        assert response.status_code == 200
        assert response["Content-Type"] == "application/pdf"
        assert response.content.startswith(b"%PDF")
        assert len(response.content) > 500
        assert f'filename="{invoicing.display_number(invoice)}-' in response["Content-Disposition"]

    def test_the_csv_downloads_with_the_invoices_total(self, world, invoice):
        response = world.client("admin").get(url("portal-invoice-csv", world.org, invoice_id=invoice.pk))
        assert response.status_code == 200
        assert response["Content-Type"].startswith("text/csv")
        rows = response.content.decode().splitlines()
        assert rows[0].startswith("invoice,period,kind")
        amount = rows[0].split(",").index("amount")
        assert rows[-1].split(",")[amount] == f"{invoice.total:f}"


def test_a_limit_of_one_reads_in_the_singular(world):
    """Issue 40's copy: "1 requests/min" read wrong."""
    from console.pages.key_limits import key_limits

    world.key.rate_limit_rpm, world.key.max_concurrent = 1, 1
    world.key.save(update_fields=["rate_limit_rpm", "max_concurrent"])
    texts = [t.text for t in key_limits([world.key], organization=world.org)[world.key.pk].texts]
    assert "1 request/min" in texts
    assert "1 at once" in texts
