"""The portal's usage page (issue 23): per model or per key, a date range that says which days
it shows (presets, custom days, clear errors), the CSV of the same days, and this month's
invoice as it would be drafted now, for one organisation only."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import ApiKey, Membership, Organization, Plan, Role
from accounts.services import api_key_create, api_key_revoke, organization_create
from billing import invoicing
from billing.models import Invoice, InvoiceLine, UsageRecord, UsageRollup
from billing.rollups import rollups_rebuild
from billing.services import invoice_draft, invoice_finalize
from tests.support.invoices import chat_model, price, record
from tests.support.usage_records import make_record

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 27, 15, 30, tzinfo=UTC)
DASH = "\N{EN DASH}"  # between the first and the last day shown


@dataclass
class Tenants:
    org: Organization
    other_org: Organization
    admin: Any
    member: Any
    outsider: Any
    key: ApiKey
    staging: ApiKey
    other_key: ApiKey

    def client(self, who: str) -> Client:
        client = Client()
        client.force_login(getattr(self, who))
        return client


@pytest.fixture
def tenants() -> Tenants:
    users = get_user_model().objects
    org, other_org = organization_create(name="Alice Corp"), organization_create(name="Bob Corp")
    admin = users.create_user(username="alice-admin", password="pw-usage-123456")
    member = users.create_user(username="alice-member", password="pw-usage-123456")
    outsider = users.create_user(username="bob-admin", password="pw-usage-123456")
    Membership.objects.create(user=admin, organization=org, role=Role.ORG_ADMIN)
    Membership.objects.create(user=member, organization=org, role=Role.ORG_MEMBER)
    Membership.objects.create(user=outsider, organization=other_org, role=Role.ORG_ADMIN)
    return Tenants(
        org=org,
        other_org=other_org,
        admin=admin,
        member=member,
        outsider=outsider,
        key=api_key_create(organization=org, name="production").api_key,
        staging=api_key_create(organization=org, name="staging").api_key,
        other_key=api_key_create(organization=other_org, name="bob's key").api_key,
    )


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> datetime:
    """The pages' clock at NOW (2026-11-27 15:30 UTC), so that presets have known days."""
    monkeypatch.setattr(timezone, "now", lambda: NOW)
    return NOW


def page_url(org: Organization, name: str = "portal-usage") -> str:
    return reverse(f"console:{name}", kwargs={"org_id": org.pk})


def rollup(key: ApiKey, day: date, model: str, *, requests: int, cost: str, tokens: tuple[int, int, int]) -> None:
    UsageRollup.objects.create(
        period=UsageRollup.Period.DAY, start=datetime.combine(day, time.min, UTC), organization_id=key.organization_id,
        api_key=key, model=model, model_version="1", requests=requests, input_tokens=tokens[0],
        output_tokens=tokens[1], cached_tokens=tokens[2], cost=Decimal(cost),
    )  # fmt: skip


@pytest.fixture
def usage(tenants: Tenants, frozen: datetime) -> None:
    """This org: two keys and two models over November and October; the other org: more of everything."""
    today = frozen.date()
    rollup(tenants.key, today, "chat-a", requests=3, cost="0.0012", tokens=(30, 60, 5))
    rollup(tenants.staging, today, "chat-a", requests=2, cost="0.0008", tokens=(20, 40, 0))
    rollup(tenants.key, today - timedelta(days=2), "embed-b", requests=7, cost="0.000014", tokens=(70, 0, 0))
    rollup(tenants.staging, date(2026, 11, 1), "embed-b", requests=11, cost="0.5", tokens=(110, 0, 0))
    rollup(tenants.key, date(2026, 10, 31), "chat-a", requests=100, cost="1.5", tokens=(1000, 2000, 0))
    rollup(tenants.staging, date(2026, 10, 1), "chat-a", requests=40, cost="2.25", tokens=(400, 800, 0))
    for day in (today, date(2026, 11, 1), date(2026, 10, 15)):
        rollup(tenants.other_key, day, "chat-a", requests=999, cost="9", tokens=(9, 9, 9))


