"""Usage rollups: exact numbers and percentiles, re-runs that change nothing, late records,
ids committed out of order, UTC hour/day/month/year boundaries; the daily usage selectors."""

from __future__ import annotations

import importlib
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.db.models import F

from accounts.models import ApiKey
from accounts.services import api_key_create
from billing.models import Price, RollupProgress, UsageRecord, UsageRollup
from billing.rollups import CANDIDATE, WATERMARK, WATERMARK_LAG, rollups_build, rollups_rebuild
from billing.tasks import usage_rollups_build
from billing.usage_selectors import (
    InvalidCursor,
    UsageCursor,
    usage_daily_for_key,
    usage_daily_for_organization,
    usage_window,
)
from billing.usage_series import usage_overview
from core import sketch
from registry.models import Model
from tests.support.usage_records import make_record

pytestmark = pytest.mark.django_db

HOUR = timedelta(hours=1)
T0 = datetime(2026, 3, 10, 14, 0, tzinfo=UTC)  # the hour most tests write into
RUN = datetime(2026, 3, 11, 9, 0, tzinfo=UTC)  # when the builds "run" (the watermark's clock)
VALUES = [
    "requests", "errors", "cancelled", "input_tokens", "output_tokens", "cached_tokens", "cost", "latency_p50_ms",
    "latency_p95_ms", "latency_p99_ms", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "organization_id",
]  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_progress() -> None:
    """Each test starts from an empty watermark (committed records of other tests, if any,
    are rolled up too; assertions look at this test's keys only)."""
    RollupProgress.objects.all().delete()


@pytest.fixture
def key(alice_org) -> ApiKey:
    return api_key_create(organization=alice_org, name="k1").api_key


@pytest.fixture
def other_key(alice_org) -> ApiKey:
    return api_key_create(organization=alice_org, name="k2").api_key


def rows(api_key: ApiKey, period: str = "hour") -> list[dict[str, Any]]:
    return list(
        UsageRollup.objects.filter(api_key=api_key, period=period)
        .order_by("start", "model", "model_version", "price_id")
        .values("id", "start", "model", "model_version", "price_id", "updated_at", *VALUES)
    )


def one(api_key: ApiKey, period: str = "hour", **match: Any) -> UsageRollup:
    return UsageRollup.objects.get(api_key=api_key, period=period, **match)


