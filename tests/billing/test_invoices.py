"""Invoices: the rounding rule, UTC months, late usage, the guarded lifecycle, gap-free
numbers under concurrent drafting, the beat job and command, email, and the API."""

from __future__ import annotations

import datetime as dt
import io
import threading
import uuid
from decimal import ROUND_HALF_EVEN, Decimal

import pytest
from django.core import mail
from django.core.management import CommandError, call_command
from django.db import connection

from accounts.models import Organization, Plan, Role
from accounts.services import api_key_create, membership_set, organization_create, platform_organization
from billing import invoicing
from billing.invoicing import invoiced_usage, line_amount, round_cents, totals
from billing.models import Invoice, InvoiceLine, InvoiceSequence
from billing.services import (
    InvoiceFrozen,
    invoice_deletable,
    invoice_delete_draft,
    invoice_draft,
    invoice_finalize,
    invoice_mark_paid,
    invoice_refresh,
    invoice_reissue,
    invoice_void,
)
from billing.services import invoices as invoices_module
from billing.tasks import invoice_email, invoices_draft_due
from core.errors import InvalidInput
from core.transitions import IllegalTransition
from tests.support.api import client_for
from tests.support.invoices import at, chat_model, price, record

pytestmark = pytest.mark.django_db

DEC = dt.date(2025, 12, 1)
JAN = dt.date(2026, 1, 1)
SEP = dt.date(2026, 9, 1)
OCT = dt.date(2026, 10, 1)
NOV = dt.date(2026, 11, 1)


@pytest.fixture
def key(alice_org):
    return api_key_create(organization=alice_org, name="k").api_key


@pytest.fixture
def model():
    return chat_model()


@pytest.fixture
def eager_celery():
    """Tasks queued with .delay() run at once, in this process (the email after finalizing)."""
    conf = invoice_email.app.conf
    previous = conf.task_always_eager
    conf.task_always_eager = True
    yield
    conf.task_always_eager = previous


def lines_of(invoice: Invoice) -> list[tuple[str, str, str, int, Decimal, Decimal]]:
    return [
        (line.kind, line.model, line.token_kind, line.quantity, line.unit_price, line.amount)
        for line in invoice.lines.order_by("id")
    ]


def frozen_view(invoice: Invoice) -> tuple[object, ...]:
    invoice.refresh_from_db()
    return (
        invoice.status, invoice.subtotal, invoice.credit, invoice.tax, invoice.total, invoice.updated_at,
        lines_of(invoice), sorted(invoice.usage_records.values_list("pk", flat=True)),
    )  # fmt: skip


class TestRounding:
    @pytest.mark.parametrize(
        ("quantity", "unit_price", "amount"),
        [
            (1, "5000", "0.01"),  # exactly 0.005: half up, where banker's rounding gives 0.00
            (5, "5000", "0.03"),  # 0.025: half up (half-even would be 0.02)
            (1, "4999.999999", "0.00"),  # 0.004999999999: down
            (3, "0.000001", "0.00"),
            (1_000_000, "0.15", "0.15"),
            (333_333, "0.30", "0.10"),  # 0.0999999
            (123_456_789, "2.345678", "289.59"),  # 289.589...
        ],
    )
    def test_a_line_rounds_once_half_up(self, quantity, unit_price, amount):
        assert line_amount(quantity=quantity, unit_price=Decimal(unit_price)) == Decimal(amount)

    def test_half_up_differs_from_bankers_rounding(self):
        exact = Decimal("0.125")
        assert exact.quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN) == Decimal("0.12")
        assert round_cents(exact) == Decimal("0.13")

    def test_huge_quantities_are_exact_before_rounding(self):
        # 10^18 tokens at the largest price: 31 significant digits, past Decimal's default 28.
        quantity, unit = 10**18 + 1, Decimal("999999999999.999999")
        exact_micro_cents = quantity * 999999999999999999  # price in micro-units, integer arithmetic
        cents, remainder = divmod(exact_micro_cents, 10**10)  # / 10^6 per million, / 10^6 micro, * 100
        expected = Decimal(cents + (1 if remainder * 2 >= 10**10 else 0)).scaleb(-2)
        assert line_amount(quantity=quantity, unit_price=unit) == expected

    def test_tax_rounds_half_up_on_the_net(self):
        sums = totals([Decimal("10.10")], credit_available=Decimal(0), tax_rate=Decimal("0.0500"))
        assert sums.tax == Decimal("0.51")  # 0.505
        sums = totals([Decimal("10.05")], credit_available=Decimal(0), tax_rate=Decimal("0.0750"))
        assert sums.tax == Decimal("0.75")  # 0.75375

    def test_credit_never_exceeds_the_subtotal(self):
        sums = totals([Decimal("3.00")], credit_available=Decimal("5.00"), tax_rate=Decimal("0.2"))
        assert (sums.subtotal, sums.credit, sums.tax, sums.total) == (
            Decimal("3.00"), Decimal("3.00"), Decimal("0.00"), Decimal("0.00"),
        )  # fmt: skip

    def test_many_small_requests_are_summed_before_rounding(self, key, model):
        # 1,000 requests of 1 token at 4,000 per 1M cost 0.004 each: one line of 4.00, not 1,000 x 0.00.
        p = price(model, "2026-09-01", "4000", "0")
        for second in range(1000):
            record(key, at("2026-10-02") + dt.timedelta(seconds=second), prompt=1, price=p)
        invoice = invoice_draft(organization=key.organization, period=OCT)
        assert lines_of(invoice) == [("usage", "chat-model", "input", 1000, Decimal("4000"), Decimal("4.00"))]
        assert invoice.subtotal == Decimal("4.00")

    def test_small_lines_round_each_and_the_subtotal_adds_the_rounded_lines(self, key):
        models = [chat_model(f"m{i}") for i in range(3)]
        for m in models:  # each line 0.005 exactly: 0.01 each, 0.03 in all (the exact sum is 0.015)
            p = price(m, "2026-09-01", "5000", "0")
            record(key, "2026-10-03", prompt=1, price=p, model=m.name)
        invoice = invoice_draft(organization=key.organization, period=OCT)
        assert [line[-1] for line in lines_of(invoice)] == [Decimal("0.01")] * 3
        assert invoice.subtotal == Decimal("0.03")


