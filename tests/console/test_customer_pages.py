"""The console's customer pages with Django's test client: only platform admins get in; each form
saves through its service or shows its errors; a key's secret is shown once; invoices move only
as their state allows; prices and reconciliation runs."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import ApiKey, Membership, Organization, Role, Tier
from accounts.services import api_key_create, api_key_hash, organization_create, organization_update
from billing import invoicing
from billing.models import Invoice, InvoiceLine, Price, Reconciliation, UsageRollup
from billing.services import invoice_draft, price_set
from core.errors import InvalidInput
from registry.models import AuditEntry, Model, ModelVersion

pytestmark = pytest.mark.django_db

PASSWORD = "pw-customers-123456"


@dataclass
class World:
    org: Organization
    other_org: Organization
    platform_admin: Any
    org_admin: Any
    member: Any
    newcomer: Any
    key: ApiKey

    def client(self, who: str | None = "platform_admin") -> Client:
        client = Client()
        if who is not None:
            client.force_login(getattr(self, who))
        return client


@pytest.fixture
def world() -> World:
    users = get_user_model().objects
    org = organization_create(name="Initech", billing_email="billing@initech.example")
    other_org = organization_create(name="Umbrella", tier=Tier.FREE)
    made = {
        "platform_admin": users.create_superuser(username="cust-root", password=PASSWORD),
        "org_admin": users.create_user(username="cust-admin", password=PASSWORD),
        "member": users.create_user(username="cust-member", password=PASSWORD),
        "newcomer": users.create_user(username="cust-newcomer", password=PASSWORD),
    }
    Membership.objects.create(user=made["org_admin"], organization=org, role=Role.ORG_ADMIN)
    Membership.objects.create(user=made["member"], organization=org, role=Role.ORG_MEMBER)
    key = api_key_create(organization=org, name="production").api_key
    return World(org=org, other_org=other_org, key=key, **made)


def last_month() -> str:
    return invoicing.period_label(invoicing.previous_month(invoicing.month_start(timezone.now())))


def text(response: Any) -> str:
    return html.unescape(response.content.decode())


def org_url(name: str, org: Organization, **kwargs: int) -> str:
    return reverse(f"console:{name}", kwargs={"org_id": org.pk, **kwargs})


def settings_data(**changes: Any) -> dict[str, Any]:
    data = {
        "name": "Initech", "tier": "paid", "billing_email": "ap@initech.example", "tax_percent": "20",
        "rate_limit_rpm": "600", "rate_limit_tpm": "", "max_concurrent": "", "monthly_token_quota": "5000000",
        "monthly_spend_cap": "250.50", "budget_alert_percent": "75",
    }  # fmt: skip
    data.update(changes)
    return data


def key_data(**changes: Any) -> dict[str, Any]:
    data = {
        "name": "batch jobs", "tier": "paid", "rate_limit_rpm": "120", "rate_limit_tpm": "50000",
        "max_concurrent": "4", "monthly_token_quota": "", "monthly_spend_cap": "12.5",
    }  # fmt: skip
    data.update(changes)
    return data


CONSOLE_PAGES = ("customers", "customer-create", "invoices", "prices", "reconciliation")
ORGANIZATION_PAGES = (
    "customer", "customer-settings", "customer-member-set", "customer-member-remove", "customer-key-create",
    "customer-invoices", "customer-invoice-draft",
)  # fmt: skip
KEY_PAGES = ("customer-key-edit", "customer-key-revoke", "customer-key-rotate")
INVOICE_PAGES = (
    "invoice", "invoice-refresh", "invoice-finalize", "invoice-pay", "invoice-void", "invoice-reissue",
    "invoice-pdf", "invoice-csv",
)  # fmt: skip


class TestWhoGetsIn:
    def pages(self, world: World, invoice: Invoice) -> list[str]:
        org, key = world.org, world.key
        return [
            *(reverse(f"console:{name}") for name in CONSOLE_PAGES),
            *(org_url(name, org) for name in ORGANIZATION_PAGES),
            *(org_url(name, org, key_id=key.pk) for name in KEY_PAGES),
            *(reverse(f"console:{name}", kwargs={"invoice_id": invoice.pk}) for name in INVOICE_PAGES),
        ]

    @pytest.fixture
    def invoice(self, world: World) -> Invoice:
        return invoice_draft(organization=world.org, period=invoicing.parse_period(last_month()))

    def test_anonymous_visitors_are_sent_to_log_in_even_on_a_post(self, world, invoice):
        client = world.client(None)
        for page in self.pages(world, invoice):
            for response in (client.get(page), client.post(page, {})):
                assert response.status_code == 302, page
                assert response["Location"].startswith("/accounts/login/?next="), page

    @pytest.mark.parametrize("who", ["org_admin", "member"])
    def test_organisation_people_get_403_everywhere(self, world, invoice, who):
        client = world.client(who)
        for page in self.pages(world, invoice):
            assert client.get(page).status_code == 403, page
            assert client.post(page, {"reason": "x", "member-username": "cust-member"}).status_code == 403, page
        invoice.refresh_from_db()
        assert invoice.status == Invoice.Status.DRAFT
        assert Membership.objects.filter(organization=world.org).count() == 2

    def test_platform_admins_open_every_page(self, world, invoice):
        client = world.client()
        for page in self.pages(world, invoice):
            assert client.get(page).status_code in {200, 302, 405}, page

    def test_the_side_navigation_lists_the_customer_pages_for_platform_admins_only(self, world):
        body = text(world.client().get(reverse("console:customers")))
        for label in ("Customers", "Invoices", "Prices", "Reconciliation"):
            assert f">{label}</a>" in body
        member_nav = text(world.client("member").get(org_url("portal-usage", world.org)))
        assert reverse("console:customers") not in member_nav


class TestOrganisations:
    def test_the_list_shows_members_keys_and_spend_and_filters(self, world):
        client = world.client()
        body = text(client.get(reverse("console:customers")))
        assert "Initech" in body
        assert "Umbrella" in body
        filtered = text(client.get(reverse("console:customers"), {"q": "init"}))
        assert "Initech" in filtered
        assert "Umbrella" not in filtered
        by_tier = text(client.get(reverse("console:customers"), {"tier": "free"}))
        assert "Umbrella" in by_tier
        assert "Initech" not in by_tier
        row = client.get(reverse("console:customers"), {"q": "Initech"}).context["rows"][0]
        assert (row["organization"].member_count, row["organization"].active_key_count) == (2, 1)
        assert row["spent"] == "$0.00"
        assert row["cap"] is None

    def test_the_list_paginates(self, world):
        for n in range(30):
            organization_create(name=f"Paged {n:02d}")
        page = world.client().get(reverse("console:customers")).context["page"]
        assert page.paginator.num_pages == 2
        assert len(page.object_list) == 25

    def test_creating_an_organisation(self, world):
        data = {f"new-{k}": v for k, v in settings_data(name="Hooli", tax_percent="7.5").items()}
        response = world.client().post(reverse("console:customer-create"), data, follow=True)
        hooli = Organization.objects.get(name="Hooli")
        assert response.redirect_chain[-1][0] == org_url("customer", hooli)
        assert "Organisation 'Hooli' created." in text(response)
        assert (hooli.billing_email, hooli.tax_rate, hooli.monthly_spend_cap) == (
            "ap@initech.example", Decimal("0.075"), Decimal("250.5")
        )  # fmt: skip
        assert (hooli.rate_limit_rpm, hooli.rate_limit_tpm, hooli.budget_alert_percent) == (600, None, 75)

    def test_a_taken_name_and_a_bad_email_are_shown_on_their_fields(self, world):
        data = {f"new-{k}": v for k, v in settings_data(name="initech", billing_email="not-an-email").items()}
        response = world.client().post(reverse("console:customer-create"), data)
        assert response.status_code == 200
        form = response.context["create_form"]
        assert "billing_email" in form.errors
        data["new-billing_email"] = "ok@example.com"
        response = world.client().post(reverse("console:customer-create"), data)
        assert response.context["create_form"].errors["name"] == ["another organisation already has this name"]
        assert "The organisation was not created" in text(response)
        assert Organization.objects.count() == 2


class TestOneOrganisation:
    def test_the_page_shows_plan_members_keys_budget_usage_and_portal_links(self, world):
        body = text(world.client().get(org_url("customer", world.org)))
        for part in ("Plan and billing", "cust-admin", "cust-member", "production", "Budget for", "Usage,",
                     org_url("portal-usage", world.org), org_url("customer-invoices", world.org)):  # fmt: skip
            assert part in body

    def test_saving_the_settings(self, world):
        response = world.client().post(org_url("customer-settings", world.org), settings_data(), follow=True)
        assert "Settings of 'Initech' saved" in text(response)
        world.org.refresh_from_db()
        assert (world.org.tax_rate, world.org.monthly_token_quota, world.org.billing_email) == (
            Decimal("0.2"), 5_000_000, "ap@initech.example"
        )  # fmt: skip

    def test_a_platform_admin_sets_the_batch_weight(self, world):
        """Issue 34's fair batch queue: an organisation's share of batch capacity."""
        world.client().post(org_url("customer-settings", world.org), settings_data(batch_weight="3"))
        world.org.refresh_from_db()
        assert world.org.batch_weight == 3
        world.client().post(org_url("customer-settings", world.org), settings_data())  # empty: unchanged
        world.org.refresh_from_db()
        assert world.org.batch_weight == 3
        response = world.client().post(org_url("customer-settings", world.org), settings_data(batch_weight="0"))
        assert "batch_weight" in response.context["settings_form"].errors

    def test_settings_errors_are_shown_and_nothing_changes(self, world):
        response = world.client().post(
            org_url("customer-settings", world.org), settings_data(tax_percent="120", name="Umbrella")
        )
        assert response.status_code == 200
        assert "tax_percent" in response.context["settings_form"].errors
        response = world.client().post(org_url("customer-settings", world.org), settings_data(name="Umbrella"))
        assert response.context["settings_form"].errors["name"] == ["another organisation already has this name"]
        world.org.refresh_from_db()
        assert world.org.name == "Initech"
        assert world.org.tax_rate == 0


class TestMembers:
    def test_adding_a_user_changing_a_role_and_removing_with_a_confirm_step(self, world):
        client, url = world.client(), org_url("customer-member-set", world.org)
        response = client.post(url, {"member-username": "cust-newcomer", "member-role": "org_admin"}, follow=True)
        assert "cust-newcomer is added as Org admin of Initech." in text(response)
        assert Membership.objects.get(user=world.newcomer, organization=world.org).role == Role.ORG_ADMIN

        response = client.post(url, {"member-username": "cust-member", "member-role": "org_admin"}, follow=True)
        assert "cust-member is now Org admin" in text(response)

        remove = org_url("customer-member-remove", world.org)
        confirm = client.get(remove, {"username": "cust-newcomer"})
        assert confirm.status_code == 200
        assert "Remove cust-newcomer from Initech?" in text(confirm)
        assert Membership.objects.filter(user=world.newcomer).exists()  # a GET removes nothing
        response = client.post(remove, {"username": "cust-newcomer"}, follow=True)
        assert "cust-newcomer removed from Initech." in text(response)
        assert not Membership.objects.filter(user=world.newcomer).exists()

    def test_an_unknown_username_is_a_field_error(self, world):
        response = world.client().post(
            org_url("customer-member-set", world.org), {"member-username": "nobody", "member-role": "org_member"}
        )
        assert response.status_code == 200
        assert response.context["member_form"].errors["username"] == ["No user has this username."]

    def test_removing_someone_who_is_not_a_member_says_so(self, world):
        response = world.client().post(
            org_url("customer-member-remove", world.org), {"username": "cust-newcomer"}, follow=True
        )
        assert "cust-newcomer is not a member of Initech." in text(response)


class TestKeys:
    def test_a_new_keys_secret_is_shown_once_and_never_stored(self, world):
        client = world.client()
        response = client.post(org_url("customer-key-create", world.org), key_data())
        assert response.status_code == 200
        assert "no-store" in response["Cache-Control"]
        secret = response.context["issued"].secret
        assert secret.startswith("sk-")
        assert secret in response.content.decode()
        key = ApiKey.objects.get(name="batch jobs")
        assert key.key_hash == api_key_hash(secret)
        assert (key.rate_limit_rpm, key.max_concurrent, key.monthly_spend_cap, key.monthly_token_quota) == (
            120, 4, Decimal("12.5"), None
        )  # fmt: skip
        for page in (org_url("customer", world.org), org_url("customer-key-edit", world.org, key_id=key.pk)):
            assert secret not in client.get(page).content.decode()
        assert secret not in str(dict(client.session))

    def test_a_key_without_a_cap_shows_the_organisations_it_is_held_to(self, world):
        """Issue 40: its budget alerts are raised against the organisation's cap, so its limits say so."""
        organization_update(organization=world.org, monthly_spend_cap=Decimal("0.0002"))
        response = world.client().post(org_url("customer-key-create", world.org), key_data(monthly_spend_cap=""))
        secret_page = text(response)
        assert "$0.0002/month (the organisation's)" in re.sub(r"<[^>]+>", "", secret_page)
        body = text(world.client().get(org_url("customer", world.org)))
        keys = body[body.index('id="key-list"') : body.index("</table>", body.index('id="key-list"'))]
        assert keys.count("$0.0002/month") == 2  # the new key and "production": neither has a cap of its own
        # The organisations list: the cap as configured, never "< $0.01".
        row = world.client().get(reverse("console:customers"), {"q": "Initech"}).context["rows"][0]
        assert row["cap"] == "$0.0002"

    def test_key_form_errors(self, world):
        response = world.client().post(org_url("customer-key-create", world.org), key_data(rate_limit_rpm="", name=""))
        assert response.status_code == 200
        assert set(response.context["form"].errors) == {"rate_limit_rpm", "name"}
        assert "secret" not in response.context
        assert ApiKey.objects.filter(organization=world.org).count() == 1

    def test_editing_a_keys_limits(self, world):
        url = org_url("customer-key-edit", world.org, key_id=world.key.pk)
        response = world.client().post(url, key_data(name="production", rate_limit_rpm="900"), follow=True)
        assert "API key 'production' saved" in text(response)
        world.key.refresh_from_db()
        assert (world.key.rate_limit_rpm, world.key.tier, world.key.max_concurrent) == (900, "paid", 4)

    def test_revoking_asks_first(self, world):
        url, client = org_url("customer-key-revoke", world.org, key_id=world.key.pk), world.client()
        assert "Revoke API key" in text(client.get(url))
        world.key.refresh_from_db()
        assert world.key.is_active
        assert "revoked." in text(client.post(url, follow=True))
        world.key.refresh_from_db()
        assert not world.key.is_active

    def test_rotating_shows_the_new_secret_once(self, world):
        url = org_url("customer-key-rotate", world.org, key_id=world.key.pk)
        response = world.client().post(url, {"grace_seconds": "3600"})
        assert response.status_code == 200
        assert "no-store" in response["Cache-Control"]
        new = response.context["issued"]
        assert new.api_key.key_hash == api_key_hash(new.secret)
        world.key.refresh_from_db()
        assert world.key.rotated_to_id == new.api_key.pk
        again = world.client().post(url, {"grace_seconds": "0"}, follow=True)
        assert "cannot be rotated: this key was already rotated" in text(again)

    def test_a_key_of_another_organisation_is_404(self, world):
        other = api_key_create(organization=world.other_org, name="theirs").api_key
        assert world.client().get(org_url("customer-key-edit", world.org, key_id=other.pk)).status_code == 404