class TestNumbers:
    def test_it_sums_a_bucket_and_takes_percentiles_in_sql(self, key):
        # 100 requests: latency 1..100 ms, TTFT 1..50 ms on the first 50 (none on the rest),
        # five errors (4xx, 5xx, 499), prompt 10 of which 3 cached, 5 completion tokens.
        for i in range(1, 101):
            make_record(
                key, at=T0 + timedelta(seconds=i), prompt=10, cached=3, completion=5, latency=i,
                ttft=i if i <= 50 else None, status=(400, 429, 499, 500, 502)[i % 5] if i <= 5 else 200,
                cost="0.000001234",
            )  # fmt: skip
        report = rollups_build(now=RUN)
        assert T0 in report.hours
        assert T0.replace(hour=0) in report.days
        hour = one(key, start=T0)
        assert (hour.requests, hour.errors, hour.cancelled) == (100, 4, 1)  # the 499 is a client's cancel
        assert (hour.input_tokens, hour.output_tokens, hour.cached_tokens) == (700, 500, 300)
        assert hour.cost == Decimal("0.0001234")
        assert hour.organization_id == key.organization_id
        # percentile_disc: the first value whose cumulative share reaches the fraction.
        assert (hour.latency_p50_ms, hour.latency_p95_ms, hour.latency_p99_ms) == (50, 95, 99)
        assert (hour.ttft_p50_ms, hour.ttft_p95_ms, hour.ttft_p99_ms) == (25, 48, 50)
        day = one(key, "day", start=T0.replace(hour=0))
        assert [getattr(day, f) for f in VALUES] == [getattr(hour, f) for f in VALUES]
        # The distributions, mergeable: every request counted once, percentiles within 1 %.
        latency, ttft = sketch.parse(hour.latency_histogram), sketch.parse(hour.ttft_histogram)
        assert (sketch.count(latency), sketch.count(ttft)) == (100, 50)
        assert sketch.quantile(latency, 0.99) == pytest.approx(99, rel=sketch.RELATIVE_ERROR)
        assert sketch.quantile(ttft, 0.5) == pytest.approx(25, rel=sketch.RELATIVE_ERROR)
        assert (day.latency_histogram, day.ttft_histogram) == (hour.latency_histogram, hour.ttft_histogram)

    def test_two_keys_merged_give_the_percentile_of_all_their_requests(self, key, other_key):
        for i in range(1, 91):
            make_record(key, at=T0 + timedelta(seconds=i), latency=10 + i % 7)  # fast
        for i in range(1, 11):
            make_record(other_key, at=T0 + timedelta(seconds=i), latency=2000 + 100 * i)  # slow
        rollups_build(now=RUN)
        merged = sketch.merge(sketch.parse(one(k, start=T0).latency_histogram) for k in (key, other_key))
        # percentile_disc over the 100 requests: rank 99 is the 9th slow one (2,900 ms).
        assert sketch.quantile(merged, 0.99) == pytest.approx(2900, rel=sketch.RELATIVE_ERROR)
        weighted = (one(key, start=T0).latency_p99_ms * 90 + one(other_key, start=T0).latency_p99_ms * 10) / 100
        assert weighted < 400  # the mean of the keys' p99s the overview used to show

    def test_each_key_model_version_and_price_has_its_own_row(self, key, other_key):
        model = Model.objects.create(name="priced-model", task="chat")
        price = Price.objects.create(
            model=model, input_per_million=Decimal(1), output_per_million=Decimal(2),
            cached_input_per_million=Decimal("0.5"), currency="USD", effective_from=T0 - HOUR,
        )  # fmt: skip
        make_record(key, at=T0, model="a", version="1")
        make_record(key, at=T0, model="a", version="2")
        make_record(key, at=T0, model="a", version="2", price=price, cost="0.000020")
        make_record(key, at=T0, model="b", version="1")
        make_record(other_key, at=T0, model="a", version="1", status=500, ttft=None)
        rollups_build(now=RUN)
        found = [(r["model"], r["model_version"], r["price_id"], r["requests"]) for r in rows(key)]
        assert found == [("a", "1", None, 1), ("a", "2", price.pk, 1), ("a", "2", None, 1), ("b", "1", None, 1)]
        other = one(other_key, start=T0)
        assert (other.requests, other.errors, other.ttft_p50_ms) == (1, 1, None)
        assert one(key, start=T0, price=price).cost == Decimal("0.000020")

    def test_batch_lines_have_rows_of_their_own_and_their_share_in_the_daily_usage(self, key):
        make_record(key, at=T0, model="a", cost="0.000010")
        make_record(key, at=T0, model="a", cost="0.000004", batch=True)
        make_record(key, at=T0 + HOUR, model="a", cost="0.000004", batch=True)
        rollups_build(now=RUN)
        hourly = UsageRollup.objects.filter(api_key=key, period="hour", start=T0).order_by("batch")
        assert [(r.batch, r.requests, r.cost) for r in hourly] == [
            (False, 1, Decimal("0.000010")), (True, 1, Decimal("0.000004")),
        ]  # fmt: skip
        [day] = usage_daily_for_key(api_key_id=key.pk, start=T0.date(), end=T0.date()).rows
        assert (day.requests, day.cost, day.batch_requests, day.batch_cost) == (
            3, Decimal("0.000018"), 2, Decimal("0.000008"),
        )  # fmt: skip

    def test_input_tokens_never_go_below_zero(self, key):
        make_record(key, at=T0, prompt=3, cached=5)  # an engine that reported more cached than prompt
        rollups_build(now=RUN)
        assert (one(key, start=T0).input_tokens, one(key, start=T0).cached_tokens) == (0, 5)