class TestWhichUsage:
    def test_the_month_ends_at_midnight_utc(self, key, model):
        p = price(model, "2025-11-01", "1000000", "0")  # 1.00 per token: each line shows its tokens
        record(key, "2025-12-31 23:59:59.999999", prompt=7, price=p)
        record(key, "2026-01-01 00:00:00", prompt=11, price=p)
        # 00:30 on Jan 1st in UTC+1 is still December in UTC.
        record(key, dt.datetime(2026, 1, 1, 0, 30, tzinfo=dt.timezone(dt.timedelta(hours=1))), prompt=2, price=p)
        december = invoice_draft(organization=key.organization, period=DEC)
        assert [(k, q, a) for k, _, _, q, _, a in lines_of(december)] == [("usage", 9, Decimal("9.00"))]
        january = invoice_draft(organization=key.organization, period=JAN)
        assert [(k, q, a) for k, _, _, q, _, a in lines_of(january)] == [("usage", 11, Decimal("11.00"))]
        assert december.number + 1 == january.number

    def test_token_kinds_each_have_their_price(self, key, model):
        p = price(model, "2026-09-01", "1.00", "2.00", cached="0.50")
        record(key, "2026-10-05", prompt=1_000_000, cached=400_000, completion=2_000_000, price=p)
        invoice = invoice_draft(organization=key.organization, period=OCT)
        assert lines_of(invoice) == [
            ("usage", "chat-model", "input", 600_000, Decimal("1.00"), Decimal("0.60")),
            ("usage", "chat-model", "output", 2_000_000, Decimal("2.00"), Decimal("4.00")),
            ("usage", "chat-model", "cached", 400_000, Decimal("0.50"), Decimal("0.20")),
        ]
        assert invoice.subtotal == Decimal("4.80")

    def test_a_price_change_mid_month_gives_two_lines(self, key, model):
        old = price(model, "2026-09-01", "10", "20")
        new = price(model, "2026-10-15", "12", "24")
        record(key, "2026-10-14 23:59:59", prompt=100_000, completion=50_000, price=old)
        record(key, "2026-10-15 00:00:00", prompt=100_000, completion=50_000, price=new)
        invoice = invoice_draft(organization=key.organization, period=OCT)
        assert lines_of(invoice) == [
            ("usage", "chat-model", "input", 100_000, Decimal("10"), Decimal("1.00")),
            ("usage", "chat-model", "output", 50_000, Decimal("20"), Decimal("1.00")),
            ("usage", "chat-model", "input", 100_000, Decimal("12"), Decimal("1.20")),
            ("usage", "chat-model", "output", 50_000, Decimal("24"), Decimal("1.20")),
        ]
        assert invoice.subtotal == Decimal("4.40")

    def test_batch_usage_has_its_own_lines_at_the_batch_percent(self, key, model):
        p = price(model, "2026-09-01", "10", "20")  # batch_percent: 50 by default
        record(key, "2026-10-05", prompt=100_000, completion=50_000, price=p)
        record(key, "2026-10-06", prompt=200_000, completion=100_000, price=p, batch=True)
        invoice = invoice_draft(organization=key.organization, period=OCT)
        assert lines_of(invoice) == [
            ("usage", "chat-model", "input", 100_000, Decimal("10"), Decimal("1.00")),
            ("usage", "chat-model", "output", 50_000, Decimal("20"), Decimal("1.00")),
            ("usage", "chat-model", "input", 200_000, Decimal("5"), Decimal("1.00")),
            ("usage", "chat-model", "output", 100_000, Decimal("10"), Decimal("1.00")),
        ]
        batch_lines = invoice.lines.filter(batch=True)
        assert batch_lines.count() == 2
        assert all("batch" in line.description for line in batch_lines)
        assert invoiced_usage(period=OCT, organization=key.organization).ok  # re-priced the same

    def test_unpriced_usage_is_a_visible_line_at_zero(self, key):
        record(key, "2026-10-05", prompt=30, completion=12)
        invoice = invoice_draft(organization=key.organization, period=OCT)
        assert lines_of(invoice) == [
            ("usage", "chat-model", "input", 30, Decimal(0), Decimal("0.00")),
            ("usage", "chat-model", "output", 12, Decimal(0), Decimal("0.00")),
        ]
        assert "unpriced" in invoice.lines.first().description

    def test_credit_tax_and_total(self, key, model):
        key.organization.tax_rate = Decimal("0.2000")
        key.organization.save()
        Plan.objects.filter(tier=key.organization.tier).update(included_credit=Decimal("1.50"))
        p = price(model, "2026-09-01", "1", "1")
        record(key, "2026-10-05", prompt=5_555_555, price=p)  # 5.555555 → 5.56
        invoice = invoice_draft(organization=key.organization, period=OCT)
        assert (invoice.subtotal, invoice.credit, invoice.tax, invoice.total) == (
            Decimal("5.56"), Decimal("1.50"), Decimal("0.81"), Decimal("4.87"),
        )  # fmt: skip
        credit = invoice.lines.get(kind=InvoiceLine.Kind.CREDIT)
        assert credit.amount == Decimal("-1.50")
        assert invoice.currency == "USD"

    def test_other_organisations_usage_stays_out(self, key, bob_org, model):
        p = price(model, "2026-09-01", "1", "1")
        record(key, "2026-10-05", prompt=1_000_000, price=p)
        bobs = record(api_key_create(organization=bob_org, name="b").api_key, "2026-10-05", prompt=9, price=p)
        invoice = invoice_draft(organization=key.organization, period=OCT)
        assert invoice.subtotal == Decimal("1.00")
        bobs.refresh_from_db()
        assert bobs.invoice is None

    def test_a_month_that_has_not_started_is_refused(self, key):
        with pytest.raises(InvalidInput):
            invoice_draft(organization=key.organization, period=dt.date(2100, 1, 1))


