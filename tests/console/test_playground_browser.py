"""The playground and the quickstart in real Chromium, against the real SmolLM2 replica.

An org member signs in, streams a long answer and watches the readout move, stops it (the
request is metered as cancelled, 499, to the member's playground key), then compares two
models side by side. What the engine writes is never asserted, only that it streams.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.processes import Gateway, start_gateway
from tests.serving.conftest import fake_model  # noqa: F401 - a fixture of the data-plane tests, used here too
from tests.support.browser import log_in, screenshot
from tests.support.gateway import committed, persisted

pytestmark = [pytest.mark.browser, pytest.mark.engine]

CHAT = "smollm2-135m-instruct"
STORY = "Write a very long story about a dragon who learns to bake bread. Give it many chapters and lots of detail."


@pytest.fixture(scope="module")
def playground_gateway(engines, tmp_path_factory) -> Iterator[Gateway]:
    # The fake engine of the comparison sends no heartbeats: its replica must not go stale.
    gw = start_gateway(tmp_path_factory.mktemp("playground-gateway"), REPLICA_STALE_AFTER="86400")
    yield gw
    gw.stop()


def column(page: Any, name: str) -> Any:
    return page.locator(f".pg-column[data-column='{name}']")


def readout(page: Any, name: str, field: str) -> str:
    return str(column(page, name).locator(f"[data-field='{field}']").inner_text())


def tokens_at_least(page: Any, name: str, count: int, timeout: float = 180_000) -> None:
    page.wait_for_function(
        """([name, count]) => Number(document.querySelector(
             `.pg-column[data-column='${name}'] [data-field='tokens']`).textContent) >= count""",
        arg=[name, count],
        timeout=timeout,
    )


def open_playground(chromium: Any, gateway: Gateway, users: dict[str, Any], **context: Any) -> Any:
    page = chromium.new_context(**context).new_page()
    log_in(page, gateway.base_url, users["org_member"].username)
    page.goto(f"{gateway.base_url}/portal/{users['org'].pk}/playground/")
    return page


@pytest.mark.django_db
def test_the_real_model_and_its_version_are_offered(playground_gateway, committed_users, bundled_models):
    """Not in the browser (Django refuses ORM calls in Playwright's thread). Being marked, it also
    makes pytest-django set up the test database when this module runs alone."""
    from django.test import Client

    client = Client()
    client.force_login(committed_users["org_member"])
    page = client.get(f"/portal/{committed_users['org'].pk}/playground/").content.decode()
    version = bundled_models["versions"][CHAT].version
    assert f'{{"name": "{CHAT}", "versions": ["{version}"], "weighted": ["{version}"]}}' in page


class TestPlaygroundInChromium:
    def test_a_member_streams_a_long_answer_and_stops_it(
        self, playground_gateway, chromium, committed_users, django_db_blocker
    ):
        page = open_playground(chromium, playground_gateway, committed_users)
        screenshot(page, "playground-1-open")
        page.select_option("#pg-model-a", CHAT)
        page.fill("#pg-system", "You are a storyteller.")
        page.fill("#pg-message", STORY)
        page.fill("#pg-max-tokens", "300")
        page.click("#pg-send")

        tokens_at_least(page, "a", 3)
        first = int(readout(page, "a", "tokens"))
        screenshot(page, "playground-2-streaming")
        tokens_at_least(page, "a", first + 8)  # the count moves as tokens arrive
        assert re.fullmatch(r"\d+ ms", readout(page, "a", "ttft"))
        assert float(readout(page, "a", "rate")) > 0
        assert page.locator("#pg-send").is_disabled()
        assert page.locator("#pg-stop").is_enabled()
        assert page.locator(".pg-column[data-column='a'] [data-field='output']").inner_text().strip()

        page.click("#pg-stop")
        page.wait_for_selector(".pg-column[data-column='a'][data-state^='cancelled']", timeout=30_000)
        screenshot(page, "playground-3-stopped")
        assert readout(page, "a", "status") == "cancelled (499)"
        assert page.locator("#pg-send").is_enabled()
        request_id = column(page, "a").get_attribute("data-request-id")
        shown = int(readout(page, "a", "tokens"))
        assert 0 < shown < 300

        def record() -> tuple[int, int, str, int]:
            usage = persisted([request_id])[request_id]
            return usage.status_code, usage.completion_tokens, usage.api_key.name, usage.organization_id

        status, completion_tokens, key_name, org_id = committed(django_db_blocker, record)
        assert status == 499
        assert completion_tokens == shown < 300
        assert key_name == f"Playground ({committed_users['org_member'].username})"
        assert org_id == committed_users["org"].pk
        page.context.close()

    def test_two_models_side_by_side_and_an_error_shown(
        self,
        playground_gateway,
        chromium,
        committed_users,
        fake_model,  # noqa: F811
    ):
        fake_model.control(mode="normal", tokens=30, delay=0.03)
        page = open_playground(chromium, playground_gateway, committed_users)
        page.check("#pg-compare")
        assert column(page, "b").is_visible()
        page.select_option("#pg-model-a", CHAT)
        page.select_option("#pg-model-b", fake_model.name)
        page.select_option("#pg-version-b", "1")  # pinned
        page.fill("#pg-message", "Tell me about bread.")
        page.fill("#pg-max-tokens", "40")
        page.fill("#pg-temperature", "0.2")
        page.uncheck("#pg-cache")  # both from the engines, never replayed
        screenshot(page, "playground-4-compare-ready")
        page.click("#pg-send")
        for name in ("a", "b"):
            page.wait_for_selector(f".pg-column[data-column='{name}'][data-state='completed']", timeout=180_000)
        screenshot(page, "playground-5-compared")
        for name in ("a", "b"):
            assert 0 < int(readout(page, name, "tokens")) <= 40
            assert re.fullmatch(r"\d+ ms", readout(page, name, "ttft"))
            assert column(page, name).locator("[data-field='output']").inner_text().strip()
        assert readout(page, "b", "served").startswith("Version 1 ·")
        assert "cache" not in readout(page, "a", "served") + readout(page, "b", "served")

        # The engine fails: the column says so, in words, and the other still answers.
        fake_model.control(mode="error500")
        page.click("#pg-send")
        page.wait_for_selector(".pg-column[data-column='b'][data-state^='error']", timeout=60_000)
        page.wait_for_selector(".pg-column[data-column='a'][data-state='completed']", timeout=180_000)
        error = column(page, "b").locator("[data-field='error']")
        assert error.is_visible()
        assert error.inner_text().strip()
        screenshot(page, "playground-6-engine-error")
        page.context.close()

    def test_the_form_explains_bad_settings_and_fits_a_phone(self, playground_gateway, chromium, committed_users):
        page = open_playground(chromium, playground_gateway, committed_users, viewport={"width": 390, "height": 844})
        page.check("#pg-compare")
        page.fill("#pg-message", "Hi")
        page.fill("#pg-temperature", "5")
        page.keyboard.press("Tab")
        page.click("#pg-send")
        assert page.locator("#pg-form-error").inner_text() == "Temperature must be between 0 and 2."
        assert page.evaluate("document.activeElement.id") == "pg-temperature"
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        screenshot(page, "playground-7-phone")
        page.context.close()


class TestQuickstartInChromium:
    def test_snippets_name_this_server_and_copy(self, playground_gateway, chromium, committed_users):
        context = chromium.new_context(permissions=["clipboard-read", "clipboard-write"])
        page = context.new_page()
        log_in(page, playground_gateway.base_url, committed_users["org_member"].username)
        page.goto(f"{playground_gateway.base_url}/portal/{committed_users['org'].pk}/quickstart/")
        assert page.locator("[data-field='api-base']").inner_text() == f"{playground_gateway.base_url}/v1"
        assert CHAT in page.locator(".qs-models").inner_text()
        assert 'model="' in page.locator("#python-chat").inner_text()
        page.click("button[data-copy='curl-chat']")
        page.wait_for_selector("#qs-copied:has-text('Copied')")
        assert page.evaluate("navigator.clipboard.readText()") == page.locator("#curl-chat").inner_text()
        page.set_viewport_size({"width": 390, "height": 844})
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        screenshot(page, "quickstart")
        context.close()
