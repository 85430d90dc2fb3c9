"""The admin console in real Chromium: the overview's charts and live view, the models pages,
registering a version from the form. Every step saves a screenshot under tests/screenshots/."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from tests.support.browser import log_in, screenshot

# No `db` fixture: playwright's sync API runs an event loop in this thread, where Django
# refuses ORM calls; data is committed in fixtures, or from a worker thread.
pytestmark = pytest.mark.browser


def off_the_loop(django_db_blocker, work) -> Any:
    """Run ORM work from the test body: in a worker thread, outside playwright's event loop."""
    from django.db import connection

    def run() -> Any:
        try:
            return work()
        finally:
            connection.close()  # the worker's own connection, or it outlives the test database

    with django_db_blocker.unblock(), ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


def add_rollup(api_key_id: int, organization_id: int, model: str, requests: int) -> None:
    from billing.models import UsageRollup

    UsageRollup.objects.create(
        period=UsageRollup.Period.HOUR, start=datetime.now(UTC).replace(minute=0, second=0, microsecond=0),
        organization_id=organization_id, api_key_id=api_key_id, model=model, model_version="1", requests=requests,
        errors=1, output_tokens=40 * requests, cache_hits=requests // 4, cost=Decimal("0.01"),
        latency_p50_ms=180, latency_p99_ms=900, ttft_p50_ms=40, ttft_p99_ms=160,
    )  # fmt: skip


@pytest.fixture(scope="module")
def traffic(committed_users, django_db_blocker) -> Iterator[dict[str, Any]]:
    """A key of ``org`` with an hour of committed rollups, and a fresh artifact in the store."""
    import tempfile
    from pathlib import Path

    from accounts.models import ApiKey
    from accounts.services import api_key_create
    from billing.models import UsageRollup
    from registry.artifacts import get_artifact_store

    tag = uuid.uuid4().hex[:6]
    with django_db_blocker.unblock():
        key = api_key_create(organization=committed_users["org"], name=f"browser-{tag}").api_key
        add_rollup(key.pk, key.organization_id, f"charted-{tag}", 600)
    with tempfile.TemporaryDirectory() as source:
        (Path(source) / "config.json").write_text('{"max_position_embeddings": 1024}')
        (Path(source) / "model.safetensors").write_bytes(b"\x00" * 4096)
        stored = get_artifact_store().put_directory(source=Path(source), key=f"browser-{tag}/1")
    made = {"tag": tag, "key": key, "artifact": stored}
    yield made
    with django_db_blocker.unblock():
        from registry.models import AuditEntry, Model, ModelVersion

        UsageRollup.objects.filter(api_key=key).delete()
        ApiKey.objects.filter(pk=key.pk).delete()
        ModelVersion.objects.filter(model__name__endswith=tag).delete()
        Model.objects.filter(name__endswith=tag).delete()
        AuditEntry.objects.filter(target__contains=tag).delete()


@pytest.mark.django_db
def test_the_console_routes_exist():
    """Also makes pytest-django create the test database when this module runs alone: it only
    sets up databases that some collected test asks for, and the browser tests below cannot."""
    from django.urls import reverse

    assert reverse("console:overview") == "/console/"
    assert reverse("console:model-version", args=["m", "1"]) == "/console/models/m/1/"