class TestDrafting:
    def test_redrafting_is_idempotent_and_takes_new_usage(self, key, model):
        p = price(model, "2026-09-01", "1", "1")
        record(key, "2026-10-05", prompt=1_000_000, price=p)
        first = invoice_draft(organization=key.organization, period=OCT)
        before = lines_of(first)
        again = invoice_draft(organization=key.organization, period=OCT)
        assert (again.pk, again.number, lines_of(again)) == (first.pk, first.number, before)
        late = record(key, "2026-10-30", prompt=2_000_000, price=p)
        refreshed = invoice_draft(organization=key.organization, period=OCT)
        assert (refreshed.pk, refreshed.number, refreshed.subtotal) == (first.pk, first.number, Decimal("3.00"))
        late.refresh_from_db()
        assert late.invoice_id == first.pk
        assert Invoice.objects.count() == 1
        assert InvoiceSequence.objects.get(name="invoices").next_number == first.number + 1

    def test_the_latest_draft_is_deleted_its_number_given_back_and_its_usage_released(self, key, bob_org, model):
        """Issue 40, item 10: a draft is deleted, not voided (Stripe), without a gap in the numbers."""
        p = price(model, "2026-09-01", "1", "1")
        used = record(key, "2026-10-05", prompt=1_000_000, price=p)
        first = invoice_draft(organization=key.organization, period=OCT)
        assert invoice_deletable(first)
        invoice_delete_draft(invoice=first)
        assert not Invoice.objects.filter(pk=first.pk).exists()
        assert not InvoiceLine.objects.filter(invoice_id=first.pk).exists()
        used.refresh_from_db()
        assert used.invoice_id is None
        again = invoice_draft(organization=key.organization, period=OCT)
        assert again.number == first.number  # given back: no gap
        # A draft with a later number after it is voided instead; so is a finalized invoice.
        later = invoice_draft(organization=bob_org, period=OCT)
        assert not invoice_deletable(again)
        with pytest.raises(InvalidInput, match="void this draft instead"):
            invoice_delete_draft(invoice=again)
        assert Invoice.objects.filter(pk=again.pk).exists()
        assert later.number == again.number + 1

    def test_late_usage_after_finalizing_is_next_months_adjustment(self, key, model):
        p = price(model, "2026-09-01", "1", "1")
        record(key, "2026-09-10", prompt=1_000_000, price=p)
        september = invoice_finalize(invoice=invoice_draft(organization=key.organization, period=SEP))
        frozen = frozen_view(september)
        late = record(key, "2026-09-30 23:00", prompt=2_000_000, price=p)  # arrived after finalizing
        record(key, "2026-10-01", prompt=3_000_000, price=p)
        assert invoice_draft(organization=key.organization, period=SEP).pk == september.pk
        assert frozen_view(september) == frozen
        october = invoice_draft(organization=key.organization, period=OCT)
        adjustment = october.lines.get(kind=InvoiceLine.Kind.ADJUSTMENT)
        assert (adjustment.usage_period, adjustment.quantity, adjustment.amount) == (SEP, 2_000_000, Decimal("2.00"))
        assert "late usage of 2026-09" in adjustment.description
        assert october.lines.get(kind=InvoiceLine.Kind.USAGE).amount == Decimal("3.00")
        assert october.subtotal == Decimal("5.00")
        late.refresh_from_db()
        assert late.invoice_id == october.pk

    def test_each_record_goes_on_its_own_months_invoice(self, key, model, settings):
        """Defect 4 of issue 18: drafting November before October's invoice exists (an admin
        previewing the current month during the grace period) takes nothing of October, and
        October keeps its usage and its plan credit."""
        from accounts.models import Plan

        Plan.objects.filter(tier=key.organization.tier).update(included_credit=Decimal("1.00"))
        p = price(model, "2026-09-01", "1", "1")
        october_record = record(key, "2026-10-31 23:59", prompt=2_000_000, price=p)
        record(key, "2026-11-01 00:00", prompt=3_000_000, price=p)
        november = invoice_draft(organization=key.organization, period=NOV)
        assert november.subtotal == Decimal("3.00")
        assert not november.lines.filter(kind=InvoiceLine.Kind.ADJUSTMENT).exists()
        october = invoice_draft(organization=key.organization, period=OCT)
        assert (october.subtotal, october.credit, october.total) == (Decimal("2.00"), Decimal("1.00"), Decimal("1.00"))
        october_record.refresh_from_db()
        assert october_record.invoice_id == october.pk
        # Once October is finalized, its late usage is an adjustment on the next invoice drafted.
        invoice_finalize(invoice=october)
        late = record(key, "2026-10-15", prompt=1_000_000, price=p)
        november = invoice_draft(organization=key.organization, period=NOV)
        adjustment = november.lines.get(kind=InvoiceLine.Kind.ADJUSTMENT)
        assert (adjustment.usage_period, adjustment.amount) == (OCT, Decimal("1.00"))
        late.refresh_from_db()
        assert late.invoice_id == november.pk


