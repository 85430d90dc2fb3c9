"""Reconciliation: the ledger's hourly counts = usage records = hourly rollups, or a flagged row."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from accounts.models import ApiKey
from accounts.services import api_key_create
from billing.models import Reconciliation, UsageRecord
from billing.reconciliation import reconcile, reconcile_due_hours
from billing.rollups import hour_start, rollups_rebuild
from billing.tasks import usage_reconcile
from tests.support.usage_records import count_event, forget_counts, make_record

pytestmark = pytest.mark.django_db

HOUR = timedelta(hours=1)


@pytest.fixture
def hours():
    """Two whole UTC hours three days ago (no other test writes there), their counts forgotten after."""
    start = hour_start(timezone.now()) - timedelta(days=3)
    forget_counts(start, start + HOUR)
    yield start, start + HOUR
    forget_counts(start, start + HOUR)


@pytest.fixture
def keys(alice_org, bob_org) -> tuple[ApiKey, ApiKey]:
    return (
        api_key_create(organization=alice_org, name="a").api_key,
        api_key_create(organization=bob_org, name="b").api_key,
    )


@pytest.fixture
def consistent(hours, keys):
    """Requests in both hours, metered, stored and rolled up the way the platform does."""
    first, second = hours
    a, b = keys
    made = [
        make_record(a, at=first + timedelta(minutes=5), model="x", cost="0.000123", count_in_ledger=True),
        make_record(a, at=first + timedelta(minutes=59), model="y", cost="0.5", count_in_ledger=True),
        make_record(b, at=first + timedelta(minutes=7), model="x", cost="0.25", count_in_ledger=True),
        make_record(b, at=second + timedelta(minutes=1), model="x", cost="1", status=499, count_in_ledger=True),
    ]
    rollups_rebuild(start=first, end=second + HOUR)
    return made


class TestReconcile:
    def test_consistent_data_reconciles_to_zero(self, hours, consistent):
        first, second = hours
        result = reconcile(start=first, end=second + HOUR)
        assert result.ok, result.details
        assert (result.stream_events, result.records, result.rollup_requests) == (4, 4, 4)
        assert result.records_cost == result.rollup_cost == Decimal("1.750123")
        assert result.details == {}
        assert (result.invoiced, result.priced) == (None, None)  # the invoice run's, per month
        assert Reconciliation.objects.filter(pk=result.pk, ok=True).exists()

    def test_one_customers_keys_reconcile_on_their_own(self, hours, keys, consistent):
        first, second = hours
        a, b = keys
        consistent[3].delete()  # b's request of the second hour is lost
        mine = reconcile(start=first, end=second + HOUR, api_key_ids=[a.pk])
        assert mine.ok, mine.details
        assert (mine.stream_events, mine.records, mine.rollup_requests) == (2, 2, 2)
        theirs = reconcile(start=first, end=second + HOUR, api_key_ids=[b.pk])
        assert not theirs.ok
        assert (theirs.stream_events, theirs.records) == (2, 1)

    def test_a_missing_record_is_caught(self, hours, consistent, caplog):
        first, second = hours
        consistent[0].delete()  # metered, never stored (and rolled up before it was lost)
        with caplog.at_level(logging.WARNING, logger="billing.reconciliation"):
            result = reconcile(start=first, end=second + HOUR)
        assert not result.ok
        assert (result.stream_events, result.records, result.rollup_requests) == (4, 3, 4)
        assert result.details["hours"] == [{"hour": first.isoformat(), "stream_events": 3, "records": 2}]
        [group] = result.details["groups"]
        assert group["api_key"] == consistent[0].api_key_id
        assert (group["model"], group["records"], group["rollup_requests"]) == ("x", 0, 1)
        assert Decimal(group["rollup_cost"]) - Decimal(group["records_cost"]) == Decimal("0.000123")
        assert "MISMATCH" in caplog.text

    def test_a_duplicate_record_is_caught(self, hours, consistent):
        first, second = hours
        original = consistent[3]
        # The same request stored twice under another id (a replay that lost its id).
        make_record(original.api_key, at=original.created_at, model="x", cost="1", request_id=uuid.uuid4())
        rollups_rebuild(start=second, end=second + HOUR)  # the rollups agree with the records
        result = reconcile(start=first, end=second + HOUR)
        assert not result.ok
        assert (result.stream_events, result.records, result.rollup_requests) == (4, 5, 5)
        assert result.details == {"hours": [{"hour": second.isoformat(), "stream_events": 1, "records": 2}]}

    def test_rollups_behind_the_records_are_caught(self, hours, keys, consistent):
        first, second = hours
        make_record(keys[0], at=second, model="z", cost="0.1", count_in_ledger=True)  # not rolled up yet
        result = reconcile(start=first, end=second + HOUR)
        assert not result.ok
        assert (result.stream_events, result.records, result.rollup_requests) == (5, 5, 4)
        assert result.rollup_cost + Decimal("0.1") == result.records_cost
        assert result.details["groups"] == [{
            "hour": second.isoformat(), "api_key": keys[0].pk, "model": "z", "records": 1, "rollup_requests": 0,
            "records_cost": "0.100000000000", "rollup_cost": "0",
        }]  # fmt: skip
        rollups_rebuild(start=second, end=second + HOUR)
        assert reconcile(start=first, end=second + HOUR).ok

    def test_a_metered_event_not_yet_stored_is_caught(self, hours, consistent):
        second = hours[1]
        count_event(second)  # settled in Redis; the record never arrived
        result = reconcile(start=second, end=second + HOUR)
        assert not result.ok
        assert result.details == {"hours": [{"hour": second.isoformat(), "stream_events": 2, "records": 1}]}

    @pytest.mark.parametrize(
        ("start", "end"),
        [
            (timedelta(minutes=30), HOUR),  # not on the hour
            (HOUR, HOUR),  # empty
            (HOUR, timedelta(0)),  # backwards
            (-timedelta(days=41), timedelta(0)),  # older than the ledger's counts
        ],
    )
    def test_it_takes_whole_recent_hours_only(self, hours, start, end):
        base = hours[0]
        with pytest.raises(ValueError, match=r"hour|keeps"):
            reconcile(start=base + start, end=base + end)

    def test_naive_times_are_refused(self, hours):
        with pytest.raises(ValueError, match="time zone"):
            reconcile(start=hours[0].replace(tzinfo=None), end=hours[1].replace(tzinfo=None))


class TestScheduled:
    def test_each_hour_is_checked_once_up_to_the_hour_before_last(self):
        now = hour_start(timezone.now()) + timedelta(minutes=20)
        first = reconcile_due_hours(now=now)
        assert [(r.period_start, r.period_end) for r in first] == [(hour_start(now) - 2 * HOUR, hour_start(now) - HOUR)]
        assert reconcile_due_hours(now=now + timedelta(minutes=30)) == []
        later = reconcile_due_hours(now=now + 3 * HOUR)
        assert [r.period_start for r in later] == [hour_start(now) - HOUR, hour_start(now), hour_start(now) + HOUR]

    def test_the_task_checks_an_hour_by_hand(self, hours, consistent):
        assert usage_reconcile(hour=hours[0].isoformat()) == 0
        UsageRecord.objects.filter(pk=consistent[0].pk).delete()
        assert usage_reconcile(hour=hours[0].isoformat()) == 1
        assert Reconciliation.objects.filter(period_start=hours[0]).count() == 2


class TestWholeMonth:
    def test_a_month_with_its_invoices_reconciles_and_a_tampered_line_is_caught(self, keys, monkeypatch):
        from datetime import date

        from billing.models import InvoiceLine
        from billing.reconciliation import reconcile_month
        from billing.rollups import rollups_rebuild
        from billing.services import invoice_draft
        from tests.support.invoices import at, chat_model, price, record
        from tests.support.usage_records import count_event

        # "Now" is the 2nd of the next month, when the job runs: the ledger's counts still exist.
        october = date(2026, 10, 1)
        monkeypatch.setattr("billing.reconciliation.timezone.now", lambda: at("2026-11-02 06:30:00"))
        key = keys[0]
        p = price(chat_model(), "2026-10-01 00:00:00", "1.5", "4")
        for when, prompt, completion in (("2026-10-01 00:00:00", 10**6, 5), ("2026-10-31 23:59:59", 7, 700_000)):
            record(key, when, prompt=prompt, completion=completion, price=p)
            count_event(at(when))
        rollups_rebuild(start=at("2026-10-01 00:00:00"), end=at("2026-11-01 00:00:00"))
        invoice = invoice_draft(organization=key.organization, period=october)

        result = reconcile_month(period=october)
        assert (result.ok, result.stream_events, result.records, result.rollup_requests) == (True, 2, 2, 2)
        assert result.invoiced == result.priced == invoice.subtotal > 0

        line = InvoiceLine.objects.filter(invoice=invoice, kind="usage").first()
        InvoiceLine.objects.filter(pk=line.pk).update(amount=line.amount + 1)  # planted: not through a service
        tampered = reconcile_month(period=october)
        assert not tampered.ok
        assert str(invoice.number) in tampered.details["invoices"]
        assert tampered.invoiced == tampered.priced + 1

    def test_a_record_billed_in_the_wrong_month_is_flagged(self, keys, monkeypatch):
        """Defect 4 of issue 18: a record of a month whose invoice was not finalized, held by
        another month's invoice (as drafting did before the fix), fails the reconciliation."""
        from datetime import date

        from billing.models import UsageRecord
        from billing.reconciliation import reconcile_month
        from billing.services import invoice_draft
        from tests.support.invoices import at, chat_model, price, record
        from tests.support.usage_records import count_event

        november = date(2026, 11, 1)
        monkeypatch.setattr("billing.reconciliation.timezone.now", lambda: at("2026-12-02 06:30:00"))
        key = keys[0]
        p = price(chat_model(), "2026-10-01 00:00:00", "1", "1")
        stray = record(key, "2026-10-20 10:00:00", prompt=10, price=p)
        count_event(at("2026-10-20 10:00:00"))
        invoice = invoice_draft(organization=key.organization, period=november)
        assert reconcile_month(period=november).ok  # it left October's record alone
        UsageRecord.objects.filter(pk=stray.pk).update(invoice=invoice)  # planted: what the old drafting did
        flagged = reconcile_month(period=november)
        assert not flagged.ok
        assert [r["request_id"] for r in flagged.details["misbilled"]] == [str(stray.request_id)]

    def test_a_month_not_over_is_refused(self):
        from datetime import date

        from django.utils import timezone

        from billing.reconciliation import reconcile_month

        with pytest.raises(ValueError, match="has not ended"):
            reconcile_month(period=date(timezone.now().year, timezone.now().month, 1))