def csv_rows(response: Any) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(response.content.decode())))


class TestGroupBy:
    def test_per_model_rows_sum_the_windows_rollups(self, tenants, usage):
        response = tenants.client("member").get(page_url(tenants.org), {"range": "month"})
        models = response.context["models"]
        assert {m: (t.requests, t.input_tokens, t.output_tokens, t.cost) for m, t in models.items()} == {
            "chat-a": (5, 50, 100, Decimal("0.0020")),
            "embed-b": (18, 180, 0, Decimal("0.500014")),
        }
        html = response.content.decode()
        assert 'id="usage-by-model"' in html
        assert 'id="usage-by-key"' not in html
        assert 'aria-current="true">By model' in html

    def test_per_key_rows_sum_each_keys_rollups_and_show_the_key_masked(self, tenants, usage):
        response = tenants.client("member").get(page_url(tenants.org), {"range": "month", "group": "key"})
        rows = {row.name: row for row in response.context["key_rows"]}
        assert set(rows) == {"production", "staging"}  # never bob's key
        production, staging = rows["production"].totals, rows["staging"].totals
        assert (production.requests, production.input_tokens, production.output_tokens) == (10, 100, 60)
        assert production.cost == Decimal("0.001214")
        assert (staging.requests, staging.input_tokens, staging.output_tokens) == (13, 130, 40)
        assert staging.cost == Decimal("0.5008")
        totals = response.context["totals"]
        assert totals.requests == production.requests + staging.requests
        assert totals.cost == production.cost + staging.cost
        html = response.content.decode()
        assert 'id="usage-by-key"' in html
        assert 'id="usage-by-model"' not in html
        assert f"<code>{tenants.key.masked}</code>" in html
        assert tenants.key.masked.startswith("sk-…")
        assert len(tenants.key.masked) == len("sk-…abcd")
        assert tenants.key.prefix not in html  # only the masked form
        assert "$0.50" in html  # staging's cost, in the house format
        # The charts' series are the keys, labelled as in the table.
        cost = response.context["figures"]["cost"]["data"]
        assert sorted(trace["name"] for trace in cost) == sorted(row.label for row in rows.values())
        tokens = response.context["figures"]["tokens"]
        assert tokens["layout"]["title"]["text"] == "Tokens per key"

    def test_a_revoked_key_still_shows_its_usage(self, tenants, usage):
        api_key_revoke(api_key=tenants.staging)
        response = tenants.client("member").get(page_url(tenants.org), {"range": "month", "group": "key"})
        staging = next(row for row in response.context["key_rows"] if row.name == "staging")
        assert (staging.active, staging.totals.requests) == (False, 13)
        assert "inactive" in response.content.decode()

    def test_one_key_per_model(self, tenants, usage):
        response = tenants.client("member").get(
            page_url(tenants.org), {"range": "month", "api_key": tenants.staging.pk}
        )
        assert {m: t.requests for m, t in response.context["models"].items()} == {"chat-a": 2, "embed-b": 11}

    def test_the_switches_keep_the_rest_of_the_question(self, tenants, usage):
        response = tenants.client("member").get(
            page_url(tenants.org), {"start": "2026-11-01", "end": "2026-11-20", "api_key": tenants.key.pk}
        )
        links = dict((key, query) for key, _, query in response.context["groups"])
        assert links["key"] == f"start=2026-11-01&end=2026-11-20&group=key&api_key={tenants.key.pk}"
        presets = {r.key: query for r, query in response.context["ranges"]}
        assert presets["7"] == f"api_key={tenants.key.pk}&range=7"

    def test_an_unknown_grouping_is_an_error_not_a_500(self, tenants, usage):
        response = tenants.client("member").get(page_url(tenants.org), {"group": "colour"})
        assert response.status_code == 200
        assert "Select a valid choice" in response.content.decode()
        assert response.context["asked"].group == "model"