class TestAdminConsole:
    # The committed data comes before chromium (whose event loop would refuse the ORM).
    def test_the_overview_draws_charts_and_updates_live(self, committed_users, traffic, console_gateway, chromium,
                                                        django_db_blocker):  # fmt: skip
        page = chromium.new_page(viewport={"width": 1280, "height": 900})
        log_in(page, console_gateway.base_url, committed_users["platform_admin"].username)
        page.wait_for_selector("h1:has-text('Overview')")
        page.wait_for_selector("#chart-requests.js-plotly-plot")
        assert page.locator(".plot.js-plotly-plot").count() == 6
        assert page.locator(f"#chart-requests .legendtext:has-text('charted-{traffic['tag']}:1')").count() == 1
        screenshot(page, "console-overview")

        page.wait_for_function("Number(document.getElementById('live-status').dataset.updates) >= 1", timeout=20_000)
        assert page.locator("#live-status").inner_text().startswith("Live · updated")
        screenshot(page, "console-overview-live-connected")

        # New traffic reaches the rollups: the page shows it without a reload.
        live_model = f"live-{traffic['tag']}"
        key = traffic["key"]
        off_the_loop(django_db_blocker, lambda: add_rollup(key.pk, key.organization_id, live_model, 1200))
        page.wait_for_selector(f"tr[data-version-row='{live_model}:1']", timeout=20_000)
        page.wait_for_selector(f"#chart-requests .legendtext:has-text('{live_model}:1')")
        screenshot(page, "console-overview-live-update")

        # A phone: no sideways scrolling, charts still drawn.
        page.set_viewport_size({"width": 390, "height": 844})
        # Plotly redraws each chart for the narrower window (a debounced resize: on a loaded
        # machine, longer than a fixed wait), each within its card.
        page.wait_for_function(
            "[...document.querySelectorAll('.plot.js-plotly-plot')].every(p => {"
            " const svg = p.querySelector('svg.main-svg');"
            " return svg && svg.getBoundingClientRect().width <= p.getBoundingClientRect().width + 1; })",
            timeout=20_000,
        )
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
        screenshot(page, "console-overview-phone")
        page.close()

    def test_an_admin_browses_the_models_and_registers_a_version(self, committed_users, traffic, console_gateway,
                                                                 chromium):  # fmt: skip
        page = chromium.new_page(viewport={"width": 1280, "height": 900})
        log_in(page, console_gateway.base_url, committed_users["platform_admin"].username)
        page.click("nav[aria-label=Console] a:has-text('Models')")
        page.wait_for_selector("h1:has-text('Models')")
        # Other tests commit models of their own: find it through the filter, as a person would.
        page.fill("#id_q", "smollm2")
        page.click("form.filters button[type=submit]")
        page.wait_for_selector("tr[data-model='smollm2-135m-instruct']")
        assert page.locator("tr[data-model='smollm2-135m-instruct']").count() == 1
        screenshot(page, "console-models")

        page.click("tr[data-model='smollm2-135m-instruct'] td a")
        page.wait_for_selector("h2:has-text('Artifact')")
        assert page.locator("[data-checksum]").inner_text().strip() != ""
        page.click("summary:has(#config-title)")  # the raw config is folded
        assert "max_seq_len" in page.locator("pre.config").inner_text()
        screenshot(page, "console-model-version")

        page.goto(f"{console_gateway.base_url}/console/models/")
        page.click("a:has-text('Register a version')")
        page.wait_for_selector("h1:has-text('Register a version')")
        name = f"browser-{traffic['tag']}"
        page.fill("#id_name", name)
        page.fill("#id_version", "1")
        page.fill("#id_framework", "pytorch")
        # A missing artifact first: the error is on its field, the rest is kept.
        page.fill("#id_artifact_uri", "local://no/such/artifact")
        page.fill("#id_config", '{"max_seq_len": 1024}')
        page.click("#register-submit")
        page.wait_for_selector("#id_artifact_uri-errors")
        assert "There is no artifact" in page.locator("#id_artifact_uri-errors").inner_text()
        assert page.input_value("#id_name") == name
        screenshot(page, "console-register-error")

        page.fill("#id_artifact_uri", traffic["artifact"].uri)
        page.click("#register-submit")
        page.wait_for_selector(".message-success")
        assert traffic["artifact"].sha256 in page.locator(".message-success").inner_text()
        assert page.locator("[data-checksum]").inner_text().strip() == traffic["artifact"].sha256
        assert page.locator("[data-timeline] [data-event=registered]").count() == 1  # the version's timeline
        screenshot(page, "console-register-done")

        page.click("nav[aria-label=Console] a:has-text('Audit log')")
        page.fill("#id_q", name)
        page.click("button:has-text('Search')")
        page.wait_for_selector(f".audit-target:has-text('{name}:1')")
        screenshot(page, "console-audit-search")
        page.close()
