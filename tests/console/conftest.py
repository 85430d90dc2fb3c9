"""Shared pieces of the console's browser tests: Chromium, a daphne process, committed users.

Playwright's sync API runs an event loop in the test thread, where Django refuses ORM calls,
so data the browser needs is committed in fixtures (``django_db_blocker.unblock()``) before
the browser opens, and removed after. Every browser test saves what the user saw under
tests/screenshots/ (git-ignored) through ``screenshot``.
"""

from __future__ import annotations

import random
import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.processes import Gateway, start_gateway

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = Path(__file__).resolve().parents[1] / "screenshots"
PASSWORD = "s3cret-pass-42"
T = TypeVar("T")


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


def screenshot(page: Any, name: str) -> Path:
    """Save the whole page as tests/screenshots/<name>.png, for a person to look at."""
    SCREENSHOTS.mkdir(exist_ok=True)
    path = SCREENSHOTS / f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def log_in(page: Any, base_url: str, username: str, password: str = PASSWORD) -> None:
    """Sign in through the login form, as a person would."""
    page.goto(f"{base_url}/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")
    page.wait_for_load_state("load")


def outside_the_event_loop(work: Callable[[], T]) -> T:
    """Run ORM work in a thread of its own: Playwright's sync API keeps an event loop running
    in the test thread, where Django refuses database calls. The thread's connection is
    closed after, so the test database can be dropped at the end of the session."""
    from django.db import connection

    def run() -> T:
        try:
            return work()
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


def serve_canary_requests(model: str, key: Any) -> None:
    """Usage records of ``model``'s v1 (240) and v2 (60), answered well, as the gateway writes them:
    enough for the canary controller to judge a canary of v2."""
    from django.utils import timezone

    from billing.models import UsageRecord

    rng = random.Random(11)
    records = []
    for version, count in (("v1", 240), ("v2", 60)):
        for _ in range(count):
            tokens = rng.randint(10, 60)
            ttft = int(rng.lognormvariate(4.5, 0.3))
            records.append(
                UsageRecord(
                    api_key=key, organization_id=key.organization_id, model=model, model_version=version,
                    prompt_tokens=12, completion_tokens=tokens, total_tokens=12 + tokens,
                    latency_ms=ttft + 18 * (tokens - 1), ttft_ms=ttft, status_code=200, finish_reason="stop",
                    created_at=timezone.now(),
                )
            )  # fmt: skip
    UsageRecord.objects.bulk_create(records)


def tick_until_decided(deadline_s: float = 30.0) -> int:
    """The canary controller's beat, as Celery runs it, until it has judged a canary."""
    from rollout.tasks import canary_tick

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        decided = canary_tick()
        if decided:
            return decided
        time.sleep(0.5)
    return 0


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