class TestInvoices:
    @pytest.fixture
    def draft(self, world: World) -> Invoice:
        response = world.client().post(
            org_url("customer-invoice-draft", world.org), {"draft-period": last_month()}, follow=True
        )
        invoice = Invoice.objects.get(organization=world.org)
        assert response.redirect_chain[-1][0] == reverse("console:invoice", kwargs={"invoice_id": invoice.pk})
        assert f"Invoice {invoicing.display_number(invoice)} for {last_month()} drafted" in text(response)
        return invoice

    def move(self, world: World, invoice: Invoice, name: str, data: dict[str, str] | None = None) -> str:
        url = reverse(f"console:{name}", kwargs={"invoice_id": invoice.pk})
        return text(world.client().post(url, data or {}, follow=True))

    def test_lines_say_what_they_count_and_what_had_no_price(self, world):
        """The invoice page (console and portal, one template, console.pages.invoice_lines): tokens
        per 1M, inferences per 1k, usage with no price "unpriced" and "not charged" (never $0.00),
        late usage named, the plan's credit once, with the totals."""
        invoice = invoice_draft(organization=world.org, period=invoicing.parse_period(last_month()))
        model = Model.objects.create(name="lines-llm", task="chat")
        version = ModelVersion.objects.create(
            model=model, version="v1", framework="vllm", artifact_uri="local://lines", artifact_sha256="0" * 64,
            artifact_size=1,
        )  # fmt: skip
        price = price_set(model=model, input_per_million="2.50", output_per_million="10")
        line = InvoiceLine.objects.create
        line(invoice=invoice, model="lines-llm", token_kind="input", price=price, quantity=1_234_567,
             unit_price=Decimal("2.50"), amount=Decimal("3.086418"), description="lines-llm input")  # fmt: skip
        line(invoice=invoice, model="digits", token_kind="inferences", price=price, quantity=4000,
             unit_price=Decimal("0.2"), amount=Decimal("0.8"), description="digits inferences")  # fmt: skip
        line(invoice=invoice, model="new-llm", token_kind="output", price=None, quantity=999,
             unit_price=Decimal("0"), amount=Decimal("0"), description="new-llm output")  # fmt: skip
        line(invoice=invoice, kind="adjustment", model="lines-llm", token_kind="output", price=price, quantity=10,
             unit_price=Decimal("10"), amount=Decimal("0.0001"), usage_period=date(2026, 9, 1),
             description="late")  # fmt: skip
        line(invoice=invoice, kind="credit", amount=Decimal("-1"), description="Free tier credit")
        assert version.pk
        for page, client in (
            (reverse("console:invoice", kwargs={"invoice_id": invoice.pk}), world.client()),
            (reverse("console:portal-invoice", kwargs={"org_id": world.org.pk, "invoice_id": invoice.pk}),
             world.client("org_admin")),
        ):  # fmt: skip
            body = text(client.get(page))
            table = body[body.index('id="invoice-lines"') : body.index("</table>", body.index('id="invoice-lines"'))]
            rows = table.split("<tbody>")[1].split("</tbody>")[0].split("</tr>")[:-1]
            assert len(rows) == 4, page  # the credit is not a usage row
            assert all(shown in rows[0] for shown in ("1,234,567", "$2.50", "per 1M tokens"))
            assert all(shown in rows[1] for shown in ("4,000", "inferences", "per 1k inferences"))
            assert all(shown in rows[2] for shown in ('class="unpriced"', "unpriced", "not charged"))
            assert "$0.00" not in rows[2]
            assert "late usage of 2026-09" in rows[3]
            assert table.count("Free tier credit") == (1 if invoice.credit else 0)

    def test_draft_refresh_finalize_and_pay(self, world, draft):
        number = invoicing.display_number(draft)
        assert f"Invoice {number} refreshed" in self.move(world, draft, "invoice-refresh")
        assert f"Invoice {number} finalized" in self.move(world, draft, "invoice-finalize")
        draft.refresh_from_db()
        assert draft.status == Invoice.Status.FINALIZED
        assert f"Invoice {number} marked paid" in self.move(world, draft, "invoice-pay")
        draft.refresh_from_db()
        assert draft.status == Invoice.Status.PAID

    def test_an_illegal_move_is_refused_with_a_message(self, world, draft):
        number = invoicing.display_number(draft)
        assert f"Invoice {number} is draft: it cannot become paid." in self.move(world, draft, "invoice-pay")
        self.move(world, draft, "invoice-finalize")
        body = self.move(world, draft, "invoice-refresh")
        assert f"invoice {number} is finalized: only a draft changes" in body
        self.move(world, draft, "invoice-pay")
        assert f"Invoice {number} is paid: it cannot become void." in self.move(
            world, draft, "invoice-void", {"reason": "typo"}
        )
        draft.refresh_from_db()
        assert draft.status == Invoice.Status.PAID

    def test_a_month_not_over_cannot_be_finalized(self, world):
        current = invoice_draft(organization=world.org, period=timezone.now().date())
        assert "has not ended yet" in self.move(world, current, "invoice-finalize")
        current.refresh_from_db()
        assert current.status == Invoice.Status.DRAFT

    def test_finalize_is_offered_only_once_the_month_has_ended(self, world, draft):
        """Issue 40, item 10: the button is not there to be refused."""
        current = invoice_draft(organization=world.org, period=timezone.now().date())
        page = text(world.client().get(reverse("console:invoice", kwargs={"invoice_id": current.pk})))
        assert reverse("console:invoice-finalize", kwargs={"invoice_id": current.pk}) not in page
        assert 'id="finalize-later"' in page
        ended = text(world.client().get(reverse("console:invoice", kwargs={"invoice_id": draft.pk})))
        assert reverse("console:invoice-finalize", kwargs={"invoice_id": draft.pk}) in ended
        assert "Draft, not sent yet" in ended

    def test_the_latest_draft_is_deleted_not_voided(self, world, draft):
        page = text(world.client().get(reverse("console:invoice", kwargs={"invoice_id": draft.pk})))
        delete = reverse("console:invoice-delete", kwargs={"invoice_id": draft.pk})
        assert delete in page
        assert reverse("console:invoice-void", kwargs={"invoice_id": draft.pk}) not in page
        response = world.client().post(delete, follow=True)
        assert f"Draft {invoicing.display_number(draft)} deleted" in text(response)
        assert not Invoice.objects.filter(pk=draft.pk).exists()

    def test_voiding_needs_a_reason(self, world, draft):
        url = reverse("console:invoice-void", kwargs={"invoice_id": draft.pk})
        assert "Void invoice" in text(world.client().get(url))
        response = world.client().post(url, {"reason": "  "})
        assert response.status_code == 200
        assert "reason" in response.context["form"].errors
        assert "void." in self.move(world, draft, "invoice-void", {"reason": "duplicate"})
        draft.refresh_from_db()
        assert (draft.status, draft.void_reason) == (Invoice.Status.VOID, "duplicate")

    def test_reissuing_voids_and_drafts_a_replacement(self, world, draft):
        self.move(world, draft, "invoice-finalize")
        url = reverse("console:invoice-reissue", kwargs={"invoice_id": draft.pk})
        response = world.client().post(url, {"reason": "wrong tax rate"}, follow=True)
        new = Invoice.objects.get(reissue_of=draft)
        assert response.redirect_chain[-1][0] == reverse("console:invoice", kwargs={"invoice_id": new.pk})
        assert f"its replacement {invoicing.display_number(new)} is a draft" in text(response)
        draft.refresh_from_db()
        assert (draft.status, new.status) == (Invoice.Status.VOID, Invoice.Status.DRAFT)

    def test_a_month_not_started_is_a_field_error(self, world):
        future = invoicing.period_label(invoicing.next_month(invoicing.month_start(timezone.now())))
        response = world.client().post(org_url("customer-invoice-draft", world.org), {"draft-period": future})
        assert response.status_code == 200
        assert "has not started" in response.context["draft_form"].errors["period"][0]
        bad = world.client().post(org_url("customer-invoice-draft", world.org), {"draft-period": "soon"})
        assert "is not a month" in bad.context["draft_form"].errors["period"][0]
        assert not Invoice.objects.exists()

    def test_downloads(self, world, draft):
        client = world.client()
        pdf = client.get(reverse("console:invoice-pdf", kwargs={"invoice_id": draft.pk}))
        assert pdf["Content-Type"] == "application/pdf"
        assert pdf.content.startswith(b"%PDF")
        csv = client.get(reverse("console:invoice-csv", kwargs={"invoice_id": draft.pk}))
        assert csv["Content-Type"].startswith("text/csv")
        assert "attachment" in csv["Content-Disposition"]

    def test_the_list_of_all_invoices_filters(self, world, draft):
        invoice_draft(organization=world.other_org, period=invoicing.parse_period(last_month()))
        client, url = world.client(), reverse("console:invoices")
        assert len(client.get(url).context["rows"]) == 2
        assert [r["invoice"].organization for r in client.get(url, {"organization": "umbr"}).context["rows"]] == [
            world.other_org
        ]
        assert client.get(url, {"status": "paid"}).context["rows"] == []
        assert len(client.get(url, {"period": last_month(), "status": "draft"}).context["rows"]) == 2
        mine = client.get(org_url("customer-invoices", world.org)).context["rows"]
        assert [r["invoice"].pk for r in mine] == [draft.pk]