MOVES = {
    "finalize": lambda invoice: invoice_finalize(invoice=invoice),
    "pay": lambda invoice: invoice_mark_paid(invoice=invoice),
    "void": lambda invoice: invoice_void(invoice=invoice, reason="x"),
    "reissue": lambda invoice: invoice_reissue(invoice=invoice),
}


class TestLifecycle:
    @pytest.fixture
    def draft(self, key, model):
        p = price(model, "2026-09-01", "1", "1")
        record(key, "2026-10-05", prompt=1_000_000, completion=1_000_000, price=p)
        return invoice_draft(organization=key.organization, period=OCT)

    def test_draft_finalized_paid(self, draft):
        finalized = invoice_finalize(invoice=draft)
        assert (finalized.status, finalized.finalized_at is not None) == ("finalized", True)
        paid = invoice_mark_paid(invoice=finalized)
        assert (paid.status, paid.paid_at is not None) == ("paid", True)

    @pytest.mark.parametrize(
        ("moves", "refused"),
        [
            ([], "pay"),  # a draft is not paid
            (["finalize"], "finalize"),  # finalized twice
            (["finalize", "pay"], "void"),  # paid is the end
            (["finalize", "pay"], "reissue"),
            (["void"], "finalize"),  # void is the end
            (["void"], "reissue"),
            (["void"], "void"),
        ],
    )
    def test_illegal_moves_are_refused(self, draft, moves, refused):
        for move in moves:
            MOVES[move](draft)
        state = Invoice.objects.get(pk=draft.pk).status
        with pytest.raises(IllegalTransition):
            MOVES[refused](draft)
        assert Invoice.objects.get(pk=draft.pk).status == state
        assert Invoice.objects.count() == 1

    def test_the_stored_state_decides_not_the_callers_copy(self, draft):
        stale = Invoice.objects.get(pk=draft.pk)
        invoice_finalize(invoice=draft)
        invoice_mark_paid(invoice=draft)
        with pytest.raises(IllegalTransition):
            invoice_void(invoice=stale, reason="stale copy says draft")

    def test_a_finalized_invoice_never_changes(self, draft, key, model):
        finalized = invoice_finalize(invoice=draft)
        frozen = frozen_view(finalized)
        record(key, "2026-10-20", prompt=5_000_000, price=model.prices.get())
        key.organization.tax_rate = Decimal("0.5")
        key.organization.save()
        with pytest.raises(InvoiceFrozen):
            invoice_refresh(invoice=finalized)
        assert invoice_draft(organization=key.organization, period=OCT).pk == finalized.pk
        assert frozen_view(finalized) == frozen
        invoice_mark_paid(invoice=finalized)
        with pytest.raises(InvoiceFrozen):
            invoice_refresh(invoice=finalized)
        paid = frozen_view(finalized)
        assert paid[1:5] + paid[6:] == frozen[1:5] + frozen[6:]  # all but the status and its time

    def test_a_month_is_finalized_only_after_it_ends(self, key):
        current = invoicing.month_start(dt.datetime.now(dt.UTC))
        invoice = invoice_draft(organization=key.organization, period=current)
        with pytest.raises(InvalidInput):
            invoice_finalize(invoice=invoice)

    def test_void_releases_the_usage_to_the_months_next_invoice(self, draft, key):
        held = sorted(draft.usage_records.values_list("pk", flat=True))
        voided = invoice_void(invoice=invoice_finalize(invoice=draft), reason="wrong customer")
        assert (voided.status, voided.void_reason) == ("void", "wrong customer")
        assert voided.lines.exists()  # kept as it was
        assert not voided.usage_records.exists()
        # Its month has no live invoice: the usage waits for the month's own new invoice.
        november = invoice_draft(organization=key.organization, period=dt.date(2026, 11, 1))
        assert not november.usage_records.exists()
        october = invoice_draft(organization=key.organization, period=OCT)
        assert october.pk != voided.pk
        assert sorted(october.usage_records.values_list("pk", flat=True)) == held
        assert {line.kind for line in october.lines.all()} == {"usage"}

    def test_a_void_needs_a_reason(self, draft):
        with pytest.raises(InvalidInput):
            invoice_void(invoice=draft, reason="  ")

    def test_reissue_moves_the_usage_to_the_new_invoice(self, draft, key, model):
        finalized = invoice_finalize(invoice=draft)
        held = sorted(finalized.usage_records.values_list("pk", flat=True))
        extra = record(key, "2026-10-31 12:00", prompt=1_000_000, price=model.prices.get())
        reissued = invoice_reissue(invoice=finalized, reason="tax rate was wrong")
        finalized.refresh_from_db()
        assert (finalized.status, finalized.void_reason) == ("void", "tax rate was wrong")
        assert (reissued.status, reissued.reissue_of_id, reissued.period) == ("draft", finalized.pk, OCT)
        assert reissued.number == finalized.number + 1
        assert sorted(reissued.usage_records.values_list("pk", flat=True)) == sorted([*held, extra.pk])
        assert reissued.subtotal == finalized.subtotal + Decimal("1.00")
        assert invoice_draft(organization=key.organization, period=OCT).pk == reissued.pk