class TestRange:
    @pytest.mark.parametrize(
        ("preset", "start", "end", "label"),
        [
            ("7", "2026-11-21", "2026-11-27", "Last 7 days"),
            ("30", "2026-10-29", "2026-11-27", "Last 30 days"),
            ("month", "2026-11-01", "2026-11-27", "This month"),
            ("last-month", "2026-10-01", "2026-10-31", "Last month"),
            ("90", "2026-08-30", "2026-11-27", "Last 90 days"),
        ],
    )
    def test_each_preset_shows_its_days(self, tenants, usage, preset, start, end, label):
        response = tenants.client("member").get(page_url(tenants.org), {"range": preset})
        assert (str(response.context["start"]), str(response.context["end"])) == (start, end)
        html = response.content.decode()
        assert f'{label}: <span id="usage-range">{start} {DASH} {end} (UTC)</span>' in html
        assert f'aria-current="true">{label}</a>' in html
        # The custom form holds the days shown, to adjust from there.
        assert f'name="start" value="{start}"' in html
        assert f'name="end" value="{end}"' in html

    def test_the_presets_know_their_month(self, tenants, usage):
        client = tenants.client("member")
        assert client.get(page_url(tenants.org), {"range": "month"}).context["totals"].requests == 23
        assert client.get(page_url(tenants.org), {"range": "last-month"}).context["totals"].requests == 140

    def test_last_month_in_january_is_december(self, tenants, monkeypatch):
        monkeypatch.setattr(timezone, "now", lambda: datetime(2027, 1, 5, 1, 0, tzinfo=UTC))
        response = tenants.client("member").get(page_url(tenants.org), {"range": "last-month"})
        assert (response.context["start"], response.context["end"]) == (date(2026, 12, 1), date(2026, 12, 31))

    def test_the_default_is_the_last_30_days(self, tenants, usage):
        response = tenants.client("member").get(page_url(tenants.org))
        assert (response.context["start"], response.context["end"]) == (date(2026, 10, 29), date(2026, 11, 27))
        assert "Last 30 days: " in response.content.decode()

    def test_custom_days_show_their_dates(self, tenants, usage):
        response = tenants.client("member").get(page_url(tenants.org), {"start": "2026-10-31", "end": "2026-11-01"})
        assert response.context["totals"].requests == 111
        html = response.content.decode()
        assert f'Custom range: <span id="usage-range">2026-10-31 {DASH} 2026-11-01 (UTC)</span>' in html
        assert 'aria-current="true">Last' not in html

    def test_custom_days_that_are_a_preset_are_named_so(self, tenants, usage):
        response = tenants.client("member").get(page_url(tenants.org), {"start": "2026-11-01", "end": "2026-11-27"})
        assert response.context["asked"].range == "month"
        shown = f'This month: <span id="usage-range">2026-11-01 {DASH} 2026-11-27 (UTC)</span>'
        assert shown in response.content.decode()

    @pytest.mark.parametrize(
        ("query", "message"),
        [
            (
                {"start": "2026-11-20", "end": "2026-11-10"},
                "The last day (2026-11-10) is before the first (2026-11-20).",
            ),
            ({"start": "2025-01-01", "end": "2026-11-27"}, "Choose at most 366 days (696 asked)."),
            ({"start": "27/11/2026"}, "Enter a day as YYYY-MM-DD, for example 2026-11-01."),
            ({"end": "2026-02-30"}, "Enter a day as YYYY-MM-DD, for example 2026-11-01."),
            ({"start": "2026-11-01", "end": "9999-12-31"}, "Usage is known up to today, 2026-11-27 (UTC)."),
            ({"range": "forever"}, "Select a valid choice."),
        ],
    )
    def test_bad_days_are_a_clear_message_and_the_default_window_meanwhile(self, tenants, usage, query, message):
        response = tenants.client("member").get(page_url(tenants.org), query)
        assert response.status_code == 200
        html = response.content.decode()
        assert 'id="usage-window-errors"' in html
        assert 'role="alert"' in html
        assert message in html
        assert "Showing the last 30 days instead." in html
        assert (response.context["start"], response.context["end"]) == (date(2026, 10, 29), date(2026, 11, 27))