class TestRebuilding:
    def test_a_second_run_changes_nothing(self, key):
        for i in range(5):
            make_record(key, at=T0 + timedelta(minutes=20 * i), latency=10 * i)
        rollups_build(now=RUN)
        before = rows(key), rows(key, "day")
        again = rollups_build(now=RUN + timedelta(seconds=60))
        assert again.rows_written == 0
        assert again.rows_removed == 0
        assert (rows(key), rows(key, "day")) == before  # same ids, same updated_at

    def test_the_task_builds_too(self, key):
        make_record(key, at=T0)
        assert usage_rollups_build() >= 2  # the hour and the day
        assert one(key, start=T0).requests == 1

    def test_a_late_record_rebuilds_its_old_hour_and_day(self, key):
        make_record(key, at=T0)
        make_record(key, at=T0 + 5 * HOUR)
        rollups_build(now=RUN)
        untouched = one(key, start=T0 + 5 * HOUR)
        # Admitted hours ago, persisted only now (settled after a Redis outage, say).
        make_record(key, at=T0 + timedelta(minutes=30), completion=7)
        report = rollups_build(now=RUN + timedelta(minutes=1))
        assert T0 in report.hours
        assert one(key, start=T0).requests == 2
        assert one(key, start=T0).output_tokens == 12
        assert one(key, "day", start=T0.replace(hour=0)).requests == 3
        assert one(key, start=T0 + 5 * HOUR).updated_at == untouched.updated_at

    def test_a_late_record_after_the_watermark_moved_on(self, key):
        make_record(key, at=T0)
        for minutes in (0, 6, 12):  # the watermark passes the first record
            rollups_build(now=RUN + timedelta(minutes=minutes))
        assert RollupProgress.objects.get(name=WATERMARK).last_record_id >= UsageRecord.objects.get(api_key=key).pk
        make_record(key, at=T0 - 30 * HOUR)  # the day before
        report = rollups_build(now=RUN + timedelta(minutes=13))
        assert report.hours == (T0 - 30 * HOUR,)
        assert one(key, "day", start=(T0 - 30 * HOUR).replace(hour=0)).requests == 1
        assert one(key, "day", start=T0.replace(hour=0)).requests == 1

    def test_rows_a_bucket_no_longer_has_are_removed(self, key):
        record = make_record(key, at=T0, model="gone")
        make_record(key, at=T0, model="stays")
        rollups_build(now=RUN)
        record.delete()  # (records are never deleted; a repair of bad data might)
        report = rollups_rebuild(start=T0, end=T0 + HOUR)
        assert report.rows_removed == 2  # the hour's row and the day's
        assert [r["model"] for r in rows(key)] == ["stays"]
        assert [r["model"] for r in rows(key, "day")] == ["stays"]

    def test_rebuild_needs_aware_times(self):
        with pytest.raises(ValueError, match="time zone"):
            rollups_rebuild(start=datetime(2026, 1, 1), end=datetime(2026, 1, 2))  # noqa: DTZ001


class TestOutOfOrderIds:
    """A lower id that becomes visible after a higher one was read (its transaction
    committed later) is still rolled up: the watermark trails by WATERMARK_LAG."""

    def test_a_lower_id_committed_late_is_rolled_up(self, key):
        first = make_record(key, at=T0)
        middle = make_record(key, at=T0 - 20 * HOUR, completion=9)  # late, too
        last = make_record(key, at=T0)
        assert first.pk < middle.pk < last.pk
        # The middle id is taken but not visible yet: its transaction has not committed.
        saved = {f.attname: getattr(middle, f.attname) for f in UsageRecord._meta.concrete_fields}
        middle.delete()
        rollups_build(now=RUN)
        assert RollupProgress.objects.get(name=CANDIDATE).last_record_id >= last.pk
        assert not UsageRollup.objects.filter(api_key=key, start=T0 - 20 * HOUR).exists()
        # It commits a moment later, below the highest id already read.
        UsageRecord.objects.create(**saved)
        report = rollups_build(now=RUN + WATERMARK_LAG - timedelta(seconds=1))
        assert T0 - 20 * HOUR in report.hours
        assert one(key, start=T0 - 20 * HOUR).output_tokens == 9
        assert one(key, "day", start=(T0 - 20 * HOUR).replace(hour=0)).requests == 1
        assert one(key, start=T0).requests == 2

    @pytest.mark.parametrize(("lag", "rolled_up"), [(WATERMARK_LAG, True), (timedelta(0), False)])
    def test_the_lag_is_what_saves_it(self, key, lag, rolled_up):
        make_record(key, at=T0)
        middle = make_record(key, at=T0 - 20 * HOUR)
        make_record(key, at=T0)
        saved = {f.attname: getattr(middle, f.attname) for f in UsageRecord._meta.concrete_fields}
        middle.delete()
        rollups_build(now=RUN, lag=lag)
        rollups_build(now=RUN + timedelta(minutes=1), lag=lag)  # a run before it commits
        UsageRecord.objects.create(**saved)
        rollups_build(now=RUN + timedelta(minutes=2), lag=lag)
        # Without the lag the watermark was already past it: the hazard is real.
        assert UsageRollup.objects.filter(api_key=key, start=T0 - 20 * HOUR).exists() is rolled_up

    def test_the_watermark_moves_only_past_ids_seen_lag_ago(self, key):
        record = make_record(key, at=T0)
        watermark = RollupProgress.objects.filter(name=WATERMARK)
        assert rollups_build(now=RUN).watermark == 0  # candidate noted at RUN
        assert rollups_build(now=RUN + WATERMARK_LAG - timedelta(seconds=1)).watermark == 0
        assert watermark.get().last_record_id == 0
        report = rollups_build(now=RUN + WATERMARK_LAG)
        assert report.watermark >= record.pk
        assert watermark.get().last_record_id == report.watermark
        # Records past the watermark are read again on each run until it passes them.
        assert rollups_build(now=RUN + WATERMARK_LAG + timedelta(minutes=1)).records_read == 0


