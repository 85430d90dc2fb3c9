"""The customer portal in real Chromium: an org admin creates a key and sees it once, calls the
real API with it, sees the usage on the charts once the rollups run, and downloads an invoice.

The API call goes through a real daphne gateway to a fake engine process (tests/support/fake_engine.py)
registered as the only replica of an embedding model of its own: metering, the usage stream,
the persister and the rollups are the real ones, without starting vLLM on a shared machine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.console.test_layout_walk import OVERFLOW_JS
from tests.support.browser import log_in, screenshot
from tests.support.gateway import committed, persisted, price_model, register_fake_replica, start_fake_engine
from tests.support.processes import Gateway, start_gateway

pytestmark = pytest.mark.browser

DASH = "\N{EN DASH}"  # between the first and the last day the usage page shows


@pytest.mark.django_db
def test_the_portals_pages_are_routed():
    """Also makes this module safe to run alone: pytest-django (4.14) creates the test database
    only when a collected test asks for one, and the browser test reaches the database through
    committed fixtures only, which would otherwise write to the development database."""
    from django.urls import reverse

    for name in ("portal-usage", "portal-keys", "portal-key-create", "portal-invoices"):
        assert reverse(f"console:{name}", kwargs={"org_id": 1}).startswith("/portal/1/")


@pytest.fixture(scope="module")
def console_gateway(django_db_setup, tmp_path_factory) -> Iterator[Gateway]:
    """The console's daphne process, which also serves /v1. The fake engine never heartbeats,
    so its replica must not be judged stale (as for the serving tests' fake engines)."""
    gw = start_gateway(
        tmp_path_factory.mktemp("portal-gateway"), REPLICA_STALE_AFTER="86400", ROUTING_REFRESH_SECONDS="0.5"
    )
    yield gw
    gw.stop()


@dataclass
class Embedder:
    name: str
    endpoint: str


@pytest.fixture(scope="module")
def embedder(django_db_setup, django_db_blocker) -> Iterator[Embedder]:
    """A priced embedding model served by a fake engine, registered before the gateway starts."""
    from django.db import connection

    assert connection.settings_dict["NAME"].startswith("test_"), "not the test database"
    process, endpoint = start_fake_engine()
    name = f"portal-embed-{uuid.uuid4().hex[:6]}"

    def register() -> None:
        register_fake_replica(name, endpoint, task="embedding")
        price_model(name, input_per_million="250", output_per_million="0")

    committed(django_db_blocker, register)
    yield Embedder(name, endpoint)
    process.kill()
    process.wait(5)


def no_horizontal_scroll(page: Any) -> bool:
    return bool(page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"))


def test_an_org_admin_creates_a_key_calls_the_api_and_sees_usage_and_an_invoice(
    committed_users, embedder, console_gateway, chromium, django_db_blocker, tmp_path: Path
):
    from accounts.models import ApiKey
    from billing import invoicing
    from billing.services import invoice_draft
    from billing.tasks import usage_rollups_build

    base = console_gateway.base_url
    org = committed_users["org"]
    context = chromium.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    try:
        log_in(page, base, committed_users["org_admin"].username)
        assert page.url.rstrip("/").endswith(f"/portal/{org.pk}"), page.url  # one organisation: its portal
        # Without usage yet (other browser tests may have metered some to this organisation): the
        # way to a first request, not empty charts (issue 40, item 8).
        page.wait_for_selector("#no-usage a[href$='/quickstart/'], #chart-cost .main-svg")
        if page.locator("#no-usage").count():
            assert page.locator("#chart-cost").count() == 0
        screenshot(page, "portal-01-usage-before")

        # Create a key: its secret is on the answer to the form, once.
        page.get_by_role("link", name="API keys", exact=True).click()
        page.get_by_role("link", name="Create a key").click()
        page.get_by_label("Name").fill("browser key")
        page.get_by_label("Requests per minute").fill("120")
        screenshot(page, "portal-02-key-form")
        page.get_by_role("button", name="Create key").click()
        secret = page.input_value("#api-key-secret")
        assert secret.startswith("sk-")
        assert "created." in page.inner_text(".messages")
        screenshot(page, "portal-03-key-secret-once")
        page.get_by_role("link", name="back to the keys").click()
        assert secret not in page.content()
        assert page.locator("#keys tbody tr").count() == 1
        screenshot(page, "portal-04-key-list")

        # Call the real API with it, then persist and roll up, as the beat tasks would.
        request_ids = []
        for text in ("hello portal", "a second request", "and a third one"):
            response = httpx.post(
                f"{base}/v1/embeddings", json={"model": embedder.name, "input": text}, timeout=30,
                headers={"Authorization": f"Bearer {secret}"},
            )  # fmt: skip
            assert response.status_code == 200, response.text
            request_ids.append(response.headers["x-request-id"])
        records = committed(django_db_blocker, lambda: persisted(request_ids))
        assert len(records) == 3
        committed(django_db_blocker, usage_rollups_build)
        tokens = sum(r.prompt_tokens for r in records.values())

        page.get_by_role("link", name="Usage", exact=True).click()
        page.wait_for_selector("#chart-cost .main-svg")
        assert page.inner_text("#total-requests") == "3"
        assert page.inner_text("#total-input") == f"{tokens:,}"
        assert embedder.name in page.inner_text("#usage-by-model")
        # The chart has the model's trace (plotly draws a legend entry per trace).
        assert embedder.name in page.locator("#chart-cost .legend").text_content()
        screenshot(page, "portal-05-usage-after")

        # Per key, this month: the key masked with its name, the days shown, the invoice so far.
        page.get_by_role("link", name="By key", exact=True).click()
        page.wait_for_selector("#usage-by-key")
        key = committed(django_db_blocker, lambda: ApiKey.objects.get(organization=org, name="browser key"))
        assert key.masked in page.inner_text("#usage-by-key")
        assert "browser key" in page.inner_text("#usage-by-key")
        assert "browser key" in page.locator("#chart-cost .legend").text_content()
        page.get_by_role("link", name="This month", exact=True).click()
        page.wait_for_selector("#chart-cost .main-svg")
        today = records[request_ids[0]].created_at.date()
        assert page.inner_text("#usage-range") == f"{today.replace(day=1)} {DASH} {today} (UTC)"
        assert page.inner_text("#usage-presets a[aria-current]") == "This month"
        assert page.locator("#usage-by-key").is_visible()  # the grouping stays
        assert embedder.name in page.inner_text("#month-preview-lines")
        assert "$" in page.inner_text("#month-preview-total")
        screenshot(page, "portal-05b-usage-by-key-this-month")
        with page.expect_download() as csv_download:
            page.click("#usage-csv")
        assert csv_download.value.suggested_filename == f"usage-{org.slug}-{today.replace(day=1)}-{today}.csv"
        # A custom range that ends before it starts says so, and the page still works.
        page.get_by_label("From", exact=True).fill(str(today))
        page.get_by_label("To", exact=True).fill(str(today.replace(day=1) - timedelta(days=1)))
        page.get_by_role("button", name="Show").click()
        assert "is before the first" in page.inner_text("#usage-window-errors")
        screenshot(page, "portal-05c-usage-bad-range")
        page.set_viewport_size({"width": 800, "height": 900})
        page.get_by_role("link", name="By key", exact=True).click()
        page.wait_for_selector("#chart-cost .main-svg")
        assert page.evaluate(OVERFLOW_JS) == []
        screenshot(page, "portal-05d-usage-800")
        page.set_viewport_size({"width": 1280, "height": 900})
        page.get_by_role("link", name="By model", exact=True).click()
        page.wait_for_selector("#usage-by-model")

        # Phone width: nothing scrolls sideways but the tables inside their wrappers.
        page.set_viewport_size({"width": 390, "height": 844})
        page.reload()
        page.wait_for_selector("#chart-cost .main-svg")
        assert no_horizontal_scroll(page)
        screenshot(page, "portal-06-usage-phone")
        page.set_viewport_size({"width": 1280, "height": 900})

        # An invoice of this month, drafted by the platform, downloaded as a PDF.
        month = invoicing.month_start(records[request_ids[0]].created_at)
        invoice = committed(django_db_blocker, lambda: invoice_draft(organization=org, period=month))
        number = invoicing.display_number(invoice)
        page.get_by_role("link", name="Invoices", exact=True).click()
        page.get_by_role("link", name=number, exact=True).click()
        assert embedder.name in page.inner_text("#invoice-lines")
        screenshot(page, "portal-07-invoice")
        with page.expect_download() as download_info:
            page.click("#download-pdf")
        download = download_info.value
        assert download.suggested_filename == f"{number}-{month:%Y-%m}.pdf"
        saved = tmp_path / download.suggested_filename
        download.save_as(saved)
        assert saved.read_bytes().startswith(b"%PDF")
        screenshot(page, "portal-08-invoice-downloaded")

        # Revoke the key with the confirm step; the API refuses it from then on.
        key_id = committed(django_db_blocker, lambda: ApiKey.objects.get(organization=org, name="browser key").pk)
        page.get_by_role("link", name="API keys", exact=True).click()
        page.locator(f"#key-{key_id}").get_by_role("link", name="Revoke").click()
        screenshot(page, "portal-09-revoke-confirm")
        page.get_by_role("button", name="Revoke key").click()
        assert "revoked." in page.inner_text(".messages")
        screenshot(page, "portal-10-revoked")
        deadline = time.monotonic() + 3  # gateways drop a revoked key within a second
        while True:
            refused = httpx.post(
                f"{base}/v1/embeddings", json={"model": embedder.name, "input": "after revoking"}, timeout=30,
                headers={"Authorization": f"Bearer {secret}"},
            )  # fmt: skip
            if refused.status_code == 401 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert refused.status_code == 401
    except Exception:
        screenshot(page, "portal-failure")
        raise
    finally:
        context.close()
