"""The playground and the quickstart in real Chromium, against the real SmolLM2 replica.

An org member signs in, streams a long answer and watches the readout move, stops it (the
request is metered as cancelled, 499, to the member's playground key, and the status says
"stopped by you"), holds a two-turn conversation (the second request carries both turns), runs
the code "View code" shows for it, then compares two models side by side. What the engine
writes is never asserted, only that it streams.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings

from accounts.services import api_key_create
from tests.support.browser import log_in, screenshot
from tests.support.gateway import committed, persisted
from tests.support.processes import Gateway, start_gateway

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
    config = json.loads(page.split('id="playground-config" type="application/json">')[1].split("</script>")[0])
    version = bundled_models["versions"][CHAT].version
    offered = {m["name"]: m for m in config["models"]}[CHAT]
    assert (offered["versions"], offered["weighted"]) == ([version], [version])


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
        assert readout(page, "a", "status") == "stopped by you"
        assert readout(page, "a", "status-code") == "HTTP 499"
        assert "stopped by you" in column(page, "a").locator(".pg-assistant .pg-who").inner_text()
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
        fake_model,
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

        # The engine fails: the column says so, in words, and the other still answers. It is
        # each column's second turn: each sends its own answer of the first.
        assert page.input_value("#pg-message") == ""  # sent: the box is free for the next turn
        fake_model.control(mode="error500")
        page.fill("#pg-message", "And about butter?")
        page.click("#pg-send")
        page.wait_for_selector(".pg-column[data-column='b'][data-state^='error']", timeout=60_000)
        page.wait_for_selector(".pg-column[data-column='a'][data-state='completed']", timeout=180_000)
        assert readout(page, "b", "status").startswith("error: ")
        assert len(readout(page, "b", "status")) > len("error: ")
        # The failed turn stays on show but is not sent again.
        assert column(page, "b").locator(".pg-turn.pg-left").count() == 2
        assert column(page, "a").locator(".pg-turn").count() == 4
        screenshot(page, "playground-6-engine-error")
        page.context.close()

    def test_a_conversation_sends_every_turn_and_its_code_runs(
        self, playground_gateway, chromium, committed_users, django_db_blocker
    ):
        page = open_playground(chromium, playground_gateway, committed_users)
        sent: list[dict[str, Any]] = []
        page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(json.loads(payload))))
        page.select_option("#pg-model-a", CHAT)
        version = page.locator("#pg-version-a option").nth(1).get_attribute("value")
        page.select_option("#pg-version-a", version)  # pinned
        page.fill("#pg-temperature", "0")
        page.uncheck("#pg-cache")  # at 0 the cache could answer: both turns from the engine
        page.fill("#pg-max-tokens", "12")
        page.fill("#pg-message", "What is the capital of France?")
        page.click("#pg-send")
        page.wait_for_selector(".pg-column[data-column='a'][data-state='completed']", timeout=180_000)
        assert readout(page, "a", "status") in ("done (stop)", "cut off at max tokens")
        assert readout(page, "a", "status-code") == "HTTP 200"
        first_prompt = int(column(page, "a").get_attribute("data-prompt-tokens"))
        first_completion = int(column(page, "a").get_attribute("data-completion-tokens"))
        answer = column(page, "a").locator(".pg-assistant .pg-text").inner_text()
        assert answer.strip()

        page.fill("#pg-message", "And of Italy?")
        page.click("#pg-send")
        page.wait_for_selector(".pg-column[data-column='a'][data-state='completed'][data-run-id='a-2']",
                               timeout=180_000)  # fmt: skip
        screenshot(page, "playground-8-two-turns")
        requests = [frame for frame in sent if frame.get("type") == "chat.completion"]
        assert len(requests) == 2
        second = requests[1]
        assert second["model_version"] == version
        assert second["body"]["cache"] is False
        messages = second["body"]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert (messages[0]["content"], messages[2]["content"]) == ("What is the capital of France?", "And of Italy?")
        assert messages[1]["content"].strip() == answer.strip()
        # The engine read both turns: the second prompt holds the first prompt and its answer.
        assert int(column(page, "a").get_attribute("data-prompt-tokens")) > first_prompt + first_completion
        assert column(page, "a").locator(".pg-turn").count() == 4

        # "View code": exactly what was last sent, the version pinned, no secret.
        page.click("#pg-view-code")
        dialog = page.locator("#drawer-code-pg")
        dialog.wait_for(state="visible")
        assert "last sent" in page.locator("#pg-code-what").inner_text()
        assert "HTTP 200" in page.locator("#pg-code-status").inner_text()
        code = {name: page.locator(f"[data-code='{name}']").text_content() for name in ("curl", "python", "websocket")}
        assert f"curl -N {playground_gateway.base_url}/v1/chat/completions" in code["curl"]
        assert f"X-Model-Version: {version}" in code["curl"]
        assert '"Authorization: Bearer $API_KEY"' in code["curl"]
        assert f'extra_headers={{"X-Model-Version": "{version}"}}' in code["python"]
        assert 'extra_body={"cache": False}' in code["python"]
        assert f'"model_version": "{version}"' in code["websocket"]
        for text in code.values():
            assert "And of Italy?" in text
            assert "What is the capital of France?" in text
            assert "sk-" not in text
        page.click("#pg-tab-python")
        assert page.locator("#pg-panel-python").is_visible()
        assert not page.locator("#pg-panel-curl").is_visible()
        screenshot(page, "playground-9-view-code")
        page.keyboard.press("Escape")

        # The code runs as it reads, with a key of the organisation's own.
        secret = committed(
            django_db_blocker, lambda: api_key_create(organization=committed_users["org"], name="view code").secret
        )
        env = {**os.environ, "API_KEY": secret}
        curl = subprocess.run(["bash", "-c", code["curl"]], env=env, capture_output=True, text=True, timeout=180)
        assert curl.returncode == 0, curl.stderr
        assert "data: [DONE]" in curl.stdout, curl.stdout[-500:]
        assert '"completion_tokens"' in curl.stdout
        for name in ("python", "websocket"):
            run = subprocess.run([sys.executable, "-c", code[name]], env=env, capture_output=True, text=True,
                                 timeout=180)  # fmt: skip
            assert run.returncode == 0, run.stderr
            assert "completion_tokens" in run.stdout, run.stdout[-500:]
        assert "'status': 'completed'" in run.stdout  # the socket's usage frame

        # A new conversation starts from nothing.
        page.click("#pg-new")
        assert column(page, "a").locator(".pg-turn").count() == 0
        assert readout(page, "a", "status") == "idle"
        page.fill("#pg-message", "Hello")
        page.click("#pg-view-code")
        page.locator("#drawer-code-pg").wait_for(state="visible")
        assert "would send now" in page.locator("#pg-code-what").inner_text()
        assert "What is the capital" not in page.locator("[data-code='curl']").text_content()
        page.context.close()

    def test_the_cache_option_says_why_it_cannot_apply(self, playground_gateway, chromium, committed_users):
        page = open_playground(chromium, playground_gateway, committed_users)
        limit = f"{settings.SEMANTIC_CACHE_MAX_TEMPERATURE:g}"
        cache, hint = page.locator("#pg-cache"), page.locator("#pg-cache-hint")
        page.select_option("#pg-model-a", CHAT)
        page.fill("#pg-temperature", "0.2")
        assert cache.is_enabled()
        assert cache.is_checked()
        assert cache.get_attribute("aria-describedby") == "pg-cache-hint"
        assert f"temperature {limit} or below" in hint.inner_text()

        page.fill("#pg-temperature", "1.0")  # said at once, as the temperature changes
        assert cache.is_disabled()
        assert not cache.is_checked()
        assert hint.inner_text() == f"Not at temperature 1: {CHAT}'s cache answers at {limit} or below."
        screenshot(page, "playground-10-cache-disabled")
        # What would be sent leaves the cache to the gateway, which would not use it.
        page.fill("#pg-message", "Hi")
        page.click("#pg-view-code")
        page.locator("#drawer-code-pg").wait_for(state="visible")
        curl = page.locator("[data-code='curl']").text_content()
        assert '"temperature": 1,' in curl
        assert '"cache"' not in curl
        page.keyboard.press("Escape")

        page.fill("#pg-temperature", "0.3")  # the member's choice comes back
        assert cache.is_enabled()
        assert cache.is_checked()
        page.uncheck("#pg-cache")
        page.fill("#pg-temperature", "1.5")
        page.fill("#pg-temperature", "0.4")
        assert cache.is_enabled()
        assert not cache.is_checked()

        # At 800 px, comparing, with the code open: nothing scrolls sideways.
        page.set_viewport_size({"width": 800, "height": 900})
        page.check("#pg-compare")
        assert page.locator("#pg-model-b").is_visible()
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        screenshot(page, "playground-11-800px")
        page.click("#pg-view-code")
        page.locator("#drawer-code-pg").wait_for(state="visible")
        assert page.locator("#pg-code-columns").is_visible()  # which column's request
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        screenshot(page, "playground-12-800px-code")
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