class TestNumbering:
    def test_numbers_follow_the_sequence(self, alice_org, bob_org):
        a = invoice_draft(organization=alice_org, period=SEP)
        b = invoice_draft(organization=bob_org, period=SEP)
        c = invoice_draft(organization=alice_org, period=OCT)
        assert [b.number - a.number, c.number - a.number] == [1, 2]

    def test_concurrent_drafting_leaves_no_gaps_and_no_duplicates(self, django_db_blocker):
        # Real transactions on connections of their own (committed), not a flushing
        # transactional test: a flush would also empty the seeded plans for later tests.
        from tests.support.gateway import committed

        orgs = committed(
            django_db_blocker,
            lambda: [organization_create(name=f"Concurrent {uuid.uuid4().hex[:8]}") for _ in range(4)],
        )
        start = committed(django_db_blocker, lambda: InvoiceSequence.objects.get(name="invoices").next_number)
        barrier = threading.Barrier(8)
        errors: list[BaseException] = []

        def draft(org: Organization, period: dt.date) -> None:
            try:
                barrier.wait(timeout=30)
                invoice_draft(organization=org, period=period)
            except Exception as exc:  # noqa: BLE001 - the assertion below reports it
                errors.append(exc)
            finally:
                connection.close()

        # Two threads per organisation and month: the same invoice asked for twice at once.
        jobs = [(org, period) for org in orgs for period in (SEP, SEP)]
        threads = [threading.Thread(target=draft, args=job) for job in jobs]
        try:
            with django_db_blocker.unblock():
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(timeout=60)
            assert errors == []

            def drafted() -> tuple[list[int], int, int]:
                ours = Invoice.objects.filter(organization__in=orgs)
                numbers = sorted(ours.values_list("number", flat=True))
                return (
                    numbers,
                    ours.filter(period=SEP).count(),
                    InvoiceSequence.objects.get(name="invoices").next_number,
                )

            numbers, in_september, next_number = committed(django_db_blocker, drafted)
            assert numbers == list(range(start, start + len(orgs)))
            assert in_september == len(orgs)
            assert next_number == start + len(orgs)
        finally:

            def clean() -> None:
                Invoice.objects.filter(organization__in=orgs).delete()
                Organization.objects.filter(pk__in=[o.pk for o in orgs]).delete()

            committed(django_db_blocker, clean)