class TestUtcBoundaries:
    def test_hour_day_month_and_year_are_utc(self, key):
        plus_two = timezone(timedelta(hours=2))
        make_record(key, at=datetime(2026, 12, 31, 23, 59, 59, 999999, tzinfo=UTC))
        make_record(key, at=datetime(2027, 1, 1, 1, 30, tzinfo=plus_two))  # 2026-12-31 23:30 UTC
        make_record(key, at=datetime(2027, 1, 1, 0, 0, tzinfo=UTC))
        make_record(key, at=datetime(2026, 11, 30, 23, 30, tzinfo=UTC))
        make_record(key, at=datetime(2026, 12, 1, 0, 10, tzinfo=UTC))
        rollups_build(now=RUN)
        hours = {(r["start"], r["requests"]) for r in rows(key)}
        assert hours == {
            (datetime(2026, 11, 30, 23, tzinfo=UTC), 1),
            (datetime(2026, 12, 1, 0, tzinfo=UTC), 1),
            (datetime(2026, 12, 31, 23, tzinfo=UTC), 2),
            (datetime(2027, 1, 1, 0, tzinfo=UTC), 1),
        }
        days = {(r["start"], r["requests"]) for r in rows(key, "day")}
        assert days == {
            (datetime(2026, 11, 30, tzinfo=UTC), 1),
            (datetime(2026, 12, 1, tzinfo=UTC), 1),
            (datetime(2026, 12, 31, tzinfo=UTC), 2),
            (datetime(2027, 1, 1, tzinfo=UTC), 1),
        }
        year_end = usage_daily_for_key(api_key_id=key.pk, start=date(2026, 12, 31), end=date(2026, 12, 31))
        assert [(r.date, r.requests) for r in year_end.rows] == [(date(2026, 12, 31), 2)]


class TestSelectors:
    @pytest.fixture
    def week(self, key, other_key):
        """Three days of two models for ``key`` (two versions of "b" on the second day), one
        day for ``other_key``."""
        for day in range(3):
            at = datetime(2026, 5, 1 + day, 12, tzinfo=UTC)
            make_record(key, at=at, model="a", cost="0.5")
            make_record(key, at=at, model="b", cost="0.25")
        make_record(key, at=datetime(2026, 5, 2, 13, tzinfo=UTC), model="b", version="2", status=503)
        make_record(other_key, at=datetime(2026, 5, 2, 12, tzinfo=UTC), model="a")
        rollups_build(now=RUN)

    def test_a_key_sees_its_days_and_models_in_pages(self, key, week):
        window = {"api_key_id": key.pk, "start": date(2026, 5, 1), "end": date(2026, 5, 3)}
        first = usage_daily_for_key(**window, limit=4)
        assert first.has_more
        rest = usage_daily_for_key(**window, limit=4, after=UsageCursor.decode(first.next_page.encode()))
        assert not rest.has_more
        assert rest.next_page is None
        found = [(r.date.day, r.model, r.requests, r.errors) for r in first.rows + rest.rows]
        assert found == [(1, "a", 1, 0), (1, "b", 1, 0), (2, "a", 1, 0), (2, "b", 2, 1), (3, "a", 1, 0), (3, "b", 1, 0)]
        assert first.rows[0].cost == Decimal("0.5")

    def test_dates_are_inclusive(self, key, week):
        page = usage_daily_for_key(api_key_id=key.pk, start=date(2026, 5, 2), end=date(2026, 5, 2))
        assert {r.date for r in page.rows} == {date(2026, 5, 2)}

    def test_an_organisation_sees_every_key(self, key, other_key, week):
        page = usage_daily_for_organization(
            organization_id=key.organization_id, start=date(2026, 5, 2), end=date(2026, 5, 2), limit=2
        )
        more = usage_daily_for_organization(
            organization_id=key.organization_id, start=date(2026, 5, 2), end=date(2026, 5, 2), after=page.next_page
        )
        found = [(r.model, r.api_key_id, r.requests) for r in page.rows + more.rows]
        first, second = sorted([key.pk, other_key.pk])
        assert found == [("a", first, 1), ("a", second, 1), ("b", key.pk, 2)]
        assert page.rows[0].api_key_name in {"k1", "k2"}
        only = usage_daily_for_organization(
            organization_id=key.organization_id, start=date(2026, 5, 2), end=date(2026, 5, 2), api_key_id=other_key.pk
        )
        assert [(r.model, r.api_key_id) for r in only.rows] == [("a", other_key.pk)]
        whole = usage_daily_for_organization(
            organization_id=key.organization_id, start=date(2026, 5, 2), end=date(2026, 5, 2), by_key=False
        )
        assert [(r.model, r.requests) for r in whole.rows] == [("a", 2), ("b", 2)]

    def test_another_organisation_sees_nothing(self, bob_org, week):
        page = usage_daily_for_organization(organization_id=bob_org.pk, start=date(2026, 5, 1), end=date(2026, 5, 3))
        assert page.rows == []

    @pytest.mark.parametrize("text", ["", "nope", "W10=", "WyIyMDI2LTA1LTAxIl0", "WzEsMiwzXQ"])
    def test_a_forged_cursor_is_refused(self, text):
        with pytest.raises(InvalidCursor):
            UsageCursor.decode(text)

    def test_the_default_window_is_thirty_days_to_today(self):
        today = date(2026, 3, 1)
        assert usage_window(start=None, end=None, today=today) == (date(2026, 1, 31), today)
        assert usage_window(start=date(2026, 2, 20), end=None, today=today) == (date(2026, 2, 20), today)
        with pytest.raises(ValueError, match="after"):
            usage_window(start=date(2026, 3, 2), end=None, today=today)


