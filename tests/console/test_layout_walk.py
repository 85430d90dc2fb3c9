"""Every page a platform admin can open, in real Chromium at 1280 px and at 800 px: nothing
overflows the page sideways, no element sticks out of its container (tables scroll
inside their own ``.table-wrap``), and no template syntax shows as text. A screenshot of
each page at each width goes under tests/screenshots/ (``walk-<width>-<page>.png``) for
people to look at."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.urls import URLPattern, reverse

from console.pages import urls as page_urls
from tests.support.browser import log_in, outside_the_event_loop, screenshot

pytestmark = pytest.mark.browser

WIDTHS = (1280, 800)

# Elements that stick out of their parent, and whether the page itself scrolls sideways.
# Skipped: what scrolls or clips by design (an ancestor with overflow other than visible,
# ``.table-wrap`` included), what is hidden or out of the flow (visually-hidden, fixed or
# absolute), and plotly's own drawing (it sizes its SVG to the chart's box).
OVERFLOW_JS = """
() => {
  const root = document.documentElement;
  const found = [];
  if (root.scrollWidth > root.clientWidth + 1) {
    const widest = [...document.querySelectorAll('body *')]
      .filter((el) => el.getBoundingClientRect().right > root.clientWidth + 1
        || (el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).overflowX === 'visible'
            && el.clientWidth > 0))
      .map((el) => `${el.tagName.toLowerCase()}${el.id ? '#' + el.id : ''}.${el.className}`
        + ` (right ${Math.round(el.getBoundingClientRect().right)})`);
    found.push(`the page scrolls sideways: ${root.scrollWidth} px in ${root.clientWidth} px;`
      + ` past the edge: ${widest.slice(-3).join(', ')}`);  // the innermost last
  }
  const clipped = (el) => {
    for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
      const style = getComputedStyle(a);
      if (style.overflowX !== 'visible' || a.classList.contains('js-plotly-plot')) return true;
    }
    return false;
  };
  const name = (el) => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '')
    + (el.className && typeof el.className === 'string' ? '.' + el.className.trim().split(/\\s+/).join('.') : '');
  for (const el of document.querySelectorAll('body *')) {
    const style = getComputedStyle(el);
    if (style.display === 'none' || style.visibility === 'hidden' || style.position === 'fixed'
        || style.position === 'absolute' || el.closest('.visually-hidden, svg, script, template')) continue;
    const box = el.getBoundingClientRect();
    const parent = el.parentElement;
    if (!parent || box.width === 0 || box.height === 0 || clipped(el)) continue;
    const outer = parent.getBoundingClientRect();
    const over = Math.max(box.right - outer.right, outer.left - box.left);
    if (over > 1) {
      found.push(`${name(el)} sticks out of ${name(parent)} by ${Math.round(over)} px`
        + ` ("${(el.innerText || '').trim().slice(0, 40)}")`);
    }
  }
  return found;
}
"""


def admin_pages(kwargs: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, path) of every GET page whose arguments the walk has."""
    out = []
    for pattern in page_urls.urlpatterns:
        if not isinstance(pattern, URLPattern) or pattern.name is None:
            continue
        wanted = set(pattern.pattern.regex.groupindex)
        if not wanted <= set(kwargs):
            continue
        out.append((pattern.name, reverse(f"console:{pattern.name}", kwargs={k: kwargs[k] for k in wanted})))
    return out


@pytest.fixture(scope="module")
def walk_world(committed_users, django_db_blocker) -> Iterator[dict[str, Any]]:
    """A key, a registered model with a version and some usage of ``org``, committed."""
    from accounts.models import Organization
    from accounts.services import api_key_create
    from registry.models import Model, ModelVersion

    tag = uuid.uuid4().hex[:6]
    org = committed_users["org"]

    def create() -> dict[str, Any]:
        # A name with no place to break (other tests and real customers make such): tables that
        # list organisations must scroll inside their card, not widen the page.
        Organization.objects.create(name=f"Walk{tag}" + "Unbroken" * 25, slug=f"walk-long-{tag}")
        long_model = Model.objects.create(name=f"walk-{tag}-" + "unbroken" * 20, task="chat")
        ModelVersion.objects.create(model=long_model, version="1", framework="pytorch", artifact_sha256="0" * 64,
                                    artifact_uri=f"local://walk-long-{tag}/1", artifact_size=1)  # fmt: skip
        key = api_key_create(organization=org, name=f"walk-{tag}").api_key
        model = Model.objects.create(name=f"walk-{tag}", task="chat")
        ModelVersion.objects.create(model=model, version="1", framework="pytorch", artifact_uri=f"local://walk-{tag}/1",
                                    artifact_sha256="0" * 64, artifact_size=1)  # fmt: skip
        return {"org_id": org.pk, "key_id": key.pk, "name": model.name, "version": "1", "key": key, "model": model}

    def delete() -> None:
        from accounts.models import ApiKey
        from registry.models import AuditEntry

        ApiKey.objects.filter(pk=made["key"].pk).delete()
        Organization.objects.filter(slug=f"walk-long-{tag}").delete()
        ModelVersion.objects.filter(model__name__startswith=f"walk-{tag}").delete()
        Model.objects.filter(name__startswith=f"walk-{tag}").delete()
        AuditEntry.objects.filter(target__contains=tag).delete()

    with django_db_blocker.unblock():
        made = outside_the_event_loop(create)
    yield made
    with django_db_blocker.unblock():
        outside_the_event_loop(delete)


@pytest.mark.django_db
def test_the_walk_covers_the_console_and_the_portal():
    """Also makes pytest-django set up the test database when this module runs alone."""
    names = {name for name, _ in admin_pages({"org_id": 1, "key_id": 1, "name": "m", "version": "1"})}
    assert {"overview", "models", "model-version", "deployments", "canaries", "cache", "customers", "portal-usage",
            "portal-keys", "portal-invoices", "playground", "batches"} <= names  # fmt: skip


def test_no_page_overflows_at_1280_or_800_px(committed_users, walk_world, console_gateway, chromium):
    context = chromium.new_context(viewport={"width": WIDTHS[0], "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, console_gateway.base_url, committed_users["platform_admin"].username)
    problems: dict[str, list[str]] = {}
    walked = 0
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        for name, path in admin_pages(walk_world):
            url = f"{console_gateway.base_url}{path}"
            answer = context.request.get(url, max_redirects=0)
            if answer.status >= 500:
                problems[f"{width} {path}"] = [f"answered {answer.status}"]
                continue
            if answer.status != 200 or not answer.headers.get("content-type", "").startswith("text/html"):
                continue  # an action's GET that sends on or refuses, a download
            page.goto(url)
            page.wait_for_load_state("load")
            page.wait_for_timeout(150)  # charts draw after load
            screenshot(page, f"walk-{width}-{name}")
            walked += 1
            found = page.evaluate(OVERFLOW_JS)
            # Template syntax left in the page (a comment over two lines is not a comment).
            text = page.locator("body").inner_text()
            found += [f"template syntax shown: {mark}" for mark in ("{#", "#}", "{%", "%}", "{{") if mark in text]
            if found:
                problems[f"{width} {path}"] = found[:5]
    context.close()
    assert walked >= 2 * 25
    assert problems == {}
    assert errors == []