class TestBeatJobAndCommand:
    def test_the_beat_job_drafts_after_the_grace_period_and_not_before(self, settings, key, bob_org, model):
        settings.INVOICE_GRACE_HOURS = 12
        p = price(model, "2026-09-01", "1", "1")
        record(key, "2026-09-30 23:59:59", prompt=1_000_000, price=p)
        assert invoices_draft_due(now="2026-10-01T11:59:59+00:00") == 0
        assert not Invoice.objects.exists()
        assert invoices_draft_due(now="2026-10-01T12:00:00+00:00") == 1  # bob has no usage
        invoice = Invoice.objects.get()
        assert (invoice.organization_id, invoice.period, invoice.status) == (key.organization_id, SEP, "draft")
        assert invoices_draft_due(now="2026-10-01T13:05:00+00:00") == 0  # re-run: nothing new
        invoice_void(invoice=invoice, reason="test")
        assert invoices_draft_due(now="2026-10-02T13:05:00+00:00") == 0  # never undoes a void
        assert Invoice.objects.count() == 1

    def test_the_command_drafts_with_progress(self, key, bob_org, model):
        p = price(model, "2026-09-01", "1", "1")
        record(key, "2026-10-02", prompt=1_000_000, price=p)
        record(api_key_create(organization=bob_org, name="b").api_key, "2026-10-03", prompt=2_000_000, price=p)
        out = io.StringIO()
        call_command("draft_invoices", "--period", "2026-10", stdout=out)
        text = out.getvalue()
        assert "[1/2] Alice Corp: INV-" in text
        assert "[2/2] Bob Ltd: INV-" in text
        assert "2 invoices for 2026-10, totalling 3.00" in text
        out = io.StringIO()
        call_command("draft_invoices", "--period", "2026-10", "--org", "Bob Ltd", stdout=out)
        assert "1 invoices for 2026-10" in out.getvalue()
        assert Invoice.objects.count() == 2

    def test_one_organisation_failing_does_not_stop_the_others(self, key, bob_org, monkeypatch):
        record(key, "2026-10-02", prompt=10)
        record(api_key_create(organization=bob_org, name="b").api_key, "2026-10-03", prompt=10)
        real = invoices_module.invoice_draft

        def failing_for_alice(*, organization, period):
            if organization.pk == key.organization_id:
                raise ValueError("broken")
            return real(organization=organization, period=period)

        monkeypatch.setattr(invoices_module, "invoice_draft", failing_for_alice)
        out = io.StringIO()
        call_command("draft_invoices", "--period", "2026-10", stdout=out)
        assert "[1/2] Alice Corp: FAILED" in out.getvalue()
        assert list(Invoice.objects.values_list("organization__name", flat=True)) == ["Bob Ltd"]

    @pytest.mark.parametrize(
        ("args", "message"),
        [(["--period", "2026-13"], "--period"), (["--org", "Nobody"], "--org"), (["--period", "2199-01"], "--period")],
    )
    def test_the_command_refuses_bad_input_in_one_line(self, args, message):
        with pytest.raises(CommandError, match=message):
            call_command("draft_invoices", *args, stdout=io.StringIO())


class TestEmail:
    def test_finalizing_emails_the_pdf_once(self, key, model, eager_celery, django_capture_on_commit_callbacks):
        key.organization.billing_email = "ap@alice.example"
        key.organization.save()
        record(key, "2026-10-05", prompt=1_000_000, price=price(model, "2026-09-01", "1", "1"))
        invoice = invoice_draft(organization=key.organization, period=OCT)
        assert mail.outbox == []
        with django_capture_on_commit_callbacks(execute=True):
            invoice_finalize(invoice=invoice)
        (message,) = mail.outbox
        assert message.to == ["ap@alice.example"]
        assert f"INV-{invoice.number:06d}" in message.subject
        ((filename, content, mimetype),) = message.attachments
        assert (filename, mimetype) == (f"INV-{invoice.number:06d}-2026-10.pdf", "application/pdf")
        assert content.startswith(b"%PDF")
        with django_capture_on_commit_callbacks(execute=True):
            invoice_mark_paid(invoice=invoice)
            invoice_draft(organization=key.organization, period=OCT)
        assert len(mail.outbox) == 1

    def test_no_billing_email_sends_nothing(self, key, eager_celery, django_capture_on_commit_callbacks, caplog):
        invoice = invoice_draft(organization=key.organization, period=OCT)
        with django_capture_on_commit_callbacks(execute=True):
            invoice_finalize(invoice=invoice)
        assert mail.outbox == []
        assert "no billing email" in caplog.text

    def test_nothing_is_sent_before_commit(self, key, django_capture_on_commit_callbacks):
        key.organization.billing_email = "ap@alice.example"
        key.organization.save()
        invoice = invoice_draft(organization=key.organization, period=OCT)
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            invoice_finalize(invoice=invoice)
        assert len(callbacks) == 1
        assert mail.outbox == []


