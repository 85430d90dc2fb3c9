"""The router's choices: weights, stickiness, staleness, circuits, least busy."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from serving.routing import CircuitBreaker, ModelRoute, ReplicaRoute, Router, VersionRoute, served_context_length


def version(vid: int, weight: int, replicas: int = 1, *, age: float = 0.0) -> VersionRoute:
    now = time.time() - age
    return VersionRoute(
        id=vid, version=str(vid), deployment_id=vid, weight=weight, max_model_len=1024, artifact_uri="local://x",
        replicas=tuple(
            ReplicaRoute(id=vid * 10 + i, endpoint=f"http://r{vid}{i}", heartbeat_at=now) for i in range(replicas)
        ),
    )  # fmt: skip


def model(*versions: VersionRoute) -> ModelRoute:
    return ModelRoute(name="m", task="chat", owner="o", created=0, versions=versions)


class TestVersionChoice:
    def test_weights_split_traffic(self):
        router = Router()
        m = model(version(1, 90), version(2, 10))
        picks = Counter(router.choose_version(m, f"user-{i}").id for i in range(5000))
        assert 0.86 < picks[1] / 5000 < 0.94

    def test_the_same_caller_always_gets_the_same_version(self):
        router = Router()
        m = model(version(1, 50), version(2, 50))
        assert len({router.choose_version(m, "alice").id for _ in range(50)}) == 1

    def test_a_version_without_live_replicas_gets_no_traffic(self):
        router = Router()
        m = model(version(1, 50, age=3600), version(2, 50))
        assert {router.choose_version(m, f"u{i}").id for i in range(200)} == {2}

    def test_zero_weight_serves_only_when_nothing_else_can(self):
        router = Router()
        assert router.choose_version(model(version(1, 100), version(2, 0)), "x").id == 1
        assert router.choose_version(model(version(1, 100, age=3600), version(2, 0)), "x").id == 2

    def test_no_live_replica_at_all(self):
        assert Router().choose_version(model(version(1, 100, age=3600)), "x") is None


class TestReplicaChoice:
    def test_fewest_in_flight_first(self):
        router = Router()
        v = version(1, 100, replicas=3)
        for replica_id, busy in ((10, 5), (11, 1), (12, 3)):
            for _ in range(busy):
                router.acquire(replica_id)
        assert [r.id for r in router.replica_order(v)] == [11, 12, 10]
        for _ in range(5):
            router.release(10)
        assert router.in_flight(10) == 0
        assert next(r.id for r in router.replica_order(v)) == 10

    def test_an_open_circuit_is_skipped(self, settings):
        settings.CIRCUIT_FAILURE_THRESHOLD = 2
        router = Router()
        v = version(1, 100, replicas=2)
        router.circuits.record_failure(10)
        assert len(router.replica_order(v)) == 2
        router.circuits.record_failure(10)
        assert [r.id for r in router.replica_order(v)] == [11]

    def test_a_circuit_closes_after_its_rest(self, settings):
        settings.CIRCUIT_FAILURE_THRESHOLD = 1
        settings.CIRCUIT_OPEN_SECONDS = 0.05
        breaker = CircuitBreaker()
        breaker.record_failure(1)
        assert breaker.is_open(1)
        time.sleep(0.06)
        assert not breaker.is_open(1)

    def test_success_resets_the_count(self, settings):
        settings.CIRCUIT_FAILURE_THRESHOLD = 2
        breaker = CircuitBreaker()
        breaker.record_failure(1)
        breaker.record_success(1)
        breaker.record_failure(1)
        assert not breaker.is_open(1)


@pytest.mark.parametrize(
    ("config", "limit", "expected"),
    [({"max_seq_len": 8192}, 4096, 4096), ({"max_seq_len": 256}, 8192, 256), ({}, 2048, 2048)],
)
def test_served_context_length(settings, config, limit, expected):
    settings.ENGINE_MAX_MODEL_LEN = limit
    assert served_context_length(config) == expected
