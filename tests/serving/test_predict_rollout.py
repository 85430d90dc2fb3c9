"""Small models through the rollout machinery, with real predict workers: an A/B split spreads
keys over two versions of the digits model, and a canary of a version whose every answer
fails at its worker is rolled back on errors alone (predict traffic has no token signal),
while its clients are answered by the base version (fallback)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from decimal import Decimal
from typing import Any

import httpx
import numpy as np
import pytest
from django.utils import timezone

from tests.support.gateway import committed, wait_for_ready_replicas

pytestmark = [pytest.mark.engine, pytest.mark.django_db]

DIGITS = "digits-mlp"
HEALTHY, BROKEN = "2", "2-broken"


def _deploy(version_name: str, batcher: dict[str, Any]) -> int:
    from registry.models import ModelVersion
    from registry.services import deployment_create, model_version_register

    base = ModelVersion.objects.get(model__name=DIGITS, version="1")
    version = model_version_register(
        model=base.model, version=version_name, framework="onnx", artifact_uri=base.artifact_uri,
        artifact_sha256=base.artifact_sha256, artifact_size=base.artifact_size,
        config={**base.config, "batcher": {**base.config["batcher"], **batcher}},
    )  # fmt: skip
    return deployment_create(version=version, traffic_weight=0).pk


@pytest.fixture(scope="module")
def digits_versions(engines, django_db_blocker) -> Iterator[None]:
    # The broken version's batcher gives each request a microsecond: every answer is a 504.
    ids = [
        committed(django_db_blocker, lambda: _deploy(HEALTHY, {})),
        committed(django_db_blocker, lambda: _deploy(BROKEN, {"timeout_s": 0.000001})),
    ]
    wait_for_ready_replicas(django_db_blocker, ids, timeout=120)
    yield

    def retire() -> None:
        from registry.models import Deployment, Model
        from registry.services import deployment_transition, traffic_set

        traffic_set(actor=None, model=Model.objects.get(name=DIGITS), weights={"1": 100})
        for deployment in Deployment.objects.filter(pk__in=ids):
            for status in ("draining", "stopped"):
                deployment = deployment_transition(deployment=deployment, status=status)

    committed(django_db_blocker, retire)


def predict(gateway, secret: str, seed: int) -> httpx.Response:
    data = np.random.default_rng(seed).uniform(0, 16, size=64).tolist()
    body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": data}]}
    return httpx.post(
        f"{gateway.base_url}/v2/models/{DIGITS}/infer",
        json=body,
        headers={"Authorization": f"Bearer {secret}"},
        timeout=60,
    )


def test_an_ab_split_spreads_keys_over_both_versions(gateway, make_api_key, digits_versions, django_db_blocker):
    from registry.models import Model
    from registry.services import traffic_set

    committed(django_db_blocker, lambda: traffic_set(actor=None, model=Model.objects.get(name=DIGITS),
                                                     weights={"1": 50, HEALTHY: 50}))  # fmt: skip
    try:
        seen: dict[str, int] = {}
        for n in range(24):
            key = make_api_key(rate_limit_rpm=1000)
            response = predict(gateway, key.secret, seed=n)
            assert response.status_code == 200, response.text
            version = response.headers["x-model-version"]
            seen[version] = seen.get(version, 0) + 1
            assert response.json()["model_version"] == version
        assert set(seen) == {"1", HEALTHY}, seen
    finally:
        committed(django_db_blocker, lambda: traffic_set(actor=None, model=Model.objects.get(name=DIGITS),
                                                         weights={"1": 100}))  # fmt: skip


def test_a_failing_canary_is_rolled_back_on_errors_alone(gateway, make_api_key, digits_versions, django_db_blocker):
    from registry.models import Model
    from rollout.canary import canary_create
    from rollout.models import Canary

    canary = committed(
        django_db_blocker,
        lambda: canary_create(
            actor=None, model=Model.objects.get(name=DIGITS), base_version="1", canary_version=BROKEN,
            interval_seconds=1, steps=[50], min_samples=3, success_criteria={"min_success_rate": 0.9},
        ),
    )  # fmt: skip
    statuses = []
    for n in range(40):
        key = make_api_key(rate_limit_rpm=1000)
        response = predict(gateway, key.secret, seed=1000 + n)
        statuses.append((response.status_code, response.headers.get("x-model-version")))
    # Every client was answered, by the base version when the canary's worker failed (after
    # CIRCUIT_FAILURE_THRESHOLD failures its circuit opens and the canary takes no more for a while).
    assert {status for status, _ in statuses} == {200}
    assert {version for _, version in statuses} == {"1"}

    def judged() -> str:
        from billing.usage import persist_failed_attempts, persist_usage_stream
        from rollout.tasks import canary_tick

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            persist_usage_stream()  # the usage records and failed attempts the controller reads
            persist_failed_attempts()
            canary_tick()
            status = str(Canary.objects.get(pk=canary.pk).status)
            if status != "running":
                return status
            time.sleep(0.5)
        return f"running: {list(Canary.objects.get(pk=canary.pk).decisions.values_list('verdict', 'reasons'))}"

    assert committed(django_db_blocker, judged) == "rolled_back"


def test_a_shadow_candidate_is_judged_by_agreement(gateway, make_api_key, digits_versions, django_db_blocker):
    """Version 2 is the same graph: it must agree on every item the primary answered."""
    from registry.models import Model, ModelVersion
    from serving.shadow.selectors import shadow_comparison
    from serving.shadow.services import shadow_policy_delete, shadow_policy_set

    def start() -> datetime:
        model = Model.objects.get(name=DIGITS)
        candidate = ModelVersion.objects.get(model=model, version=HEALTHY)
        shadow_policy_set(model=model, candidate=candidate, percent=Decimal(100), enabled=True, actor=None)
        return timezone.now()

    since = committed(django_db_blocker, start)
    time.sleep(0.5)  # the gateways reload their routing table
    try:
        key = make_api_key(rate_limit_rpm=1000)
        for n in range(6):
            assert predict(gateway, key.secret, seed=2000 + n).status_code == 200
        deadline = time.monotonic() + 30
        while True:
            comparison = committed(django_db_blocker, lambda: shadow_comparison(model=DIGITS, since=since))
            if comparison["agreement"]["items"] >= 6 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert comparison["agreement"] == {"items": 6, "agreed": 6, "rate": 1.0}
        assert comparison["candidate_versions"] == [HEALTHY]
        assert comparison["candidate"]["requests"] == 6
    finally:
        committed(django_db_blocker, lambda: shadow_policy_delete(model=Model.objects.get(name=DIGITS), actor=None))
