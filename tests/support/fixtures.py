"""The fixtures the data-plane and fault tests share, a pytest plugin (``pytest_plugins`` in
tests/conftest.py), so that each session fixture starts once whichever folders run:

- ``api_key``, ``make_api_key``: keys of new organisations, committed for gateways to see.
- ``gateway``: a real gateway process in front of the session's real engines (``engines``).
- ``spawn_gateway``: extra gateways for one test; ``fault_gateway``: one with short time
  limits, for the fake engines.
- ``fake_model``: a fake engine process (tests/support/fake_engine.py) registered as the only
  ready replica of a model of its own, for fault injection.
- ``worker_factory``: real batch workers (``celery worker -Q batch``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.batch_worker import BatchWorker
from tests.support.gateway import (
    ApiKeyFixture,
    FakeModel,
    committed,
    register_fake_replica,
    start_fake_engine,
)
from tests.support.processes import Gateway, start_gateway, stop_process


@pytest.fixture
def api_key(django_db_setup, django_db_blocker) -> ApiKeyFixture:
    """A key of a new organisation for each test: the semantic cache is per organisation, so
    no test is answered from another test's answers."""
    from accounts.services import api_key_create, organization_create

    def make() -> ApiKeyFixture:
        org = organization_create(name=f"API tests {uuid.uuid4().hex[:6]}")
        issued = api_key_create(organization=org, name="tests", rate_limit_rpm=100_000, rate_limit_tpm=100_000_000)
        return ApiKeyFixture(issued.secret, issued.api_key.pk, org.pk)

    return committed(django_db_blocker, make)


def _verifier_folder() -> Path:
    from core import embedded

    return Path(os.environ.get("SEMANTIC_CACHE_VERIFIER_DIR") or embedded.VAR_DIR / "semcache-verifier")


@pytest.fixture(scope="session")
def cache_verifier() -> Iterator[Path]:
    """The semantic cache's local models (serving.semcache.paraphrase), built once where
    ``bootstrap`` builds them (assembled from the shipped tuned weights: under a minute on a
    fresh checkout; nothing when current), and this process's settings pointed at them for
    the session. A gateway started by a test gets them with ``TEST_SEMANTIC_CACHE_VERIFIER_DIR``."""
    from django.conf import settings
    from django.test import override_settings

    from serving.semcache import paraphrase, verifier_build

    folder = _verifier_folder()
    verifier_build.build(folder, progress=lambda line: None)
    with override_settings(SEMANTIC_CACHE_VERIFIER_DIR=str(folder)):
        paraphrase.forget()
        assert str(folder) == settings.SEMANTIC_CACHE_VERIFIER_DIR
        yield folder
    paraphrase.forget()


@pytest.fixture(scope="session")
def make_api_key(django_db_setup, django_db_blocker) -> Callable[..., ApiKeyFixture]:
    from accounts.services import api_key_create, organization_create

    def make(**kwargs: Any) -> ApiKeyFixture:
        def create() -> ApiKeyFixture:
            org = organization_create(name=f"Tenant {uuid.uuid4().hex[:8]}")
            issued = api_key_create(organization=org, name="k", **kwargs)
            return ApiKeyFixture(issued.secret, issued.api_key.pk, org.pk)

        return committed(django_db_blocker, create)

    return make


@pytest.fixture(scope="session")
def gateway(engines, tmp_path_factory) -> Iterator[Gateway]:
    gw = start_gateway(tmp_path_factory.mktemp("gateway"))
    yield gw
    gw.stop()


@pytest.fixture
def spawn_gateway(tmp_path) -> Iterator[Callable[..., Gateway]]:
    """Start extra gateways for one test; all are stopped afterwards, whatever happened."""
    started: list[Gateway] = []

    def spawn(**env: str) -> Gateway:
        gateway = start_gateway(tmp_path, **env)
        started.append(gateway)
        return gateway

    yield spawn
    for gateway in started:
        gateway.stop()


@pytest.fixture
def fake_model(django_db_setup, django_db_blocker) -> Iterator[FakeModel]:
    process, endpoint = start_fake_engine()
    name = f"fake-{uuid.uuid4().hex[:8]}"
    replica_id = committed(django_db_blocker, lambda: register_fake_replica(name, endpoint))
    yield FakeModel(name, endpoint, process, replica_id)
    stop_process(process, grace=0)


@pytest.fixture(scope="session")
def fault_gateway(django_db_setup, tmp_path_factory) -> Iterator[Gateway]:
    """A gateway with short time limits, for the fake engines (whose heartbeats never age)."""
    gw = start_gateway(
        tmp_path_factory.mktemp("fault-gateway"),
        ENGINE_FIRST_TOKEN_TIMEOUT="1.5",
        ENGINE_REQUEST_TIMEOUT="6",
        REPLICA_STALE_AFTER="86400",
        ROUTING_REFRESH_SECONDS="0.2",
    )
    yield gw
    gw.stop()


@pytest.fixture
def worker_factory(tmp_path) -> Iterator[Callable[..., BatchWorker]]:
    started: list[BatchWorker] = []

    def start(**env: str) -> BatchWorker:
        worker = BatchWorker(tmp_path, **env)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()