class TestReconciliation:
    def test_invoiced_equals_repriced_and_a_changed_line_shows(self, key, bob_org, model):
        p = price(model, "2026-09-01", "1.333333", "2")
        for i in range(3):
            record(key, f"2026-10-0{i + 1}", prompt=777_777, completion=3, price=p)
        bob_key = api_key_create(organization=bob_org, name="b").api_key
        record(bob_key, "2026-10-04", prompt=1_000_000, price=p)
        alice = invoice_draft(organization=key.organization, period=OCT)
        invoice_draft(organization=bob_org, period=OCT)
        check = invoiced_usage(period=OCT)
        assert check.ok
        assert (check.invoices, check.records) == (2, 4)
        assert check.invoiced == alice.subtotal + Decimal("1.33")
        assert invoiced_usage(period=OCT, organization=key.organization).invoiced == alice.subtotal
        InvoiceLine.objects.filter(invoice=alice, token_kind="input").update(amount=Decimal("0.01"))
        check = invoiced_usage(period=OCT)
        assert not check.ok
        assert list(check.mismatches) == [alice.number]

    def test_void_invoices_are_not_counted(self, key, model):
        record(key, "2026-10-05", prompt=1_000_000, price=price(model, "2026-09-01", "1", "1"))
        invoice_void(invoice=invoice_draft(organization=key.organization, period=OCT), reason="x")
        check = invoiced_usage(period=OCT)
        assert (check.invoices, check.invoiced, check.priced, check.ok) == (0, Decimal(0), Decimal(0), True)


