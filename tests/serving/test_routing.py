"""The router's choices: weights, stickiness, staleness, circuits, least busy."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import pytest

from serving.gateway.engine_kinds import EXTERNAL, VLLM, served_context_length
from serving.gateway.routing import (
    CircuitBreaker,
    ModelRoute,
    ReplicaRoute,
    Router,
    VersionRoute,
)


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


KEYS = [f"user-{i}" for i in range(10_000)]


def shares(router: Router, m: ModelRoute) -> dict[int, float]:
    """Each version's share of KEYS, in points (percent)."""
    picks = Counter(router.choose_version(m, key).id for key in KEYS)
    return {vid: 100 * n / len(KEYS) for vid, n in picks.items()}


def assignment(router: Router, m: ModelRoute) -> dict[str, int]:
    return {key: router.choose_version(m, key).id for key in KEYS}


class TestVersionChoice:
    @pytest.mark.parametrize("weights", [{1: 50, 2: 50}, {1: 90, 2: 10}, {1: 50, 2: 30, 3: 20}, {1: 1, 2: 1, 3: 1}])
    def test_weights_split_traffic_within_two_points(self, weights):
        m = model(*(version(vid, w) for vid, w in weights.items()))
        split = shares(Router(), m)
        total = sum(weights.values())
        for vid, weight in weights.items():
            assert abs(split.get(vid, 0.0) - 100 * weight / total) <= 2, split

    def test_the_same_caller_always_gets_the_same_version(self):
        router = Router()
        m = model(version(1, 50), version(2, 50), version(3, 20))
        first = assignment(router, m)
        assert assignment(router, m) == first
        assert len({router.choose_version(m, "alice").id for _ in range(50)}) == 1

    def test_a_weight_change_moves_only_the_keys_it_must(self):
        router = Router()
        before = assignment(router, model(version(1, 50), version(2, 50)))
        after = assignment(router, model(version(1, 60), version(2, 40)))
        moved = [key for key in KEYS if before[key] != after[key]]
        assert 0.08 <= len(moved) / len(KEYS) <= 0.12
        # Only from the version that shrank to the one that grew.
        assert {(before[key], after[key]) for key in moved} == {(2, 1)}

    def test_a_version_that_goes_away_moves_only_its_own_keys(self):
        router = Router()
        everyone = assignment(router, model(version(1, 50), version(2, 30), version(3, 20)))
        without_3 = assignment(router, model(version(1, 50), version(2, 30), version(3, 20, age=3600)))
        for key in KEYS:
            if everyone[key] != 3:
                assert without_3[key] == everyone[key]
        assert set(without_3.values()) == {1, 2}
        # Its keys split between the others by their weights.
        theirs = Counter(without_3[key] for key in KEYS if everyone[key] == 3)
        assert 0.55 < theirs[1] / theirs.total() < 0.70  # 50 / 80 = 0.625

    def test_it_depends_on_the_model(self):
        router = Router()
        a = assignment(router, model(version(1, 50), version(2, 50)))
        b = assignment(router, replace(model(version(1, 50), version(2, 50)), name="other"))
        assert 0.4 < sum(a[k] != b[k] for k in KEYS) / len(KEYS) < 0.6  # independent draws

    def test_two_deployments_of_one_version_share_its_keys(self):
        router = Router()
        first = version(1, 50)
        second = replace(version(1, 50), deployment_id=99)
        m = model(first, second, version(2, 100))
        split = shares(router, m)
        assert abs(split[1] - 50) <= 2  # the version's weight is both deployments'
        deployments = Counter(router.choose_version(m, key).deployment_id for key in KEYS)
        assert abs(deployments[1] - deployments[99]) / len(KEYS) < 0.04
        # One of its deployments going away takes its weight away, and moves only version 1's keys.
        both, alone = assignment(router, m), assignment(router, model(first, version(2, 100)))
        assert all(alone[k] == 2 for k in KEYS if both[k] == 2)

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


class TestPinnedVersion:
    def test_a_pin_serves_that_version_whatever_the_weights(self):
        router = Router()
        m = model(version(1, 100), version(2, 0))
        assert {router.choose_version(m, key, version="2").id for key in KEYS[:500]} == {2}
        assert {router.choose_version(m, key, version="1").id for key in KEYS[:500]} == {1}

    def test_a_pinned_version_without_a_routable_replica_is_none(self):
        m = model(version(1, 100), version(2, 50, age=3600))
        assert Router().choose_version(m, "x", version="2") is None

    def test_a_pin_to_a_version_the_model_does_not_serve_is_none(self):
        assert Router().choose_version(model(version(1, 100)), "x", version="7") is None