class TestCsv:
    def test_the_csv_follows_the_range(self, tenants, usage):
        client = tenants.client("member")
        rows = csv_rows(client.get(page_url(tenants.org, "portal-usage-csv"), {"range": "last-month"}))
        assert sorted((r["date"], r["api_key_name"], r["requests"]) for r in rows) == [
            ("2026-10-01", "staging", "40"),
            ("2026-10-31", "production", "100"),
        ]
        custom = client.get(page_url(tenants.org, "portal-usage-csv"), {"start": "2026-10-31", "end": "2026-11-01"})
        assert 'filename="usage-alice-corp-2026-10-31-2026-11-01.csv"' in custom["Content-Disposition"]
        assert sorted(r["date"] for r in csv_rows(custom)) == ["2026-10-31", "2026-11-01"]
        assert {r["api_key"] for r in csv_rows(custom)} == {tenants.key.masked, tenants.staging.masked}

    def test_a_clients_cancels_are_not_errors_on_the_page_or_in_the_csv(self, tenants, frozen):
        """Issue 34, defect 12: 26 requests its clients cancelled (499) and 2 failures of a model."""
        at = frozen - timedelta(hours=1)
        for status in [499] * 26 + [502] * 2 + [200] * 3:
            make_record(tenants.key, at=at, model="chat-c", status=status)
        rollups_rebuild(start=at, end=frozen)
        client = tenants.client("member")
        response = client.get(page_url(tenants.org), {"range": "month"})
        totals = response.context["totals"]
        assert (totals.requests, totals.errors, getattr(totals, "cancelled", None)) == (31, 2, 26)
        html = response.content.decode()
        assert "2 errors" in html
        assert "26 cancelled by the client" in html
        [row] = csv_rows(client.get(page_url(tenants.org, "portal-usage-csv"), {"range": "month"}))
        assert (row["requests"], row["errors"], row.get("cancelled")) == ("31", "2", "26")

    def test_the_pages_link_downloads_the_days_shown(self, tenants, usage):
        client = tenants.client("member")
        response = client.get(page_url(tenants.org), {"range": "7", "group": "key", "api_key": tenants.key.pk})
        query = response.context["csv_query"]
        assert query == f"start=2026-11-21&end=2026-11-27&group=key&api_key={tenants.key.pk}"
        assert f'usage.csv?{query.replace("&", "&amp;")}" id="usage-csv"' in response.content.decode()
        rows = csv_rows(client.get(f"{page_url(tenants.org, 'portal-usage-csv')}?{query}"))
        assert sum(int(r["requests"]) for r in rows) == response.context["totals"].requests == 10

    def test_bad_days_are_a_400_that_says_why(self, tenants, usage):
        response = tenants.client("member").get(
            page_url(tenants.org, "portal-usage-csv"), {"start": "2026-11-20", "end": "2026-11-10"}
        )
        assert response.status_code == 400
        assert "is before the first" in response.content.decode()

    def test_another_organisations_csv_is_404(self, tenants, usage):
        assert tenants.client("outsider").get(page_url(tenants.org, "portal-usage-csv")).status_code == 404


@dataclass
class Month:
    """Records of this month (priced, unpriced, batch), a late one of last month after its
    invoice was finalized, and the other org's."""

    records: list[UsageRecord]