class TestPrices:
    @pytest.fixture
    def model(self) -> Model:
        model = Model.objects.create(name="cust-chat", task="chat")
        ModelVersion.objects.create(
            model=model, version="2", framework="pytorch", artifact_uri="local://cust/2",
            artifact_sha256="0" * 64, artifact_size=1,
        )  # fmt: skip
        return model

    def post(self, world: World, **changes: str) -> Any:
        data = {
            "model": "cust-chat", "version": "", "input_per_million": "1.5", "output_per_million": "4",
            "cached_input_per_million": "", "per_thousand_inferences": "", "cached_per_thousand_inferences": "",
            "batch_percent": "50", "currency": "USD", "effective_from": "",
        }  # fmt: skip
        data.update(changes)
        return world.client().post(reverse("console:prices"), {f"price-{k}": v for k, v in data.items()}, follow=True)

    def test_setting_a_price_for_a_model_and_a_version(self, world, model, settings):
        settings.BILLING_CURRENCY = "USD"
        response = self.post(world)
        assert "Price of cust-chat set from" in text(response)
        price = Price.objects.get(model=model, version=None)
        assert (price.input_per_million, price.cached_input_per_million) == (Decimal("1.5"), Decimal("1.5"))
        later = (timezone.now() + timedelta(days=3)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M")
        assert "Price of cust-chat:2 set" in text(self.post(world, version="2", effective_from=later))
        scheduled = Price.objects.get(model=model, version__version="2")
        assert scheduled.effective_from == datetime.strptime(later, "%Y-%m-%dT%H:%M").replace(tzinfo=UTC)
        listed = text(world.client().get(reverse("console:prices")))
        assert "in effect" in listed
        assert "scheduled" in listed
        # Both changes are in the audit log, by the admin, linked to the prices page.
        assert list(AuditEntry.objects.filter(action="price.set").values_list("actor_name", flat=True)) == [
            "cust-root", "cust-root"
        ]  # fmt: skip
        log = text(world.client().get(reverse("console:audit"), {"target": "model:cust-chat"}))
        assert log.count("/console/prices/?model=cust-chat") == 2

    def test_models_that_served_traffic_with_no_price_are_called_out(self, world, model):
        key = api_key_create(organization=world.org, name="unpriced").api_key
        today = timezone.now().astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        price = Price.objects.create(model=model, input_per_million=Decimal(1), output_per_million=Decimal(2),
                                     cached_input_per_million=Decimal(1), currency="USD",
                                     effective_from=today - timedelta(days=90))  # fmt: skip
        for version, requests, priced, days_ago in (("2", 1_500, None, 1), ("2", 500, None, 3), ("1", 9, price, 1),
                                                     ("old", 5, None, 45)):  # fmt: skip
            UsageRollup.objects.create(
                period=UsageRollup.Period.DAY, start=today - timedelta(days=days_ago), organization=world.org,
                api_key=key, model="cust-chat", model_version=version, price=priced, requests=requests,
            )  # fmt: skip
        html = world.client().get(reverse("console:prices")).content.decode()
        warning = re.search(r'<section class="card warning" id="unpriced".*?</section>', html, re.S)
        assert warning, "no warning"
        listed = re.findall(r'data-model="([^"]+)"><strong>[^<]*</strong>: ([^<]*)</li>', warning.group(0))
        day = (today - timedelta(days=1)).strftime("%Y-%m-%d")
        assert listed == [("cust-chat:2", f"2,000 requests, the last on {day}")]  # priced and old ones: not listed

    def test_a_classifier_is_priced_per_thousand_inferences_and_shown_so(self, world, model, settings):
        """Issue 40, item 2: a column per unit the model is billed in, never $0.00 per 1M for a
        classifier that invoices charge per 1k inferences."""
        settings.BILLING_CURRENCY = "USD"
        Model.objects.create(name="cust-digits", task="classification")
        response = self.post(world, model="cust-digits", input_per_million="0", output_per_million="0",
                             per_thousand_inferences="0.25", batch_percent="40")  # fmt: skip
        assert "$0.25 per 1k inferences; batch lines at 40 %" in text(response)
        self.post(world)  # the chat model, per token
        html = text(world.client().get(reverse("console:prices")))
        digits = Price.objects.get(model__name="cust-digits")
        row = html.split(f'data-price="{digits.pk}"', 1)[1].split("</tr>", 1)[0]
        assert 'data-col="per-1k">$0.25<' in row
        assert row.count('title="billed per inference">—') == 3  # no token prices shown for it
        assert 'data-col="batch">40 %<' in row
        chat = Price.objects.get(model__name="cust-chat")
        chat_row = html.split(f'data-price="{chat.pk}"', 1)[1].split("</tr>", 1)[0]
        assert "$1.50" in chat_row
        assert chat_row.count('title="billed in tokens">—') == 2

    def test_a_price_is_changed_from_its_row_and_ended_or_withdrawn(self, world, model, settings):
        settings.BILLING_CURRENCY = "USD"
        self.post(world)
        price = Price.objects.get(model=model)
        page = world.client().get(reverse("console:prices"), {"edit": price.pk})
        assert page.context["form"].initial["input_per_million"] == Decimal("1.5")
        assert page.context["form"].initial["model"] == "cust-chat"
        assert "Change the price of cust-chat" in text(page)
        response = world.client().post(reverse("console:price-end", kwargs={"price_id": price.pk}), follow=True)
        assert "The price of cust-chat ended now" in text(response)
        price.refresh_from_db()
        assert price.effective_to is not None
        assert price.effective_to <= timezone.now()
        assert AuditEntry.objects.filter(action="price.end", target="cust-chat").count() == 1
        again = world.client().post(reverse("console:price-end", kwargs={"price_id": price.pk}), follow=True)
        assert "has ended already" in text(again)
        later = (timezone.now() + timedelta(days=3)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M")
        self.post(world, effective_from=later)
        scheduled = Price.objects.get(model=model, effective_to=None)
        response = world.client().post(reverse("console:price-end", kwargs={"price_id": scheduled.pk}), follow=True)
        assert "was withdrawn" in text(response)
        assert not Price.objects.filter(pk=scheduled.pk).exists()
        assert world.client("org_admin").post(
            reverse("console:price-end", kwargs={"price_id": price.pk})
        ).status_code in (302, 403)

    def test_price_errors(self, world, model, settings):
        settings.BILLING_CURRENCY = "USD"
        response = self.post(world, input_per_million="-1", version="9")
        assert "input_per_million" in response.context["form"].errors
        response = self.post(world, version="9")
        assert response.context["form"].errors["version"] == ["cust-chat has no version '9'."]
        response = self.post(world, currency="EUR")
        assert "billing currency" in response.context["form"].errors["currency"][0]
        assert "The price was not set" in text(response)
        assert not Price.objects.exists()


class TestReconciliation:
    def test_reconciling_a_month_now(self, world, monkeypatch):
        period = invoicing.parse_period(last_month())
        # The ledger keeps its hourly counts 40 days: reconcile as on the 2nd of this month.
        now = timezone.now()
        second = datetime(now.year, now.month, 2, 6, tzinfo=UTC)
        monkeypatch.setattr("billing.reconciliation.timezone.now", lambda: second)
        data = {"reconcile-period": last_month()}
        response = world.client().post(reverse("console:reconciliation"), data, follow=True)
        assert f"{last_month()} reconciled" in text(response)
        result = Reconciliation.objects.get()
        assert result.period_start == datetime(period.year, period.month, 1, tzinfo=UTC)
        assert "reconciliation-" in text(world.client().get(reverse("console:reconciliation")))

    def test_a_month_not_over_is_refused_on_the_field(self, world):
        this_month = invoicing.period_label(invoicing.month_start(timezone.now()))
        response = world.client().post(reverse("console:reconciliation"), {"reconcile-period": this_month})
        assert response.status_code == 200
        assert "has not ended yet" in response.context["form"].errors["period"][0]
        assert not Reconciliation.objects.exists()


class TestOrganisationServices:
    def test_billing_email_and_tax_rate_are_validated(self, world):
        with pytest.raises(InvalidInput, match="billing_email"):
            organization_create(name="Bad Mail", billing_email="nope")
        with pytest.raises(InvalidInput, match="tax_rate"):
            organization_update(organization=world.org, tax_rate=Decimal("1.5"))
        with pytest.raises(InvalidInput, match="4 decimal places"):
            organization_update(organization=world.org, tax_rate=Decimal("0.12345"))
        organization_update(organization=world.org, billing_email=" a@b.example ", tax_rate="0.19")
        world.org.refresh_from_db()
        assert (world.org.billing_email, world.org.tax_rate) == ("a@b.example", Decimal("0.19"))

    def test_org_admins_cannot_change_billing(self, world):
        from django.core.exceptions import PermissionDenied

        with pytest.raises(PermissionDenied):
            organization_update(organization=world.org, actor=world.org_admin, tax_rate=Decimal("0"))
