"""Rollouts in real Chromium: a platform admin edits a traffic split, then starts a canary
with the wizard and watches the controller's first decision appear on the canary page.

The decision is driven by the controller's own task (``rollout.tasks.canary_tick``) over
usage records committed by the test, as the gateway would have written them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

from core.formats import MISSING
from tests.support.browser import fill_canary_wizard, log_in, screenshot, serve_canary_requests, tick_until_decided

pytestmark = pytest.mark.browser

T = TypeVar("T")


def in_db_thread(django_db_blocker: Any, work: Callable[[], T]) -> T:
    """Run ORM work outside playwright's event-loop thread (where Django refuses it), committed."""
    from django.db import connection

    def run() -> T:
        try:
            return work()
        finally:
            connection.close()

    with django_db_blocker.unblock(), ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


@pytest.fixture(scope="module")
def rollout_model(committed_users, django_db_blocker) -> Iterator[dict[str, Any]]:
    """A committed chat model with v1 (running, 100 %) and v2 (running, 0 %), and an API key of
    ``org`` whose usage records the controller will judge."""
    from accounts.services import api_key_create
    from billing.models import UsageRecord
    from registry.models import Deployment, Model, ModelVersion
    from rollout.models import Canary

    name = f"rollout-{uuid.uuid4().hex[:6]}"
    with django_db_blocker.unblock():
        model = Model.objects.create(name=name, task="chat")
        for version, weight in (("v1", 100), ("v2", 0)):
            Deployment.objects.create(
                version=ModelVersion.objects.create(
                    model=model, version=version, framework="pytorch", artifact_uri=f"local://{name}/{version}",
                    artifact_sha256="0" * 64, artifact_size=1,
                ),
                status="running", traffic_weight=weight,
            )  # fmt: skip
        key = api_key_create(organization=committed_users["org"], name="rollout traffic").api_key
    yield {"model": model, "key": key}
    with django_db_blocker.unblock():
        UsageRecord.objects.filter(model=name).delete()
        key.delete()
        Canary.objects.filter(model=model).delete()
        Deployment.objects.filter(version__model=model).delete()
        ModelVersion.objects.filter(model=model).delete()
        model.delete()


# Elements whose right edge lies past the viewport, outside a horizontally scrolling .table-wrap.
OVERFLOWING = """() => [...document.querySelectorAll("body *")]
  .filter((el) => !el.closest(".table-wrap, .chart") && el.getBoundingClientRect().right > window.innerWidth + 1)
  .map((el) => el.tagName.toLowerCase() + (typeof el.className === "string" ? "." + el.className : ""))"""


def assert_no_sideways_scroll(page: Any) -> None:
    page.wait_for_timeout(300)  # plotly redraws its charts for the new width (debounced)
    assert page.evaluate(OVERFLOWING) == []
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")


def weight_cells(page: Any, model: str) -> dict[str, str]:
    rows = page.locator(f"section[data-model='{model}'] table.deployments tbody tr")
    return {rows.nth(i).locator("td.version [data-version]").inner_text(): rows.nth(i).locator("td.weight").inner_text()
            for i in range(rows.count())}  # fmt: skip