@pytest.fixture
def month(tenants: Tenants) -> Month:
    now = timezone.now()
    first = invoicing.month_start(now)
    start = datetime.combine(first, time.min, UTC)
    last_month = invoicing.previous_month(first)
    chat = chat_model("chat-priced")
    chat_price = price(chat, "2020-01-01 00:00:00", "0.50", "1.50", "0.25")
    chat_model("chat-unpriced")
    Plan.objects.filter(tier=tenants.org.tier).update(included_credit=Decimal("1.00"))
    Organization.objects.filter(pk=tenants.org.pk).update(tax_rate=Decimal("0.0750"))
    tenants.org.refresh_from_db()
    old = record(tenants.key, datetime.combine(last_month, time(12), UTC), prompt=1000, completion=10,
                 price=chat_price, model="chat-priced")  # fmt: skip
    invoice_finalize(invoice=invoice_draft(organization=tenants.org, period=last_month))
    old.refresh_from_db()
    assert old.invoice_id is not None
    made = [
        record(tenants.key, start + timedelta(minutes=5), prompt=2_345_678, completion=1_234_567, cached=345_678,
               price=chat_price, model="chat-priced"),
        record(tenants.staging, start + timedelta(minutes=6), prompt=1_000_000, completion=2_000_000,
               price=chat_price, model="chat-priced", batch=True),
        record(tenants.key, start + timedelta(minutes=7), prompt=500, completion=700, model="chat-unpriced"),
        # Late usage of last month, whose invoice is final: an adjustment on this month's.
        record(tenants.key, datetime.combine(last_month, time(13), UTC), prompt=3_000_000, completion=0,
               price=chat_price, model="chat-priced"),
        record(tenants.other_key, start + timedelta(minutes=8), prompt=7_777_777, completion=7_777_777,
               price=chat_price, model="chat-priced"),
    ]  # fmt: skip
    return Month(records=made)


def line_facts(lines: list[Any]) -> list[tuple[Any, ...]]:
    return [(ln.kind, ln.model, ln.token_kind, ln.batch, ln.quantity, ln.unit_price, ln.amount) for ln in lines]


class TestMonthPreview:
    def test_it_says_what_drafting_the_month_would_and_drafts_nothing(self, tenants, month):
        before = list(Invoice.objects.values_list("pk", flat=True))
        response = tenants.client("admin").get(page_url(tenants.org))
        preview = response.context["preview"]
        assert list(Invoice.objects.values_list("pk", flat=True)) == before  # no invoice made
        assert UsageRecord.objects.filter(organization=tenants.org, invoice__isnull=True).count() == 4  # none taken
        period = invoicing.month_start(timezone.now())
        computed = invoicing.invoice_preview(organization=tenants.org, period=period)
        assert computed is not None
        assert computed.draft is None

        drafted = invoice_draft(organization=tenants.org, period=period)
        stored = list(drafted.lines.order_by("id"))
        assert line_facts(computed.figures.lines) == line_facts(stored)
        assert [line.description for line in computed.figures.lines] == [line.description for line in stored]
        sums = computed.figures.totals
        assert (sums.subtotal, sums.credit, sums.tax, sums.total) == (
            drafted.subtotal, drafted.credit, drafted.tax, drafted.total,
        )  # fmt: skip
        # The page's card is that computation: the usage lines, the credit in the totals.
        billed = [line for line in stored if line.kind != InvoiceLine.Kind.CREDIT]
        assert [(p.model, p.quantity, p.amount) for p in preview.lines] == [
            (line.model, line.quantity, line.amount) for line in billed
        ]
        assert preview.totals == sums
        assert {line.kind for line in stored} == {"usage", "adjustment", "credit"}
        assert any(line.batch for line in stored)
        assert drafted.credit == Decimal("1.00")
        assert drafted.tax > 0

    def test_the_card_shows_lines_totals_and_that_it_is_a_preview(self, tenants, month):
        html = tenants.client("admin").get(page_url(tenants.org)).content.decode()
        card = html[html.index('id="month-preview"') :]
        assert "This month so far" in card
        assert "It is a preview: the invoice itself is drafted after the month ends" in card
        assert "chat-priced" in card
        assert "Batch input tokens" in card
        assert "late usage of" in card
        assert (
            '2,000,000<br><span class="muted small">tokens</span>' in card
        )  # input = prompt - cached, on its own line
        assert '$0.50<br><span class="muted small">per 1M tokens</span>' in card
        assert "Tax (7.5 %)" in card
        preview = invoicing.invoice_preview(organization=tenants.org, period=invoicing.month_start(timezone.now()))
        assert preview is not None
        total = preview.figures.totals.total
        assert f'id="month-preview-total"><strong>${total:,.2f}</strong>' in card

    def test_unpriced_usage_says_so_not_zero(self, tenants, month):
        html = tenants.client("admin").get(page_url(tenants.org)).content.decode()
        card = html[html.index('id="month-preview"') :]
        assert 'id="month-preview-unpriced"' in card
        row = card[card.index('<tr class="unpriced">') :]
        row = row[: row.index("</tr>")]
        assert "chat-unpriced" in row
        assert "unpriced" in row
        assert "not charged" in row
        assert "$0.00" not in row

    def test_an_open_draft_is_previewed_with_what_it_would_take_next(self, tenants, month):
        period = invoicing.month_start(timezone.now())
        draft = invoice_draft(organization=tenants.org, period=period)
        record(tenants.key, timezone.now() - timedelta(seconds=1), prompt=4_000, completion=1, model="chat-unpriced")
        preview = invoicing.invoice_preview(organization=tenants.org, period=period)
        assert preview is not None
        assert preview.draft == draft
        refreshed = invoice_draft(organization=tenants.org, period=period)
        assert line_facts(preview.figures.lines) == line_facts(list(refreshed.lines.order_by("id")))
        assert preview.figures.totals.total == refreshed.total
        html = tenants.client("admin").get(page_url(tenants.org)).content.decode()
        assert f"A draft, {invoicing.display_number(draft)}, is already open" in html

    def test_it_is_for_the_organisations_admins(self, tenants, month):
        assert 'id="month-preview"' not in tenants.client("member").get(page_url(tenants.org)).content.decode()
        assert tenants.client("outsider").get(page_url(tenants.org)).status_code == 404

    def test_no_usage_this_month_is_an_empty_preview(self, tenants):
        html = tenants.client("admin").get(page_url(tenants.org)).content.decode()
        assert "No usage to bill this month yet." in html