class TestReplicaChoice:
    def test_fewest_in_flight_first(self):
        router = Router()
        v = version(1, 100, replicas=3)
        by_id = {r.id: r for r in v.replicas}
        leases = {replica_id: [router.lease(by_id[replica_id]) for _ in range(busy)] for replica_id, busy in (
            (10, 5), (11, 1), (12, 3)
        )}  # fmt: skip
        assert [r.id for r in router.replica_order(v)] == [11, 12, 10]
        for lease in leases[10]:
            lease.release()
            lease.release()  # a lease is released once, however often its owners let go
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

    def test_success_resets_the_count(self, settings):
        settings.CIRCUIT_FAILURE_THRESHOLD = 2
        breaker = CircuitBreaker()
        breaker.record_failure(1)
        breaker.record_success(1)
        breaker.record_failure(1)
        assert not breaker.is_open(1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def breaker(settings, clock) -> CircuitBreaker:
    settings.CIRCUIT_FAILURE_THRESHOLD = 3
    settings.CIRCUIT_OPEN_SECONDS = 10
    return CircuitBreaker(clock=clock)


def trip(breaker: CircuitBreaker, replica_id: int = 1) -> None:
    for _ in range(3):
        assert breaker.allow(replica_id)
        breaker.record_failure(replica_id)


class TestHalfOpenCircuit:
    def test_it_opens_after_consecutive_failures_and_rests(self, breaker, clock):
        trip(breaker)
        assert breaker.is_open(1)
        assert not breaker.allow(1)
        clock.advance(9.9)
        assert not breaker.allow(1)
        assert not breaker.is_open(2)  # per replica

    def test_after_the_rest_exactly_one_probe_goes_through(self, breaker, clock):
        trip(breaker)
        clock.advance(10)
        assert not breaker.is_open(1)  # routable again: eligible for the probe
        assert breaker.allow(1)  # the probe
        assert breaker.is_open(1)
        assert [breaker.allow(1) for _ in range(5)] == [False] * 5

    def test_a_successful_probe_closes_the_circuit(self, breaker, clock):
        trip(breaker)
        clock.advance(10)
        assert breaker.allow(1)
        breaker.record_success(1)
        assert all(breaker.allow(1) for _ in range(5))
        # Closed for good: it takes the full threshold to open again, for the first rest again.
        breaker.record_failure(1)
        breaker.record_failure(1)
        assert breaker.allow(1)
        breaker.record_failure(1)
        assert breaker.is_open(1)
        clock.advance(10)
        assert breaker.allow(1)

    def test_a_failed_probe_reopens_for_twice_as_long_up_to_eight_times(self, breaker, clock):
        trip(breaker)
        rests = []
        for _ in range(6):
            rest = 0.0
            while not breaker.allow(1):
                clock.advance(1)
                rest += 1
            rests.append(rest)
            breaker.record_failure(1)  # the probe failed
        assert rests == [10, 20, 40, 80, 80, 80]

    def test_a_late_failure_while_it_rests_changes_nothing(self, breaker, clock):
        trip(breaker)
        clock.advance(5)
        breaker.record_failure(1)  # a request sent before it opened
        clock.advance(5)
        assert breaker.allow(1)

    def test_a_probe_without_a_verdict_frees_the_place(self, breaker, clock):
        trip(breaker)
        clock.advance(10)
        assert breaker.allow(1)
        breaker.abandon(1)  # its client went away
        assert breaker.allow(1)

    def test_a_hung_probe_frees_the_place_after_a_rest(self, breaker, clock):
        trip(breaker)
        clock.advance(10)
        assert breaker.allow(1)
        clock.advance(9)
        assert not breaker.allow(1)
        clock.advance(1)
        assert breaker.allow(1)

    def test_the_router_routes_around_an_open_circuit_and_back_through_the_probe(self, settings, clock):
        settings.CIRCUIT_FAILURE_THRESHOLD = 1
        settings.CIRCUIT_OPEN_SECONDS = 10
        router = Router(circuits=CircuitBreaker(clock=clock))
        v = version(1, 100, replicas=2)
        router.record_failure(10)
        assert [r.id for r in router.replica_order(v)] == [11]
        clock.advance(10)
        assert {r.id for r in router.replica_order(v)} == {10, 11}
        assert router.allow(10)  # one request probes it…
        assert [r.id for r in router.replica_order(v)] == [11]  # …and the others go elsewhere meanwhile
        router.record_success(10)
        assert {r.id for r in router.replica_order(v)} == {10, 11}


class TestStaleness:
    def test_a_replica_that_stops_heartbeating_leaves_routing_within_ten_seconds(self):
        # Defaults: a supervisor heart-beats every WORKER_HEARTBEAT_SECONDS (3 s); three
        # missed beats and its replicas are out, well within 10 s of its last beat.
        from django.conf import settings

        assert settings.REPLICA_STALE_AFTER <= 3 * settings.WORKER_HEARTBEAT_SECONDS < 10
        router = Router()
        assert router.routable(version(1, 100, age=settings.WORKER_HEARTBEAT_SECONDS + 1.5))
        assert not router.routable(version(1, 100, age=settings.REPLICA_STALE_AFTER + 0.1))


@pytest.mark.parametrize(
    ("config", "limit", "expected"),
    [({"max_seq_len": 8192}, 4096, 4096), ({"max_seq_len": 256}, 8192, 256), ({}, 2048, 2048)],
)
def test_served_context_length(settings, config, limit, expected):
    settings.ENGINE_MAX_MODEL_LEN = limit
    assert served_context_length(config) == expected


def test_an_external_upstream_keeps_its_declared_context(settings):
    """The platform starts its own engines at most ENGINE_MAX_MODEL_LEN long; another's server
    serves what it was started with, declared at registration."""
    settings.ENGINE_MAX_MODEL_LEN = 2048
    assert VLLM.context_length({"max_seq_len": 131072}) == 2048
    assert EXTERNAL.context_length({"max_seq_len": 131072}) == 131072
    assert EXTERNAL.context_length({}) == 2048