class TestApi:
    @pytest.fixture
    def world(self, people, key, bob_org, model):
        alice, bob, carol, ml = (people[n] for n in ("alice", "bob", "carol", "ml"))
        org_a = key.organization
        membership_set(user=alice, organization=org_a, role=Role.ORG_ADMIN)
        membership_set(user=carol, organization=org_a, role=Role.ORG_MEMBER)
        membership_set(user=bob, organization=bob_org, role=Role.ORG_ADMIN)
        membership_set(user=ml, organization=platform_organization(), role=Role.PLATFORM_ADMIN)
        p = price(model, "2026-09-01", "1", "1")
        record(key, "2026-10-05", prompt=1_000_000, price=p)
        record(api_key_create(organization=bob_org, name="b").api_key, "2026-10-05", prompt=3_000_000, price=p)
        return {
            "alice": alice,
            "bob": bob,
            "carol": carol,
            "ml": ml,
            "a": org_a,
            "b": bob_org,
            "inv_a": invoice_draft(organization=org_a, period=OCT),
            "inv_b": invoice_draft(organization=bob_org, period=OCT),
        }

    def url(self, world, org="a", invoice="inv_a", action=""):
        base = f"/api/orgs/{world[org].pk}/invoices/"
        if invoice:
            base += f"{world[invoice].pk}/"
        return base + (f"{action}/" if action else "")

    @pytest.mark.parametrize("who", ["alice", "carol", "ml"])
    def test_members_read_their_invoices(self, world, who):
        client = client_for(world[who])
        (listed,) = client.get(self.url(world, invoice="")).json()
        assert (listed["id"], listed["period"], listed["subtotal"]) == (world["inv_a"].pk, "2026-10", "1.00")
        detail = client.get(self.url(world)).json()
        assert [line["amount"] for line in detail["lines"]] == ["1.00"]
        pdf = client.get(self.url(world, action="pdf"))
        assert (pdf.status_code, pdf["Content-Type"]) == (200, "application/pdf")
        assert pdf.content.startswith(b"%PDF")
        assert "attachment" in pdf["Content-Disposition"]
        csv = client.get(self.url(world, action="csv"), HTTP_ACCEPT="text/csv")
        assert (csv.status_code, csv["Content-Type"]) == (200, "text/csv; charset=utf-8")

    def test_a_pdf_can_be_asked_for_by_type(self, world):
        response = client_for(world["carol"]).get(self.url(world, action="pdf"), HTTP_ACCEPT="application/pdf")
        assert response.status_code == 200

    @pytest.mark.parametrize(
        ("method", "org", "invoice", "action"),
        [
            ("get", "b", "", ""),
            ("post", "b", "", ""),
            ("get", "b", "inv_b", ""),
            ("get", "b", "inv_b", "pdf"),
            ("get", "b", "inv_b", "csv"),
            ("post", "b", "inv_b", "finalize"),
            ("post", "b", "inv_b", "void"),
            ("get", "a", "inv_b", ""),  # bob's invoice through alice's organisation
            ("get", "a", "inv_b", "pdf"),
        ],
    )
    def test_other_tenants_get_404(self, world, method, org, invoice, action):
        response = getattr(client_for(world["alice"]), method)(
            self.url(world, org=org, invoice=invoice, action=action), {"period": "2026-10", "reason": "x"}
        )
        assert response.status_code == 404

    @pytest.mark.parametrize("who", ["alice", "carol"])
    @pytest.mark.parametrize("action", ["finalize", "pay", "void", "reissue"])
    def test_only_platform_admins_move_invoices(self, world, who, action):
        response = client_for(world[who]).post(self.url(world, action=action), {"reason": "x"})
        assert response.status_code == 403
        assert Invoice.objects.get(pk=world["inv_a"].pk).status == "draft"

    def test_only_platform_admins_draft(self, world):
        assert client_for(world["alice"]).post(self.url(world, invoice=""), {"period": "2026-09"}).status_code == 403
        ml = client_for(world["ml"])
        created = ml.post(self.url(world, invoice=""), {"period": "2026-09"})
        assert (created.status_code, created.json()["period"], created.json()["status"]) == (201, "2026-09", "draft")
        refreshed = ml.post(self.url(world, invoice=""), {"period": "2026-10"})
        assert (refreshed.status_code, refreshed.json()["id"]) == (200, world["inv_a"].pk)

    @pytest.mark.parametrize("period", ["2026-13", "October", "", "2199-01"])
    def test_a_bad_period_is_a_400(self, world, period):
        response = client_for(world["ml"]).post(self.url(world, invoice=""), {"period": period})
        assert response.status_code == 400
        assert "period" in response.json()

    def test_the_lifecycle_through_the_api(self, world):
        ml = client_for(world["ml"])
        assert ml.post(self.url(world, action="pay")).status_code == 409
        finalized = ml.post(self.url(world, action="finalize"))
        assert (finalized.status_code, finalized.json()["status"]) == (200, "finalized")
        again = ml.post(self.url(world, action="finalize"))
        assert again.status_code == 409
        assert "finalized" in again.json()["detail"]
        assert ml.post(self.url(world, action="void"), {}).status_code == 400  # no reason
        reissued = ml.post(self.url(world, action="reissue"), {"reason": "wrong tax"})
        assert reissued.status_code == 201
        assert (reissued.json()["reissue_of"], reissued.json()["status"]) == (world["inv_a"].pk, "draft")
        old = ml.get(self.url(world)).json()
        assert (old["status"], old["void_reason"], old["reissued_as"]) == ("void", "wrong tax", reissued.json()["id"])
        assert ml.post(self.url(world, action="void"), {"reason": "again"}).status_code == 409

    def test_pay_after_finalize(self, world):
        ml = client_for(world["ml"])
        ml.post(self.url(world, action="finalize"))
        paid = ml.post(self.url(world, action="pay"))
        assert (paid.status_code, paid.json()["status"]) == (200, "paid")
        assert ml.post(self.url(world, action="void"), {"reason": "x"}).status_code == 409

    def test_invoices_cannot_be_edited(self, world):
        ml = client_for(world["ml"])
        assert ml.patch(self.url(world), {"total": "0.00"}, format="json").status_code == 405
        assert ml.delete(self.url(world)).status_code == 405

    def test_the_endpoints_are_in_the_openapi_schema(self, world):
        schema = client_for(world["ml"]).get("/api/schema/").content.decode()
        for path in ("/api/orgs/{org_pk}/invoices/", "/api/orgs/{org_pk}/invoices/{id}/pdf/",
                     "/api/orgs/{org_pk}/invoices/{id}/reissue/"):  # fmt: skip
            assert path in schema


class TestAdmin:
    def test_invoices_and_prices_are_shown_read_only(self, client, django_user_model, key, model):
        admin = django_user_model.objects.create_superuser(username="root", password="pw-1234567890")
        client.force_login(admin)
        record(key, "2026-10-05", prompt=1_000_000, price=price(model, "2026-09-01", "1", "1"))
        invoice = invoice_draft(organization=key.organization, period=OCT)
        for path in ("/admin/billing/invoice/", "/admin/billing/price/", "/admin/accounts/plan/",
                     "/admin/billing/invoiceline/"):  # fmt: skip
            assert client.get(path).status_code == 200, path
        page = client.get(f"/admin/billing/invoice/{invoice.pk}/change/")
        assert page.status_code == 200
        assert b"chat-model, input tokens" in page.content
        assert b'name="_save"' not in page.content  # nothing to save: view only
        assert client.get("/admin/billing/invoice/add/").status_code == 403
        assert client.post(f"/admin/billing/invoice/{invoice.pk}/delete/", {"post": "yes"}).status_code == 403
        assert Invoice.objects.filter(pk=invoice.pk).exists()