class TestRollout:
    def test_traffic_split_then_canary_wizard_then_a_decision(
        self, console_gateway, committed_users, rollout_model, chromium, django_db_blocker
    ):
        name = rollout_model["model"].name
        base = console_gateway.base_url
        page = chromium.new_page(viewport={"width": 1280, "height": 900})
        log_in(page, base, committed_users["platform_admin"].username)
        screenshot(page, "rollout-01-logged-in")

        # The traffic split editor: the sum updates as the admin types; the server sets it.
        page.goto(f"{base}/console/deployments/?model={name}")
        panel = page.locator(f"section[data-model='{name}']")
        assert weight_cells(page, name) == {"v1": "100 %", "v2": "0 %"}
        screenshot(page, "rollout-02-deployments")
        panel.get_by_role("button", name="Traffic split…").click()
        drawer = page.locator("dialog.drawer[open]")
        assert drawer.get_by_role("heading").inner_text() == f"Traffic split of {name}"
        panel.locator("#id_weight-v1").fill("60")
        panel.locator("#id_weight-v2").fill("30")
        assert panel.locator("[data-split-sum]").inner_text() == "90"
        assert "bad" in (panel.locator(".split-sum").get_attribute("class") or "")
        screenshot(page, "rollout-03-split-sum-90")
        panel.locator("#id_weight-v2").fill("40")
        assert panel.locator("[data-split-sum]").inner_text() == "100"
        assert "good" in (panel.locator(".split-sum").get_attribute("class") or "")
        screenshot(page, "rollout-04-split-sum-100")
        panel.locator("form[data-split-editor] button[type=submit]").click()
        page.wait_for_selector(".message-success")
        assert f"Traffic of {name} split: v1 60 %, v2 40 %." in page.locator(".messages").inner_text()
        assert weight_cells(page, name) == {"v1": "60 %", "v2": "40 %"}
        screenshot(page, "rollout-05-split-set")

        # The live table follows traffic without a reload: requests/s, p99 and errors appear.
        v1_row = panel.locator("table.live tr[data-deployment]").filter(
            has=page.locator("[data-version]", has_text="v1")
        )
        assert v1_row.locator("[data-live=p99]").inner_text() == MISSING
        in_db_thread(django_db_blocker, lambda: serve_canary_requests(name, rollout_model["key"]))
        v1_row.locator("[data-live=p99]").filter(has_text=" ms").wait_for(timeout=15_000)
        assert v1_row.locator("[data-live=errors]").inner_text() == "0.0 %"
        assert v1_row.locator("[data-live=rate]").inner_text().endswith("/s")
        screenshot(page, "rollout-05b-live-figures")

        # At phone width the page does not scroll sideways.
        page.set_viewport_size({"width": 390, "height": 844})
        assert_no_sideways_scroll(page)
        screenshot(page, "rollout-06-deployments-phone")
        page.set_viewport_size({"width": 1280, "height": 900})

        # The canary wizard.
        page.goto(f"{base}/console/canaries/")
        # Other tests commit models of their own: find this one through the filter, as a person would.
        page.fill("#filter-model", name)
        page.locator("form.filters button[type=submit]").click()
        page.locator(f"tr[data-model='{name}'] a:has-text('Start a canary')").click()
        page.wait_for_selector("h1:has-text('Start a canary')")
        # One step at a time: the versions first, nothing else on show, and no way to start yet.
        assert page.locator("fieldset[data-step='1']").is_visible()
        assert not page.locator("#id_steps").is_visible()
        assert not page.locator("[data-wizard-submit]").is_visible()
        page.click("[data-wizard-next]")
        # Steps that do not increase are refused on the spot; the schedule follows what is typed.
        page.fill("#id_steps", "50,10")
        page.click("[data-wizard-next]")
        assert page.locator("#id_steps").is_visible()
        page.fill("#id_steps", "10,50,100")
        page.fill("#id_interval_seconds", "2")
        assert page.locator("#canary-schedule li").all_inner_texts() == [
            "10 % of the requests to the candidate from 0 s to 2 s",
            "50 % of the requests to the candidate from 2 s to 4 s",
            "100 % of the requests to the candidate from 4 s to 6 s",
        ]
        assert "The earliest it can finish is 6 s after it starts" in page.locator("#canary-earliest").inner_text()
        page.click("[data-wizard-back]")
        fill_canary_wizard(page, steps="10,50,100", interval="2", min_samples="20", max_p99_ms="60000",
                           min_success="95", auto_promote=False, shot="rollout-07-wizard")  # fmt: skip
        review = {
            page.locator("#canary-review dd").nth(i).get_attribute("data-review"): page.locator("#canary-review dd")
            .nth(i).inner_text()
            for i in range(page.locator("#canary-review dd").count())
        }  # fmt: skip
        assert review["Versions"] == "v1 → v2"
        assert review["Steps"] == "10 % → 50 % → 100 %"
        assert review["Criteria"] == "success rate ≥ 95 %, p99 latency ≤ 60000 ms"
        assert review["At the end"] == "waits for a person to promote"
        page.click("[data-wizard-submit]")
        page.wait_for_selector("[data-canary-status]")
        assert page.locator("[data-canary-status]").inner_text() == "Running"
        assert "v1 90 % · v2 10 %" in page.locator(".facts").inner_text()
        assert page.locator("[data-decision]").count() == 0
        screenshot(page, "rollout-08-canary-started")

        # Requests are served; the controller's beat judges the window; the page, left
        # alone, shows the decision with its statistics and the charts.
        in_db_thread(django_db_blocker, lambda: serve_canary_requests(name, rollout_model["key"]))
        assert in_db_thread(django_db_blocker, tick_until_decided) == 1
        page.wait_for_selector("[data-decision]", timeout=15_000)
        decision = page.locator("[data-decision]").first
        assert decision.get_attribute("data-verdict") == "promote_step"
        assert "Promote to the next step" in decision.inner_text()
        assert decision.locator("tr[data-test='latency_ms'] td").first.inner_text() == "mann_whitney_u"
        assert "240 / 60" in decision.locator("tr[data-test='latency_ms']").inner_text()
        page.wait_for_selector("#canary-live .chart .main-svg")
        assert "v1 50 % · v2 50 %" in page.locator(".facts").inner_text()
        screenshot(page, "rollout-09-decision-appeared")
        page.set_viewport_size({"width": 390, "height": 844})
        assert_no_sideways_scroll(page)
        screenshot(page, "rollout-09b-canary-phone")
        page.set_viewport_size({"width": 1280, "height": 900})

        # Roll back, with the confirm step.
        page.click("main button:has-text('Roll back')")
        page.wait_for_selector("h1:has-text('Roll back the canary')")
        screenshot(page, "rollout-10-confirm-rollback")
        page.click("main form button[type=submit]")
        page.wait_for_selector(".message-success")
        assert page.locator("[data-canary-status]").inner_text() == "Rolled back"
        screenshot(page, "rollout-11-rolled-back")
        page.close()
