"""Shared fixtures: the real embedded services, two tenants, the bundled models once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core import embedded

# The fixtures the data-plane and fault tests share (api_key, gateway, fake_model, …), defined
# once for the whole run: a session fixture in two conftest files would start twice.
pytest_plugins = ["tests.support.fixtures"]


def pytest_configure(config: pytest.Config) -> None:
    # The same code as `make run` starts the real PostgreSQL and Redis (a no-op when they
    # are up, or when DATABASE_URL / REDIS_URL point at real services).
    want_pg, want_redis = embedded.needed()
    try:
        embedded.start(postgres=want_pg, redis=want_redis)
    except embedded.EmbeddedServiceError as exc:
        # The sentence says what to fix; a traceback through pytest's hooks would bury it.
        pytest.exit(f"embedded services: {exc}", returncode=3)
    _stop_leftovers()


def _stop_leftovers() -> None:
    """A run killed before its teardown may have left its engine supervisors: stopped before
    this run creates its database (their connections would keep the old one from being
    dropped) or starts its own (they hold their hosts' leases)."""
    from django.conf import settings

    from tests.support.processes import stop_leftover_supervisors

    database = settings.DATABASES["default"]["TEST"]["NAME"]
    stopped = stop_leftover_supervisors(session=os.environ.get("TEST_SESSION") or "0", database=database)
    if stopped:
        print(f"stopped processes left by an earlier test run of {database}: pids {stopped}")


def _always_the_default_database() -> None:
    """pytest-django creates only the databases the collected tests mark (``db``,
    ``django_db``); a run whose tests only ask for ``django_db_setup`` (the committed-writes
    fixtures) would otherwise run on the development database. The test database is always
    created, and ``django_db_setup`` below refuses any other."""
    from pytest_django import fixtures

    marked = fixtures._get_databases_for_setup

    def with_default(items: Any) -> tuple[set[str], set[str]]:
        aliases, serialized = marked(items)
        return aliases | {"default"}, serialized

    fixtures._get_databases_for_setup = with_default


_always_the_default_database()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse transactional tests. ``transactional_db`` (``django_db(transaction=True)``,
    ``live_server``) empties every table when it ends, and pytest-django runs such tests before
    the ones that only use committed writes: the bundled models, committed once per session,
    were gone for every browser test after (CI of 2026-11-28: 14 failed). Commit what another
    process must see with ``tests.support.gateway.committed`` instead."""
    flushing = [
        item.nodeid
        for item in items
        if {"transactional_db", "live_server"} & set(getattr(item, "fixturenames", ()))
        or any(mark.kwargs.get("transaction") for mark in item.iter_markers("django_db"))
    ]
    if flushing:
        raise pytest.UsageError(
            "transactional tests empty the shared test database when they end; commit with "
            "tests.support.gateway.committed instead: " + ", ".join(flushing[:5])
        )


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None) -> None:
    from django.db import connection

    name = connection.settings_dict["NAME"]
    assert name.startswith("test_"), f"refusing to run tests on the database {name!r}"


@pytest.fixture(scope="session", autouse=True)
def clean_test_redis() -> None:
    """The test database number starts empty: ids restart with the test database, so
    limiter state left by an earlier run would otherwise belong to this run's keys."""
    from django.conf import settings

    from core.redis import sync_redis

    assert settings.REDIS_NAMESPACE.startswith("ip-test"), "refusing to flush a Redis that is not the test one"
    sync_redis().flushdb()


@pytest.fixture(scope="session")
def artifact_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="session")
def bundled_models(
    django_db_setup: None, django_db_blocker: pytest.FixtureRequest, artifact_root: Path
) -> Iterator[dict[str, object]]:
    """Import the bundled models once per session into a throw-away artifact store.

    Committed outside any test transaction, so every test sees the registered versions.
    """
    from django.conf import settings

    from registry import artifacts
    from registry.bundled import import_bundled_models

    previous = settings.ARTIFACT_STORE
    settings.ARTIFACT_STORE = {
        "BACKEND": "registry.artifacts.LocalArtifactStore",
        "OPTIONS": {"root": str(artifact_root)},
    }
    artifacts.get_artifact_store.cache_clear()
    messages: list[str] = []
    with django_db_blocker.unblock():
        versions = {v.model.name: v for v in import_bundled_models(progress=messages.append)}  # model loaded here
    yield {"versions": versions, "messages": messages}
    settings.ARTIFACT_STORE = previous
    artifacts.get_artifact_store.cache_clear()


@pytest.fixture(scope="session")
def engines(bundled_models, django_db_blocker, tmp_path_factory):
    """Real vLLM replicas of both bundled models, once per session (tests/support/gateway.py).
    Defined here, once: never import it into a test module (that would start a second set)."""
    from tests.support.gateway import run_engines

    yield from run_engines(bundled_models, django_db_blocker, tmp_path_factory)


@pytest.fixture
def alice_org(db: None):
    from accounts.services import organization_create

    return organization_create(name="Alice Corp")


@pytest.fixture
def bob_org(db: None):
    from accounts.services import organization_create

    return organization_create(name="Bob Ltd")


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def people(db: None) -> dict[str, Any]:
    """alice and bob (future org admins), carol (a member), ml (the platform team)."""
    from django.contrib.auth import get_user_model

    users = get_user_model().objects
    return {
        name: users.create_user(username=name, password="pw-1234567890") for name in ("alice", "bob", "carol", "ml")
    }


@pytest.fixture
def store(settings, tmp_path) -> Iterator[Any]:
    """A local artifact store of this test's own."""
    from registry import artifacts

    settings.ARTIFACT_STORE = {
        "BACKEND": "registry.artifacts.LocalArtifactStore",
        "OPTIONS": {"root": str(tmp_path / "store")},
    }
    artifacts.get_artifact_store.cache_clear()
    yield artifacts.get_artifact_store()
    artifacts.get_artifact_store.cache_clear()