class TestIsolation:
    def test_another_organisations_usage_never_shows(self, tenants, usage, month):
        client = tenants.client("admin")
        for query in ({"range": "90"}, {"range": "90", "group": "key"}, {"range": "last-month", "group": "key"}):
            response = client.get(page_url(tenants.org), query)
            html = response.content.decode()
            assert "bob&#x27;s key" not in html
            assert tenants.other_key.masked not in html
            assert response.context["totals"].requests < 999
        preview = client.get(page_url(tenants.org)).context["preview"]
        assert preview.lines
        assert all(line.quantity != 7_777_777 for line in preview.lines)
        rows = csv_rows(client.get(page_url(tenants.org, "portal-usage-csv"), {"range": "90"}))
        assert rows
        assert all(r["api_key_name"] in {"production", "staging"} for r in rows)
        # Bob's own page has his usage only.
        bob = tenants.client("outsider").get(page_url(tenants.other_org), {"range": "90", "group": "key"})
        assert [row.name for row in bob.context["key_rows"]] == ["bob's key"]
        assert bob.context["totals"].requests == 999 * 3


class TestOneFigureEverywhere:
    """Issue 40: a month under a cent reads the same in the cost card, the chart's hover, the
    budget and the invoice preview ($0.0035), never "< $0.01"; the cap reads as configured, and
    the preview says what its cents were rounded from."""

    def test_a_month_under_a_cent(self, tenants, frozen):
        small = price(chat_model("chat-small"), "2020-01-01 00:00:00", "0.50", "1.50")
        at = frozen - timedelta(hours=1)
        record(tenants.key, at, prompt=1000, completion=2000, price=small, model="chat-small")  # 0.0005 + 0.003
        rollups_rebuild(start=at, end=frozen)
        Organization.objects.filter(pk=tenants.org.pk).update(monthly_spend_cap=Decimal("0.0040"))
        response = tenants.client("admin").get(page_url(tenants.org), {"range": "month"})
        html = response.content.decode()
        assert response.context["totals"].cost == Decimal("0.0035")
        card = html[html.index('id="total-cost"') :]
        assert card[card.index(">") + 1 : card.index("</div>")] == "$0.0035"
        # The chart: the day's hover is the card's text; the axis labels steps under a cent by their digits.
        figure = response.context["figures"]["cost"]
        [trace] = figure["data"]
        assert trace["customdata"][-1] == "$0.0035"
        assert set(trace["customdata"][:-1]) == {"$0.00"}
        assert "%{customdata}" in trace["hovertemplate"]
        axis = figure["layout"]["yaxis"]
        assert axis["tickprefix"] == "$"
        assert [stop["value"] for stop in axis["tickformatstops"]] == [",~r", ",.2f", ",.0f"]
        # The budget: spent with its digits, the cap as configured.
        budget = html[html.index('id="budget"') : html.index("Alerts this month")]
        assert '<td class="num">$0.0035</td>' in budget
        assert '<td class="num">$0.004</td>' in budget
        # The preview charges cents, and says what each line and the subtotal were rounded from.
        preview = html[html.index('id="month-preview"') :]
        assert "rounded from $0.0005" in preview
        assert "rounded from $0.003" in preview
        assert "Before rounding, the usage on these lines comes to $0.0035" in preview
        assert "so the subtotal is $0.00." in preview
        assert "&lt; $" not in html

    def test_a_line_of_whole_cents_says_nothing_of_rounding(self, tenants, frozen):
        whole = price(chat_model("chat-whole"), "2020-01-01 00:00:00", "0.50", "1.50")
        record(tenants.key, frozen - timedelta(hours=1), prompt=2_000_000, price=whole, model="chat-whole")
        preview = tenants.client("admin").get(page_url(tenants.org)).content.decode()
        preview = preview[preview.index('id="month-preview"') :]
        assert "$1.00" in preview
        assert "rounded from" not in preview
        assert "Before rounding" not in preview


