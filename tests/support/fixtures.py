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

import contextlib
import os
import subprocess
import sys
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


class _BackgroundVerifierBuild:
    """The cache's local models built by a process of their own, at the lowest priority, while
    the tests before the first that needs them run: a fresh checkout's build takes minutes of
    CPU the suite's waits on engines and browsers leave idle. Started only when a collected
    test needs them and they are not current."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None

    def start(self) -> None:
        from core import embedded
        from serving.semcache import verifier_build

        folder = _verifier_folder()
        why = verifier_build.is_current(folder, verifier_build.inputs_digest())  # "" when current
        if not why:
            return
        self.log = embedded.VAR_DIR / "logs" / f"build-cache-verifier-{os.environ.get('TEST_SESSION') or '0'}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        # One thread: at the lowest priority on a busy machine, two threads of torch mostly
        # wait for each other (an epoch took 241 s on the 2026-11-29 full run, 26 s alone).
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "TEST_SEMANTIC_CACHE_VERIFIER_DIR": str(folder)}  # fmt: skip
        manage = Path(__file__).resolve().parents[2] / "manage.py"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                ["nice", "-n", "19", sys.executable, str(manage), "build_cache_verifier"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip

    def wait(self) -> None:
        """Until the build ends; a failed build is reported with its log (the fixture then builds
        in this process, so its error is the test's)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            # A test waits for it now: the build's threads back to normal priority (raising a
            # priority needs root; without it the build finishes at its own pace).
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PGRP, self.process.pid, 0)
        try:
            code: int | str = self.process.wait(timeout=1800)
        except subprocess.TimeoutExpired:
            code = "still running after 30 min: stopped"
        finally:
            self.stop()
        if code != 0 and self.log is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            print(f"the background build of the cache's local models failed ({code}):\n{tail}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None


_verifier_build = _BackgroundVerifierBuild()


def pytest_collection_finish(session: pytest.Session) -> None:
    if any("cache_verifier" in getattr(item, "fixturenames", ()) for item in session.items):
        _verifier_build.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _verifier_build.stop()


@pytest.fixture(scope="session")
def cache_verifier() -> Iterator[Path]:
    """The semantic cache's local models (serving.semcache.paraphrase), built once where
    ``bootstrap`` builds them (a few minutes on a fresh checkout, in the background from the
    session's start; nothing when current), and this process's settings pointed at them for
    the session. A gateway started by a test gets them with ``TEST_SEMANTIC_CACHE_VERIFIER_DIR``."""
    from django.conf import settings
    from django.test import override_settings

    from serving.semcache import paraphrase, verifier_build

    folder = _verifier_folder()
    _verifier_build.wait()
    verifier_build.build(folder, progress=lambda line: None)  # nothing to do once the background build is done
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
