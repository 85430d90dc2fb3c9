"""A canary judged on the requests real gateways served from fake engines: v2 fails 10 % of
its requests, each of them is answered by the base instead (the fallback), so no customer sees
an error; the controller still rolls it back for them, and the gateways stop sending it traffic."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from billing.usage import persist_failed_attempts, persist_usage_stream
from registry.models import Model
from rollout.canary import canary_create, canary_tick
from rollout.models import Canary
from rollout.served_requests import served_requests
from tests.support.gateway import committed, register_fake_replica, start_fake_engine

# The marker makes pytest-django set up the test database; the writes go through committed().
pytestmark = pytest.mark.django_db


def test_a_failing_canary_is_rolled_back_and_leaves_routing(fault_gateway, django_db_blocker, make_api_key):
    base_engine, base_endpoint = start_fake_engine()
    canary_engine, canary_endpoint = start_fake_engine()
    try:
        httpx.post(f"{canary_endpoint}/_control", json={"fail_rate": 0.1, "seed": 1}, timeout=5).raise_for_status()
        name = f"canary-{uuid.uuid4().hex[:8]}"

        def setup() -> int:
            register_fake_replica(name, base_endpoint, version="v1")
            register_fake_replica(name, canary_endpoint, version="v2", weight=0)
            model = Model.objects.get(name=name)
            return canary_create(
                actor=None, model=model, base_version="v1", canary_version="v2", steps=[20, 50, 100],
                interval_seconds=1, min_samples=40,
            ).pk  # fmt: skip

        canary_id = committed(django_db_blocker, setup)
        key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000)
        served: dict[str, int] = {}
        statuses: dict[int, int] = {}

        def drive(count: int) -> None:
            with httpx.Client(base_url=fault_gateway.base_url, timeout=10) as client:
                for _i in range(count):
                    # Callers stick to a version, so many callers make the 80/20 split; a fresh
                    # prompt at temperature 1 is never answered from the cache.
                    response = client.post(
                        "/v1/chat/completions",
                        headers={"authorization": f"Bearer {key.secret}"},
                        json={
                            "model": name,
                            "messages": [{"role": "user", "content": f"hello {uuid.uuid4().hex}"}],
                            "temperature": 1.0,
                            "user": f"caller-{uuid.uuid4().hex}",
                        },
                    )
                    statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                    version = response.headers.get("x-model-version", "?")
                    served[version] = served.get(version, 0) + 1

        drive(400)
        assert served.get("v2", 0) >= 40, (served, statuses)
        assert statuses == {200: 400}  # every failure of v2 was answered by v1
        failed_on_v2 = httpx.get(f"{canary_endpoint}/_stats", timeout=5).json()["requests"] - served["v2"]
        assert failed_on_v2 > 0

        def persist() -> None:
            persist_usage_stream()
            persist_failed_attempts()

        committed(django_db_blocker, persist)

        def tick() -> tuple[str, list[str], dict[str, int]]:
            canary_tick(load_samples=served_requests, now=timezone.now() + timedelta(seconds=2))
            canary = Canary.objects.get(pk=canary_id)
            last = canary.decisions.order_by("-at", "-id").first()
            assert last is not None
            return canary.status, last.reasons, last.figures["arms"]["canary"]

        status, reasons, arm = committed(django_db_blocker, tick)
        assert status == "rolled_back", (reasons, served, statuses)
        assert any("error_rate worse" in reason for reason in reasons), reasons
        assert arm["errors"] == failed_on_v2  # judged by the attempts that failed on it
        # The split is published when the decision commits; gateways reload within 2 s (0.2 s here).
        time.sleep(1.0)
        served.clear()
        drive(60)
        assert served == {"v1": 60}, served
    finally:
        for process in (base_engine, canary_engine):
            process.kill()
            process.wait(5)
