"""Helpers of the browser tests: Chromium's arguments, screenshots, signing in, work done
outside Playwright's event loop, canary traffic and decisions."""

from __future__ import annotations

import random
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

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


def fill_canary_wizard(
    page: Any,
    *,
    steps: str,
    interval: str,
    min_samples: str,
    max_p99_ms: str,
    min_success: str,
    auto_promote: bool,
    shot: str = "",
) -> None:
    """Walk the canary wizard (v1 → v2) step by step as a person does, each step's Next checked
    by the page, up to its review; ``shot`` names a screenshot of each step."""
    page.select_option("#id_base_version", "v1")
    page.select_option("#id_canary_version", "v2")
    if shot:
        screenshot(page, f"{shot}-1-versions")
    page.click("[data-wizard-next]")
    page.fill("#id_steps", steps)
    page.fill("#id_interval_seconds", interval)
    page.fill("#id_min_samples", min_samples)
    if shot:
        screenshot(page, f"{shot}-2-steps")
    page.click("[data-wizard-next]")
    page.fill("#id_max_p99_latency_ms", max_p99_ms)
    page.fill("#id_min_success_rate", min_success)
    if auto_promote:
        page.check("#id_auto_promote")
    page.click("[data-wizard-next]")
    page.wait_for_selector("#canary-review [data-review='Versions']")
    if shot:
        screenshot(page, f"{shot}-4-review")


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
