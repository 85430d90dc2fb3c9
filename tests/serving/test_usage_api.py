"""GET /v1/usage through a real gateway: a key sees its own daily usage only, paged and filtered."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

import httpx
import pytest

from tests.support.gateway import committed
from tests.support.processes import start_gateway

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def usage_gateway(django_db_setup, tmp_path_factory):
    gateway = start_gateway(
        tmp_path_factory.mktemp("usage-gateway"), REPLICA_STALE_AFTER="86400", ROUTING_REFRESH_SECONDS="0.2"
    )
    yield gateway
    gateway.stop()


@dataclass
class Tenants:
    mine: str  # secrets
    sibling: str  # another key of the same organisation
    stranger: str  # another organisation's key
    today: date


def _rollup(api_key, day: date, model: str, version: str = "1", requests: int = 1, errors: int = 0,
            cost: str = "0.001234", cancelled: int = 0) -> None:  # fmt: skip
    from billing.models import UsageRollup

    UsageRollup.objects.create(
        period=UsageRollup.Period.DAY, start=datetime.combine(day, time.min, UTC),
        organization_id=api_key.organization_id, api_key=api_key, model=model, model_version=version,
        requests=requests, errors=errors, cancelled=cancelled,
        input_tokens=10 * requests, output_tokens=5 * requests, cached_tokens=2 * requests, cost=Decimal(cost),
    )  # fmt: skip


def forget_usage(django_db_blocker, key_ids: list[int]) -> None:
    """Remove what a test committed, so later tests that count rows are not misled."""
    from billing.models import RollupProgress, UsageRecord, UsageRollup

    def forget() -> None:
        UsageRollup.objects.filter(api_key_id__in=key_ids).delete()
        UsageRecord.objects.filter(api_key_id__in=key_ids).delete()
        RollupProgress.objects.all().delete()

    committed(django_db_blocker, forget)


@pytest.fixture(scope="module")
def tenants(django_db_setup, django_db_blocker) -> Iterator[Tenants]:
    """Daily rollups (the only thing the endpoint reads) for three keys, committed."""
    from accounts.services import api_key_create, organization_create

    today = datetime.now(UTC).date()

    def make() -> tuple[Tenants, list[int]]:
        org = organization_create(name=f"Usage {uuid.uuid4().hex[:8]}")
        other = organization_create(name=f"Usage other {uuid.uuid4().hex[:8]}")
        mine, sibling = api_key_create(organization=org, name="mine"), api_key_create(organization=org, name="sib")
        stranger = api_key_create(organization=other, name="stranger")
        for back in (0, 1, 29, 30):
            _rollup(mine.api_key, today - timedelta(days=back), "alpha")
        _rollup(mine.api_key, today, "alpha", version="2", requests=3, errors=1, cost="0.000001", cancelled=1)
        _rollup(mine.api_key, today - timedelta(days=1), "beta")
        _rollup(sibling.api_key, today, "sibling-model")
        _rollup(stranger.api_key, today, "stranger-model")
        return Tenants(mine.secret, sibling.secret, stranger.secret, today), [
            k.api_key.pk for k in (mine, sibling, stranger)
        ]

    tenants, key_ids = committed(django_db_blocker, make)
    yield tenants
    forget_usage(django_db_blocker, key_ids)


def usage(gateway, secret: str | None, query: str = "", path: str = "/v1/usage") -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.get(f"{gateway.base_url}{path}?{query}", headers=headers, timeout=10)


def rows(response: httpx.Response) -> list[tuple[str, str, int]]:
    assert response.status_code == 200, response.text
    return [(r["date"], r["model"], r["requests"]) for r in response.json()["data"]]


class TestOwnUsage:
    def test_a_key_sees_its_own_last_thirty_days(self, usage_gateway, tenants):
        today, day = tenants.today, timedelta(days=1)
        response = usage(usage_gateway, tenants.mine)
        assert rows(response) == [
            (str(today - 29 * day), "alpha", 1),
            (str(today - day), "alpha", 1),
            (str(today - day), "beta", 1),
            (str(today), "alpha", 4),  # both versions of the model, summed
        ]
        body = response.json()
        assert (body["object"], body["has_more"], body["next_page"]) == ("list", False, None)
        entry = body["data"][-1]
        assert entry == {
            "object": "usage.daily", "date": str(today), "model": "alpha", "requests": 4, "errors": 1, "cancelled": 1,
            "input_tokens": 40, "output_tokens": 20, "cached_tokens": 8, "cost": "0.001235000000", "batch_requests": 0,
            "batch_cost": "0.000000000000", "currency": "USD",
        }  # fmt: skip

    def test_other_keys_are_invisible(self, usage_gateway, tenants):
        assert rows(usage(usage_gateway, tenants.sibling)) == [(str(tenants.today), "sibling-model", 1)]
        assert rows(usage(usage_gateway, tenants.stranger)) == [(str(tenants.today), "stranger-model", 1)]

    def test_the_api_v1_path_answers_the_same(self, usage_gateway, tenants):
        assert (
            usage(usage_gateway, tenants.mine, path="/api/v1/usage").json() == usage(usage_gateway, tenants.mine).json()
        )

    def test_dates_filter_inclusively(self, usage_gateway, tenants):
        yesterday = str(tenants.today - timedelta(days=1))
        query = f"start_date={yesterday}&end_date={yesterday}"
        assert rows(usage(usage_gateway, tenants.mine, query)) == [(yesterday, "alpha", 1), (yesterday, "beta", 1)]
        thirty = str(tenants.today - timedelta(days=30))
        assert rows(usage(usage_gateway, tenants.mine, f"start_date={thirty}&end_date={thirty}")) == [
            (thirty, "alpha", 1)
        ]

    def test_pages_follow_the_cursor(self, usage_gateway, tenants):
        start = f"start_date={tenants.today - timedelta(days=40)}"
        seen, query = [], f"{start}&limit=2"
        pages = 0
        while True:
            body = usage(usage_gateway, tenants.mine, query).json()
            pages += 1
            seen += [(r["date"], r["model"]) for r in body["data"]]
            if not body["has_more"]:
                assert body["next_page"] is None
                break
            assert len(body["data"]) == 2
            query = f"{start}&limit=2&after={body['next_page']}"
        assert pages == 3
        assert len(seen) == 5
        assert seen == sorted(seen)


class TestRefusals:
    @pytest.mark.parametrize(
        ("query", "param"),
        [
            ("start_date=2026-1-5", "start_date"),
            ("start_date=20260105", "start_date"),
            ("end_date=2026-02-30", "end_date"),
            ("start_date=2026-03-02&end_date=2026-03-01", "start_date"),
            ("limit=0", "limit"),
            ("limit=101", "limit"),
            ("limit=ten", "limit"),
            ("limit=", "limit"),
            ("after=bm9wZQ", "after"),
            ("limit=2&limit=3", "limit"),
            ("page=2", "page"),
        ],
    )
    def test_bad_parameters_are_400_naming_them(self, usage_gateway, tenants, query, param):
        response = usage(usage_gateway, tenants.mine, query)
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)

    def test_a_key_is_required(self, usage_gateway, tenants):
        response = usage(usage_gateway, None)
        assert response.status_code == 401
        assert usage(usage_gateway, "sk-not-a-key").status_code == 401

    def test_only_get(self, usage_gateway, tenants):
        response = httpx.post(
            f"{usage_gateway.base_url}/v1/usage", headers={"Authorization": f"Bearer {tenants.mine}"}, timeout=10
        )
        assert response.status_code == 405
        assert response.headers["allow"] == "GET"


class TestEndToEnd:
    def test_a_real_request_is_metered_counted_and_shown(
        self, usage_gateway, fake_model, make_api_key, django_db_blocker
    ):
        """Through the gateway and the fake engine: the ledger counts the event in its hour
        (what reconciliation reads), the record is stored, rolled up, and shown."""
        from billing.models import UsageRecord
        from billing.rollups import rollups_build
        from billing.usage import persist_usage_stream
        from core import keys
        from core.redis import sync_redis

        key = make_api_key()
        fake_model.control(mode="normal", tokens=3, delay=0)

        def counts() -> dict[str, int]:
            now = datetime.now(UTC)
            hours = [(now + timedelta(hours=h)).strftime("%Y%m%d%H") for h in (-1, 0, 1)]
            return {h: int(sync_redis().hget(keys.usage_counts(h), "events") or 0) for h in hours}

        before = counts()
        answer = httpx.post(
            f"{usage_gateway.base_url}/v1/chat/completions", timeout=30,
            json={"model": fake_model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            headers={"Authorization": f"Bearer {key.secret}"},
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        after = counts()
        assert sum(after.get(h, 0) - before.get(h, 0) for h in after) == 1

        def store() -> UsageRecord | None:
            persist_usage_stream()
            rollups_build()
            return UsageRecord.objects.filter(request_id=answer.headers["x-request-id"]).first()

        try:
            record = committed(django_db_blocker, store)
            assert record is not None
            body = usage(usage_gateway, key.secret).json()
            assert [(r["model"], r["requests"], r["output_tokens"]) for r in body["data"]] == [(fake_model.name, 1, 3)]
            assert body["data"][0]["date"] == record.created_at.astimezone(UTC).date().isoformat()
        finally:
            forget_usage(django_db_blocker, [key.key_id])
