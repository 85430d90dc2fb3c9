"""Money on the request path: each request charged at its model's price, spend caps in money.

Real daphne gateways, PostgreSQL and Redis, the fake engine (its answers report 3 prompt
tokens and the configured number of completion tokens).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal

import httpx
import pytest

from tests.support.gateway import chat, committed, persisted, price_model
from tests.support.processes import start_gateway

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def gateways(django_db_setup, tmp_path_factory):
    base = tmp_path_factory.mktemp("spend-gateways")
    env = {"REPLICA_STALE_AFTER": "86400", "ROUTING_REFRESH_SECONDS": "30"}  # changes must not wait for a refresh
    pair = [start_gateway(base, **env), start_gateway(base, **env)]
    yield pair
    for gateway in pair:
        gateway.stop()


def record_of(response):
    request_id = response.headers["x-request-id"]
    return persisted([request_id])[request_id]


def priced(django_db_blocker, model: str, input_price: str, output_price: str, **more):
    """Price the model (committed: gateways see it) and return the Price."""
    return committed(
        django_db_blocker,
        lambda: price_model(model, input_per_million=input_price, output_per_million=output_price, **more),
    )


def exact(prompt: int, completion: int, input_price: str, output_price: str) -> Decimal:
    return (prompt * Decimal(input_price) + completion * Decimal(output_price)) / 1_000_000


class TestCharges:
    def test_a_request_is_charged_its_exact_cost_at_its_models_price(
        self, gateways, fake_model, make_api_key, django_db_blocker
    ):
        price = priced(django_db_blocker, fake_model.name, "0.37", "1.13")
        key = make_api_key()
        fake_model.control(mode="normal", tokens=7, delay=0)
        record = record_of(chat(gateways[0], key.secret, fake_model.name, max_tokens=10))
        assert (record.prompt_tokens, record.completion_tokens) == (3, 7)
        assert record.price_id == price.pk
        assert record.cost == exact(3, 7, "0.37", "1.13")  # 0.00000902: never rounded per request

    def test_an_embedding_is_charged_for_its_input(self, gateways, make_api_key, django_db_blocker):
        from tests.support.gateway import register_fake_replica, start_fake_engine

        process, endpoint = start_fake_engine()
        try:
            name = f"fake-embed-{int(time.time() * 1000)}"
            committed(django_db_blocker, lambda: register_fake_replica(name, endpoint, task="embedding"))
            price = priced(django_db_blocker, name, "0.02", "0")
            key = make_api_key()
            response = httpx.post(
                f"{gateways[0].base_url}/v1/embeddings", json={"model": name, "input": ["a", "b"]}, timeout=30,
                headers={"Authorization": f"Bearer {key.secret}"},
            )  # fmt: skip
            assert response.status_code == 200, response.text
            record = record_of(response)
            assert (record.price_id, record.prompt_tokens, record.completion_tokens) == (price.pk, 3, 0)
            assert record.cost == exact(3, 0, "0.02", "0")
        finally:
            process.kill()

    def test_an_unpriced_model_costs_nothing(self, gateways, fake_model, make_api_key):
        key = make_api_key()
        fake_model.control(mode="normal", tokens=2, delay=0)
        record = record_of(chat(gateways[1], key.secret, fake_model.name))
        assert (record.price_id, record.cost) == (None, Decimal(0))

    def test_a_price_change_applies_to_new_requests_on_every_gateway(
        self, gateways, fake_model, make_api_key, django_db_blocker
    ):
        priced(django_db_blocker, fake_model.name, "1", "1")
        key = make_api_key(rate_limit_rpm=10_000)
        fake_model.control(mode="normal", tokens=1, delay=0)
        for gateway in gateways:  # both hold the old price
            assert record_of(chat(gateway, key.secret, fake_model.name)).cost == exact(3, 1, "1", "1")
        new = priced(django_db_blocker, fake_model.name, "5", "5")
        changed_at = time.monotonic()
        for gateway in gateways:
            # Told over Redis, not at the next refresh (30 s here): within a fraction of a second.
            while (record := record_of(chat(gateway, key.secret, fake_model.name))).price_id != new.pk:
                assert time.monotonic() - changed_at < 2, "the new price did not reach the gateway"
            assert record.cost == exact(3, 1, "5", "5")

    def test_a_scheduled_price_starts_exactly_when_it_says(self, gateways, fake_model, make_api_key, django_db_blocker):
        from django.utils import timezone

        priced(django_db_blocker, fake_model.name, "1", "1")
        starts = timezone.now() + timedelta(seconds=2)
        later = priced(django_db_blocker, fake_model.name, "9", "9", effective_from=starts)
        key = make_api_key(rate_limit_rpm=10_000)
        fake_model.control(mode="normal", tokens=1, delay=0)
        time.sleep(0.5)
        records = []
        while timezone.now() < starts + timedelta(seconds=1):
            records.append(record_of(chat(gateways[0], key.secret, fake_model.name)))
        for record in records:  # admitted before the start: old price; after: the new one, exactly
            assert (record.price_id == later.pk) == (record.created_at >= starts), (record.created_at, starts)
        assert {r.price_id for r in records} >= {later.pk}


class TestSpendCapsInMoney:
    def test_fifty_concurrent_requests_overshoot_a_money_cap_by_at_most_one_reservation(
        self, gateways, fake_model, make_api_key, django_db_blocker
    ):
        # One token costs 0.01: a request of 3 + 100 tokens costs 1.03; the cap is 10.
        committed(
            django_db_blocker,
            lambda: price_model(fake_model.name, input_per_million="10000", output_per_million="10000"),
        )
        key = make_api_key(rate_limit_rpm=10_000, rate_limit_tpm=10_000_000, monthly_spend_cap=Decimal(10))
        fake_model.control(mode="normal", tokens=100, delay=0)
        time.sleep(0.5)

        def one(i: int) -> httpx.Response:
            return chat(gateways[i % 2], key.secret, fake_model.name, max_tokens=100)

        with ThreadPoolExecutor(max_workers=50) as pool:
            responses = list(pool.map(one, range(50)))
        admitted = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        assert {r.status_code for r in refused} == {429}
        assert {r.json()["error"]["code"] for r in refused} == {"insufficient_quota"}
        assert "monthly spend" in refused[0].json()["error"]["message"]
        assert fake_model.requests() == len(admitted)
        spent = sum(r.cost for r in persisted([r.headers["x-request-id"] for r in admitted]).values())
        # What one such request reserves at admission: its prompt bound plus 100 tokens, at 0.01.
        probe = make_api_key(rate_limit_rpm=10_000, rate_limit_tpm=10_000_000)
        charged = chat(gateways[0], probe.secret, fake_model.name, max_tokens=100)
        reservation = (10_000_000 - int(charged.headers["x-ratelimit-remaining-tokens"])) * Decimal("0.01")
        assert spent <= Decimal(10) + reservation
        assert len(admitted) >= int(Decimal(10) // reservation)  # and the cap was not left unused either
