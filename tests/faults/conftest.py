"""Fixtures of the fault tests: a Redis server of a test's own and the metering workers a test
starts (tests/support/chaos.py), a fake engine behind a model whose prompts are counted exactly,
and a gateway of each test's own. The fixtures every folder shares are tests/support/fixtures.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.support.chaos import MeteringWorker, RedisServer, redis_at
from tests.support.gateway import CountedModel, committed, price_model, register_fake_replica, start_fake_engine
from tests.support.processes import Gateway


@pytest.fixture
def own_redis(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    with redis_at(server.url):
        yield server
    server.stop()


@pytest.fixture
def metering(tmp_path) -> Iterator[list[MeteringWorker]]:
    """Metering workers started by a test; all are stopped afterwards."""
    started: list[MeteringWorker] = []
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture
def counted_model(bundled_models, django_db_blocker) -> Iterator[CountedModel]:
    process, endpoint = start_fake_engine()
    name = f"counted-{uuid.uuid4().hex[:8]}"
    artifact = bundled_models["versions"]["smollm2-135m-instruct"].artifact_uri

    def register() -> None:
        register_fake_replica(name, endpoint, artifact_uri=artifact)
        price_model(name, input_per_million="1000", output_per_million="2000")

    committed(django_db_blocker, register)
    yield CountedModel(name, endpoint)
    process.kill()
    process.wait(5)


@pytest.fixture
def gateway(spawn_gateway) -> Gateway:
    """A gateway of this test's own (overrides the session's, which serves the real engines;
    tests/faults/input/test_openai.py has its own)."""
    return spawn_gateway(REPLICA_STALE_AFTER="86400", ROUTING_REFRESH_SECONDS="0.2", ENGINE_FIRST_TOKEN_TIMEOUT="2")
