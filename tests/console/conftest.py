"""Shared pieces of the console's browser tests: Chromium, a daphne process, committed users.

Playwright's sync API runs an event loop in the test thread, where Django refuses ORM calls,
so data the browser needs is committed in fixtures (``django_db_blocker.unblock()``) before
the browser opens, and removed after. Every browser test saves what the user saw under
tests/screenshots/ (git-ignored) through ``screenshot``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    PASSWORD,
    outside_the_event_loop,
)
from tests.support.processes import Gateway, start_gateway


@pytest.fixture(scope="module")
def console_gateway(bundled_models, tmp_path_factory) -> Iterator[Gateway]:
    """A real daphne process serving the console (and the API) for one test module."""
    gw = start_gateway(tmp_path_factory.mktemp("console-gateway"))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield instance
        instance.close()


@pytest.fixture(scope="module")
def committed_users(django_db_setup, django_db_blocker) -> Iterator[dict[str, Any]]:
    """Committed accounts for every role, all with PASSWORD: ``platform_admin`` (superuser),
    ``org_admin`` and ``org_member`` of organisation ``org``, and ``outsider`` (a member of
    ``other_org`` only). Removed at the end of the module. Safe to request after ``chromium``."""
    import uuid

    from django.contrib.auth import get_user_model
    from django.db import connection

    from accounts.models import Membership, Organization, Role

    tag = uuid.uuid4().hex[:6]

    def create() -> dict[str, Any]:
        # pytest-django sets up the test database only for the databases some collected test
        # marks; a browser module run alone would otherwise write to the development one.
        assert connection.settings_dict["NAME"].startswith("test_"), "run with a django_db test in the session"
        users = get_user_model().objects
        org = Organization.objects.create(name=f"Acme {tag}", slug=f"acme-{tag}")
        other_org = Organization.objects.create(name=f"Globex {tag}", slug=f"globex-{tag}")
        made: dict[str, Any] = {
            "platform_admin": users.create_superuser(username=f"admin-{tag}", password=PASSWORD),
            "org_admin": users.create_user(username=f"orgadmin-{tag}", password=PASSWORD),
            "org_member": users.create_user(username=f"member-{tag}", password=PASSWORD),
            "outsider": users.create_user(username=f"outsider-{tag}", password=PASSWORD),
        }
        Membership.objects.create(user=made["org_admin"], organization=org, role=Role.ORG_ADMIN)
        Membership.objects.create(user=made["org_member"], organization=org, role=Role.ORG_MEMBER)
        Membership.objects.create(user=made["outsider"], organization=other_org, role=Role.ORG_ADMIN)
        made.update(org=org, other_org=other_org)
        return made

    def delete() -> None:
        for key in ("platform_admin", "org_admin", "org_member", "outsider"):
            made[key].delete()

    with django_db_blocker.unblock():
        made = outside_the_event_loop(create)
    yield made
    with django_db_blocker.unblock():
        outside_the_event_loop(delete)
