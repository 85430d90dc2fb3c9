"""The audit log and a version's timeline in real Chromium (issue 23): a timeline entry opens its
audit entry, a filter is shown and removed, and neither page overflows at 1280 or 800 px with a
model whose name has no place to break."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from tests.console.test_layout_walk import OVERFLOW_JS
from tests.support.browser import log_in, outside_the_event_loop, screenshot

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def audit_world(committed_users, django_db_blocker) -> Iterator[dict[str, Any]]:
    """A model with two versions whose canary ran and was promoted, then autoscaled; committed."""
    from django.utils import timezone

    from registry.models import AuditEntry, Deployment, Model
    from registry.services import AUTOSCALER, audit_record, deployment_create, deployment_scale
    from rollout.canary import canary_create, canary_decide, canary_promote
    from rollout.canary_stats import RequestSample
    from rollout.models import Canary
    from tests.support.registry import make_version

    tag = uuid.uuid4().hex[:6]
    admin = committed_users["platform_admin"]

    def same(**_: Any) -> list[RequestSample]:
        return [RequestSample(status_code=200, latency_ms=100 + n, ttft_ms=20, completion_tokens=9) for n in range(30)]

    def create() -> dict[str, Any]:
        model = Model.objects.create(name=f"audit-{tag}-" + "unbroken" * 16, task="chat")
        v1, v2 = make_version(model, "1"), make_version(model, "2")
        for version in (v1, v2):
            audit_record(actor=admin, action="model_version.register", target_type="model_version",
                         target=str(version), before=None,
                         after={"model": model.name, "version": version.version, "artifact_sha256": "ab" * 32,
                                "artifact_size": 1_500_000_000, "config": {"max_seq_len": 4096}})  # fmt: skip
        deployment_create(actor=admin, version=v1, traffic_weight=100)
        deployment = deployment_create(actor=admin, version=v2, traffic_weight=0, max_replicas=3)
        start = timezone.now()
        canary = canary_create(actor=admin, model=model, base_version="1", canary_version="2", steps=[10, 100],
                               interval_seconds=60, min_samples=5, now=start)  # fmt: skip
        canary_decide(canary_id=canary.pk, load_samples=same, now=start + timedelta(seconds=61))
        canary.refresh_from_db()
        canary_promote(actor=admin, canary=canary)
        deployment_scale(actor=AUTOSCALER, deployment=deployment, replicas=2,
                         reasons=["queued " + "requests" * 30])  # fmt: skip
        return {
            "model": model.name,
            "deployments": [str(d.pk) for d in Deployment.objects.filter(version__model=model)],
        }

    def delete() -> None:
        AuditEntry.objects.filter(target__contains=tag).delete()
        AuditEntry.objects.filter(target_type="deployment", target__in=made["deployments"]).delete()
        Canary.objects.filter(model__name=made["model"]).delete()
        Deployment.objects.filter(version__model__name=made["model"]).delete()
        Model.objects.get(name=made["model"]).versions.all().delete()
        Model.objects.filter(name=made["model"]).delete()

    with django_db_blocker.unblock():
        made = outside_the_event_loop(create)
    yield made
    with django_db_blocker.unblock():
        outside_the_event_loop(delete)


@pytest.mark.django_db
def test_the_database_is_set_up():
    """Makes pytest-django set up the test database when this module runs alone."""


def test_timeline_and_audit_log_in_chromium(committed_users, audit_world, console_gateway, chromium):
    base, name = console_gateway.base_url, audit_world["model"]
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, base, committed_users["platform_admin"].username)

    problems: dict[str, list[str]] = {}
    for width in (1280, 800):
        page.set_viewport_size({"width": width, "height": 900})
        for label, path in (
            ("timeline", f"/console/models/{name}/2/"),
            ("audit", f"/console/audit/?target=model:{name}"),
        ):
            page.goto(f"{base}{path}")
            screenshot(page, f"audit-{label}-{width}")
            found = page.evaluate(OVERFLOW_JS)
            if found:
                problems[f"{width} {label}"] = found[:5]
    assert problems == {}

    page.goto(f"{base}/console/models/{name}/2/")
    events = page.locator("[data-timeline] [data-event]")
    kinds = [events.nth(i).get_attribute("data-event") for i in range(events.count())]
    assert kinds == ["registered", "deployed", "traffic", "canary", "traffic", "canary", "promoted", "scaled"]
    assert "autoscaler" in events.last.inner_text()

    # A timeline event opens its audit entry on its own, with the filter shown and removable.
    events.nth(1).locator("a.timeline-time").click()
    page.wait_for_load_state("load")
    assert page.locator(".audit-entry").count() == 1
    assert "deployed " + name in page.locator(".audit-summary").inner_text()
    chip = page.locator("[data-filter]")
    assert chip.inner_text().startswith("entry #")
    chip.locator("a").click()
    page.wait_for_load_state("load")
    assert page.locator("[data-filter]").count() == 0
    assert page.url == f"{base}/console/audit/"

    # The version page's link filters the log to the version, and the entry's target links back.
    page.goto(f"{base}/console/models/{name}/2/")
    page.click("[data-audit-of=version]")
    page.wait_for_load_state("load")
    assert page.locator("[data-filter]").inner_text().startswith(f"version {name}:2 with its deployments")
    page.locator(".audit-entry [data-target-link]", has_text=f"version {name}:2").first.click()
    page.wait_for_load_state("load")
    assert page.url == f"{base}/console/models/{name}/2/"
    context.close()
    assert errors == []
