"""Limits that hold exactly across gateway processes: real Redis, real daphne, a fake engine."""

from __future__ import annotations

import calendar
import math
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx
import pytest

from tests.support.gateway import chat, committed, persisted, price_model
from tests.support.processes import start_gateway

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def gateways(django_db_setup, tmp_path_factory):
    """Two independent gateway processes on the same Redis and database."""
    base = tmp_path_factory.mktemp("limit-gateways")
    env = {"REPLICA_STALE_AFTER": "86400", "ROUTING_REFRESH_SECONDS": "0.2"}
    pair = [start_gateway(base, **env), start_gateway(base, **env)]
    yield pair
    for gateway in pair:
        gateway.stop()


@pytest.fixture
def test_clock():
    """Set the limiter's clock (tests only: LIMITS_TEST_CLOCK); real Redis TIME again after."""
    from core import keys
    from core.redis import sync_redis

    clock = keys.limiter_test_clock()
    yield lambda when: sync_redis().set(clock, f"{when:.3f}")
    sync_redis().delete(clock)


def get_models(gateway, secret):
    return httpx.get(f"{gateway.base_url}/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10)


class TestRequestsPerMinute:
    def test_two_gateways_admit_exactly_the_limit(self, gateways, fake_model, make_api_key, test_clock):
        key = make_api_key(rate_limit_rpm=20, rate_limit_tpm=10_000_000)
        fake_model.control(mode="normal", tokens=2, delay=0)
        # The bucket refills one request every 3 s at 20/min. Freezing the limiter's clock
        # makes the count independent of how long this machine takes to send 200 requests.
        test_clock(time.time())

        def one(i: int) -> httpx.Response:
            return chat(gateways[i % 2], key.secret, fake_model.name, max_tokens=2)

        with ThreadPoolExecutor(max_workers=40) as pool:
            responses = list(pool.map(one, range(200)))
        statuses = [r.status_code for r in responses]
        assert statuses.count(200) == 20, {r.json()["error"]["message"] for r in responses if r.status_code != 200}
        assert statuses.count(429) == 180
        assert statuses.count(429) == 180
        assert fake_model.requests() == 20  # refused ones were never dispatched
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.json()["error"]["type"] == "rate_limit_exceeded"
        assert 1 <= int(refused.headers["retry-after"]) <= 3
        assert refused.headers["x-ratelimit-limit-requests"] == "20"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"

    def test_headers_count_down_and_retry_after_is_right(self, gateways, fake_model, make_api_key):
        key = make_api_key(rate_limit_rpm=5, rate_limit_tpm=1_000_000)
        fake_model.control(mode="normal", tokens=1, delay=0)
        remaining = []
        for i in range(5):
            response = chat(gateways[i % 2], key.secret, fake_model.name, max_tokens=1)
            assert response.status_code == 200
            remaining.append(response.headers["x-ratelimit-remaining-requests"])
            assert response.headers["x-ratelimit-limit-requests"] == "5"
        assert remaining == ["4", "3", "2", "1", "0"]
        refused = chat(gateways[0], key.secret, fake_model.name, max_tokens=1)
        assert refused.status_code == 429
        # One request comes back every 12 s; a little of that has passed already.
        assert 10 <= int(refused.headers["retry-after"]) <= 12
        reset = refused.headers["x-ratelimit-reset-requests"]
        assert reset.endswith("s")
        assert 50 <= _seconds(reset) <= 60

    def test_every_answer_carries_the_headers(self, gateways, fake_model, make_api_key):
        key = make_api_key(rate_limit_rpm=100, rate_limit_tpm=50_000)
        listing = get_models(gateways[0], key.secret)
        invalid = chat(gateways[0], key.secret, fake_model.name, temperature="hot")
        for response in (listing, invalid):
            assert response.headers["x-ratelimit-limit-requests"] == "100"
            assert response.headers["x-ratelimit-limit-tokens"] == "50000"
            assert "x-ratelimit-remaining-tokens" in response.headers
            assert "x-ratelimit-reset-tokens" in response.headers


def _seconds(duration: str) -> float:
    if duration.endswith("ms"):
        return float(duration[:-2]) / 1000
    if "m" in duration:
        minutes, seconds = duration.rstrip("s").split("m")
        return int(minutes) * 60 + float(seconds)
    return float(duration.rstrip("s"))


class TestTokensPerMinute:
    def test_a_request_that_cannot_fit_is_refused_up_front(self, gateways, fake_model, make_api_key):
        key = make_api_key(rate_limit_rpm=1000, rate_limit_tpm=1000)
        fake_model.control(mode="normal", tokens=5, delay=0.3)
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(chat, gateways[0], key.secret, fake_model.name, max_tokens=600, stream=True)
            time.sleep(0.5)  # admitted and running: 600 + prompt reserved
            second = chat(gateways[1], key.secret, fake_model.name, max_tokens=600)
            assert second.status_code == 429
            assert second.json()["error"]["code"] == "rate_limit_exceeded"
            assert "tokens per minute" in second.json()["error"]["message"]
            assert first.result().status_code == 200
        assert fake_model.requests() == 1

    def test_the_unused_reservation_is_returned(self, gateways, fake_model, make_api_key):
        key = make_api_key(rate_limit_rpm=1000, rate_limit_tpm=1000)
        fake_model.control(mode="normal", tokens=5, delay=0)
        answer = chat(gateways[0], key.secret, fake_model.name, max_tokens=900)
        assert answer.status_code == 200
        # Charged when admitted: the prompt + 900. Settled: the prompt + 5 actually used.
        assert int(answer.headers["x-ratelimit-remaining-tokens"]) < 100
        after = int(get_models(gateways[1], key.secret).headers["x-ratelimit-remaining-tokens"])
        used = answer.json()["usage"]["total_tokens"]
        assert 1000 - used - 2 <= after <= 1000

    def test_larger_than_the_limit_itself(self, gateways, fake_model, make_api_key):
        key = make_api_key(rate_limit_rpm=1000, rate_limit_tpm=500)
        response = chat(gateways[0], key.secret, fake_model.name, max_tokens=800)
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "request_too_large"
        assert fake_model.requests() == 0


class TestConcurrency:
    def test_concurrent_requests_are_capped_and_released(self, gateways, fake_model, make_api_key):
        key = make_api_key(rate_limit_rpm=1000, rate_limit_tpm=1_000_000, max_concurrent=2)
        fake_model.control(mode="normal", tokens=4, delay=0.25)
        with ThreadPoolExecutor(max_workers=3) as pool:
            running = [pool.submit(chat, gateways[i], key.secret, fake_model.name, stream=True) for i in range(2)]
            time.sleep(0.4)
            third = chat(gateways[0], key.secret, fake_model.name)
            assert third.status_code == 429
            assert "concurrent" in third.json()["error"]["message"]
            assert [f.result().status_code for f in running] == [200, 200]
        assert chat(gateways[1], key.secret, fake_model.name).status_code == 200


class TestBudgets:
    def test_fifty_concurrent_requests_overshoot_by_at_most_one_reservation(self, gateways, fake_model, make_api_key):
        key = make_api_key(rate_limit_rpm=10_000, rate_limit_tpm=10_000_000, monthly_token_quota=1000)
        fake_model.control(mode="normal", tokens=100, delay=0)

        def one(i: int) -> httpx.Response:
            return chat(gateways[i % 2], key.secret, fake_model.name, max_tokens=100)

        with ThreadPoolExecutor(max_workers=50) as pool:
            responses = list(pool.map(one, range(50)))
        admitted = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert {r.status_code for r in refused} == {429}
        assert {r.json()["error"]["code"] for r in refused} == {"insufficient_quota"}
        assert fake_model.requests() == len(admitted)
        records = persisted([r.headers["x-request-id"] for r in admitted])
        used = sum(r.total_tokens for r in records.values())
        # What one such request reserves at admission, read off a fresh key's TPM bucket.
        probe = make_api_key(rate_limit_rpm=10_000, rate_limit_tpm=10_000_000)
        charged = chat(gateways[0], probe.secret, fake_model.name, max_tokens=100)
        reservation = 10_000_000 - int(charged.headers["x-ratelimit-remaining-tokens"])
        assert reservation >= max(r.json()["usage"]["total_tokens"] for r in admitted)
        assert used <= 1000 + reservation
        assert len(admitted) >= 1000 // reservation  # and the budget was not left unused either

    def test_a_soft_alert_is_recorded_once(self, gateways, fake_model, make_api_key):
        from billing.models import BudgetAlert
        from billing.usage import persist_budget_alerts

        key = make_api_key(monthly_token_quota=1000, budget_alert_percent=30, rate_limit_tpm=1_000_000)
        fake_model.control(mode="normal", tokens=200, delay=0)  # 203 used a request, plus the next one reserved
        for _ in range(4):
            assert chat(gateways[0], key.secret, fake_model.name, max_tokens=200).status_code == 200
        persist_budget_alerts()
        persist_budget_alerts()  # nothing twice
        alerts = BudgetAlert.objects.filter(api_key_id=key.key_id).order_by("threshold_percent")
        # Its own 30 %, then 50 % and 80 % (used + reserved crosses them); never 100 % here.
        assert [a.threshold_percent for a in alerts] == [30, 50, 80]
        assert {(a.budget, a.limit, a.month) for a in alerts} == {
            ("tokens", Decimal(1000), datetime.now(UTC).strftime("%Y-%m"))
        }

    def test_an_org_budget_binds_all_its_keys(self, gateways, fake_model, make_api_key, django_db_blocker):
        from accounts.models import ApiKey, Organization

        first = make_api_key(rate_limit_tpm=1_000_000)
        org_id = first.organization_id

        def second_key_and_budget():
            from accounts.services import api_key_create

            # One token costs 0.001 in and out: an answer of 3 + 140 tokens costs 0.143 of the 0.2.
            price_model(fake_model.name, input_per_million="1000", output_per_million="1000")
            Organization.objects.filter(pk=org_id).update(monthly_spend_cap=Decimal("0.2"))
            issued = api_key_create(organization=Organization.objects.get(pk=org_id), name="b", rate_limit_tpm=10**6)
            return issued.secret, ApiKey.objects.get(pk=first.key_id)

        second_secret, _ = committed(django_db_blocker, second_key_and_budget)
        time.sleep(1.1)  # the first key's cached grant (without the org cap) ages out
        fake_model.control(mode="normal", tokens=140, delay=0)
        assert chat(gateways[0], first.secret, fake_model.name, max_tokens=150).status_code == 200
        refused = chat(gateways[1], second_secret, fake_model.name, max_tokens=150)
        assert refused.status_code == 429
        assert "org's monthly spend" in refused.json()["error"]["message"]


class TestMonthBoundary:
    def test_the_quota_resets_exactly_at_the_start_of_the_month(self, gateways, fake_model, make_api_key, test_clock):
        key = make_api_key(rate_limit_rpm=10_000, rate_limit_tpm=10_000_000, monthly_token_quota=300)
        fake_model.control(mode="normal", tokens=200, delay=0)  # one answer uses 203 of the 300
        boundary = datetime(2031, 2, 1, tzinfo=UTC).timestamp()
        test_clock(boundary - 2.0)
        assert chat(gateways[0], key.secret, fake_model.name, max_tokens=250).status_code == 200
        refused = chat(gateways[1], key.secret, fake_model.name, max_tokens=250)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "insufficient_quota"
        assert 2 <= int(refused.headers["retry-after"]) <= 3  # until 00:00 UTC on the 1st
        test_clock(boundary - 0.001)
        assert chat(gateways[1], key.secret, fake_model.name, max_tokens=250).status_code == 429
        test_clock(boundary)
        assert chat(gateways[1], key.secret, fake_model.name, max_tokens=250).status_code == 200

    @pytest.mark.parametrize(
        "when",
        [
            datetime(2024, 2, 29, 23, 59, 59, tzinfo=UTC),
            datetime(2024, 3, 1, tzinfo=UTC),
            datetime(2026, 12, 31, 23, 59, 59, 999000, tzinfo=UTC),
            datetime(2027, 1, 1, tzinfo=UTC),
            datetime(2100, 2, 28, 12, tzinfo=UTC),
            datetime(2000, 2, 29, tzinfo=UTC),
            datetime(1999, 12, 31, 23, 59, 59, tzinfo=UTC),
        ],
    )
    def test_the_calendar_arithmetic_in_lua(self, when):
        from billing.ledger import lua_source
        from core.redis import sync_redis

        month, left = sync_redis().eval(lua_source(), 0, "month", f"{when.timestamp():.3f}")
        assert month.decode() == when.strftime("%Y-%m")
        days = calendar.monthrange(when.year, when.month)[1]
        next_month = datetime(when.year, when.month, days, tzinfo=UTC) + timedelta(days=1)
        assert math.isclose(float(left), next_month.timestamp() - when.timestamp(), abs_tol=0.01)


class TestKeyLifecycle:
    def test_a_revoked_key_is_refused_by_the_other_gateway_within_a_second(
        self, gateways, fake_model, make_api_key, django_db_blocker
    ):
        from django.contrib.auth import get_user_model

        from accounts.models import Role
        from accounts.services import membership_set

        key = make_api_key(rate_limit_rpm=10_000)

        def admin() -> None:
            from accounts.models import Organization

            user = get_user_model().objects.create_user(username=f"admin-{key.key_id}", password="pw-1234567890")
            membership_set(
                user=user, organization=Organization.objects.get(pk=key.organization_id), role=Role.ORG_ADMIN
            )

        committed(django_db_blocker, admin)
        fake_model.control(mode="normal", tokens=1, delay=0)
        for gateway in gateways:  # both have the key cached
            assert chat(gateway, key.secret, fake_model.name).status_code == 200
        revoked = httpx.post(
            f"{gateways[0].base_url}/api/orgs/{key.organization_id}/keys/{key.key_id}/revoke/",
            auth=(f"admin-{key.key_id}", "pw-1234567890"), timeout=10,
        )  # fmt: skip
        assert revoked.status_code == 200, revoked.text
        started = time.monotonic()
        while chat(gateways[1], key.secret, fake_model.name).status_code == 200:
            assert time.monotonic() - started < 1.0, "still accepted after 1 s"
            time.sleep(0.02)
        refused = chat(gateways[1], key.secret, fake_model.name)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"

    def test_rotation_keeps_the_old_key_for_the_grace_period(
        self, gateways, fake_model, make_api_key, django_db_blocker
    ):
        from accounts.models import ApiKey
        from accounts.services import api_key_rotate

        old = make_api_key(rate_limit_rpm=10_000)
        fake_model.control(mode="normal", tokens=1, delay=0)
        issued = committed(
            django_db_blocker,
            lambda: api_key_rotate(api_key=ApiKey.objects.get(pk=old.key_id), grace=timedelta(seconds=2)),
        )
        assert chat(gateways[0], issued.secret, fake_model.name).status_code == 200
        assert chat(gateways[1], old.secret, fake_model.name).status_code == 200
        time.sleep(2.1)
        expired = chat(gateways[1], old.secret, fake_model.name)
        assert expired.status_code == 401
        assert expired.json()["error"]["code"] == "expired_api_key"
        assert chat(gateways[0], issued.secret, fake_model.name).status_code == 200

    def test_last_use_is_recorded(self, gateways, fake_model, make_api_key, django_db_blocker):
        from accounts.models import ApiKey

        key = make_api_key()
        fake_model.control(mode="normal", tokens=1, delay=0)
        assert chat(gateways[0], key.secret, fake_model.name).status_code == 200
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if committed(django_db_blocker, lambda: ApiKey.objects.get(pk=key.key_id).last_used_at):
                return
            time.sleep(0.1)
        pytest.fail("last_used_at was not written")


class TestBackpressure:
    def test_free_tier_is_refused_first(self, fake_model, make_api_key, spawn_gateway):
        gateway = spawn_gateway(
            REPLICA_STALE_AFTER="86400", BACKPRESSURE_FREE_PER_REPLICA="2", BACKPRESSURE_PAID_PER_REPLICA="4"
        )
        free = make_api_key(tier="free", rate_limit_rpm=10_000)
        paid = make_api_key(tier="paid", rate_limit_rpm=10_000)
        fake_model.control(mode="normal", tokens=4, delay=0.5)
        with ThreadPoolExecutor(max_workers=4) as pool:
            busy = [pool.submit(chat, gateway, paid.secret, fake_model.name, stream=True) for _ in range(2)]
            time.sleep(0.5)  # two requests in flight on the model's one replica
            refused = chat(gateway, free.secret, fake_model.name)
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "model_overloaded"
            assert "free-tier" in refused.json()["error"]["message"]
            assert refused.headers["retry-after"] == "1"
            more = [pool.submit(chat, gateway, paid.secret, fake_model.name, stream=True) for _ in range(2)]
            assert [f.result().status_code for f in busy + more] == [200] * 4
        assert chat(gateway, free.secret, fake_model.name).status_code == 200  # the queue drained


class TestRedisDown:
    def test_requests_are_refused_not_served_unmetered(self, fake_model, api_key, spawn_gateway):
        gateway = spawn_gateway(REPLICA_STALE_AFTER="86400", TEST_REDIS_URL="redis://127.0.0.1:1/0")
        response = chat(gateway, api_key.secret, fake_model.name)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "limiter_unavailable"
        assert fake_model.requests() == 0