class TestClientCancels:
    """A client's cancel (status 499, ``client_closed``: the playground's Stop, a closed
    connection) is not the server's error: its own count, in no error rate (issue 34, defect 12)."""

    @pytest.fixture
    def stopped(self, key):
        """The audit's case: a chat model with 26 requests, every one stopped by its client."""
        for i in range(26):
            make_record(key, at=T0 + timedelta(seconds=i), model="chat", status=499, error_code="client_closed")
        rollups_build(now=RUN)

    def test_the_rollup_counts_cancels_apart_from_errors(self, key, stopped):
        hour, day = one(key, start=T0), one(key, "day", start=T0.replace(hour=0))
        for row in (hour, day):
            assert (row.requests, row.errors, getattr(row, "cancelled", None)) == (26, 0, 26)

    def test_the_usage_readers_say_so(self, key, stopped):
        [row] = usage_daily_for_key(api_key_id=key.pk, start=T0.date(), end=T0.date()).rows
        assert (row.requests, row.errors, getattr(row, "cancelled", None)) == (26, 0, 26)
        total = usage_overview(range_key="day", now=T0 + HOUR).total
        assert (total.requests, total.errors, getattr(total, "cancelled", None)) == (26, 0, 26)
        assert total.error_rate in (None, 0.0)  # nothing the server decided failed

    def test_a_cancel_is_in_neither_side_of_the_error_rate(self, key):
        # 10 answered, 2 failed (a 400 and a 502), 28 cancelled: 2 of the 12 requests the server decided.
        for i, status in enumerate([200] * 10 + [400, 502] + [499] * 28):
            make_record(key, at=T0 + timedelta(seconds=i), status=status)
        rollups_build(now=RUN)
        hour = one(key, start=T0)
        assert (hour.requests, hour.errors, getattr(hour, "cancelled", None)) == (40, 2, 28)
        total = usage_overview(range_key="day", now=T0 + HOUR).total
        assert total.error_rate == pytest.approx(2 / 12)

    def test_the_migration_recounts_rollups_built_before(self, key, other_key):
        """Billing migration 0015's frozen SQL: rows built when errors counted cancels are recounted
        from their records; rows without a cancel are left alone; going back restores them."""
        for i, status in enumerate([200] * 5 + [502] + [499] * 7):
            make_record(key, at=T0 + timedelta(seconds=i), status=status)
        make_record(other_key, at=T0, status=500)
        rollups_build(now=RUN)
        built = rows(key, "hour") + rows(key, "day") + rows(other_key, "hour")
        # As the rollups were before: errors counted the cancels, and there was no cancelled count.
        UsageRollup.objects.update(errors=F("errors") + F("cancelled"), cancelled=0)
        assert one(key, start=T0).errors == 8
        migration = importlib.import_module("billing.migrations.0015_rollup_cancelled")
        with connection.cursor() as cursor:
            cursor.execute(migration._RECOUNT)
        assert rows(key, "hour") + rows(key, "day") + rows(other_key, "hour") == built
        with connection.cursor() as cursor:
            cursor.execute(migration._UNCOUNT)
        assert (one(key, start=T0).errors, one(other_key, start=T0).errors) == (8, 1)