class TestChartsForEveryCustomer:
    """Issue 40, item 8: what the review saw on the portal's usage page."""

    def _figures(self, response: Any) -> dict[str, Any]:
        html = response.content.decode()
        found = {}
        for chunk in html.split('<script id="figure-')[1:]:
            name, _, rest = chunk.partition('"')
            found[name] = json.loads(rest.split(">", 1)[1].split("</script>", 1)[0])
        return found

    def test_a_classifier_only_organisation_gets_an_inferences_chart_not_an_empty_token_axis(self, tenants, frozen):
        today = frozen.date()
        UsageRollup.objects.create(period=UsageRollup.Period.DAY, start=datetime.combine(today, time.min, UTC),
                                   organization_id=tenants.org.pk, api_key=tenants.key, model="digits-mlp",
                                   model_version="1", requests=4, inferences=120, cost=Decimal("0.012"))  # fmt: skip
        response = tenants.client("member").get(page_url(tenants.org))
        figures = self._figures(response)
        assert "tokens" not in figures
        assert [bar["y"] for bar in figures["inferences"]["data"]] == [[120]]
        html = response.content.decode()
        assert 'id="total-inferences">120<' in html
        assert 'data-figure="tokens"' not in html

    def test_models_never_share_a_colour_and_today_is_drawn_whole(self, tenants, frozen):
        today = frozen.date()
        for i in range(12):
            rollup(tenants.key, today, f"model-{i}", requests=1, cost="0.01", tokens=(1, 1, 0))
        response = tenants.client("member").get(page_url(tenants.org), {"preset": "last_7_days"})
        cost = self._figures(response)["cost"]
        assert len({bar["marker"]["color"] for bar in cost["data"]}) == 12
        first, last = cost["layout"]["xaxis"]["range"]
        assert last == f"{today.isoformat()}T12:00:00"  # half a day past today's midnight: its bar whole
        assert first.endswith("T12:00:00")

    def test_no_usage_links_to_the_quickstart_and_draws_no_empty_charts(self, tenants, frozen):
        html = tenants.client("member").get(page_url(tenants.org)).content.decode()
        empty = html.split('id="no-usage"', 1)[1].split("</div>", 1)[0]
        assert reverse("console:quickstart", kwargs={"org_id": tenants.org.pk}) in empty
        assert 'data-figure="cost"' not in html
