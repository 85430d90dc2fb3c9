"""Finding one request by its id: platform admins find any, an organisation's members only
their own; the page says how it was served (a fallback, version, canary arm, cache) and never a prompt."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from billing.models import FailedAttempt
from registry.models import Model, ModelVersion
from rollout.models import Canary
from tests.console import test_portal
from tests.console.test_portal import World, url
from tests.support.usage_records import make_record

pytestmark = pytest.mark.django_db

world = test_portal.world  # the portal's people and keys (a fixture)


@pytest.fixture
def canary_record(world: World):
    model = Model.objects.create(name="lookup-chat", task="chat")
    base, candidate = (
        ModelVersion.objects.create(model=model, version=v, framework="pytorch", artifact_uri=f"local://lookup/{v}",
                                    artifact_sha256="0" * 64, artifact_size=1)
        for v in ("1", "2")
    )  # fmt: skip
    now = timezone.now()
    Canary.objects.create(model=model, base_version=base, canary_version=candidate, steps=[5, 50],
                          interval_seconds=60, step_started_at=now, next_decision_at=now)  # fmt: skip
    return make_record(world.key, at=now + timedelta(seconds=1), model="lookup-chat", version="2", prompt=12,
                       completion=7, cached=4, latency=1812, ttft=95, cost=Decimal("0.000598"), cache="miss",
                       finish_reason="stop")  # fmt: skip


def page(client, path: str, request_id: str) -> str:
    response = client.get(path, {"id": request_id})
    assert response.status_code == 200
    return response.content.decode()


def test_a_platform_admin_finds_any_request_with_how_it_was_served(world, canary_record):
    html = page(world.client("platform_admin"), reverse("console:requests"), str(canary_record.request_id))
    assert str(canary_record.request_id) in html
    assert "Alice Corp" in html
    assert world.key.masked in html
    assert 'data-field="cost">$0.000598' in html
    assert "1,812 ms · first token 95 ms" in html
    assert "12 in (4 cached) · 7 out" in html
    assert "lookup-chat version 2" in html
    assert "the canary arm" in html
    assert "answered by the engine" in html


def test_a_fallback_shows_the_version_that_failed_first(world, canary_record):
    FailedAttempt.objects.create(
        request_id=canary_record.request_id, organization_id=world.org.pk, model="lookup-chat", model_version="1",
        status_code=502, error_code="engine_unavailable", latency_ms=1234, created_at=canary_record.created_at,
    )  # fmt: skip
    html = page(world.client("platform_admin"), reverse("console:requests"), str(canary_record.request_id))
    trail = html.split('id="request-trail">')[1].split("</ol>")[0]
    assert trail.index("Tried first") < trail.index("Fell back to")
    assert "lookup-chat version 1: failed with 502 engine_unavailable after 1,234 ms" in trail
    assert "Routed to" not in trail


def test_a_body_id_works_too_and_a_bad_id_is_a_field_error(world, canary_record):
    client = world.client("platform_admin")
    html = page(client, reverse("console:requests"), f"chatcmpl-{canary_record.request_id.hex}")
    assert 'id="request-trail"' in html
    html = page(client, reverse("console:requests"), "not-an-id")
    assert "Not a request id" in html
    assert 'id="request"' not in html


def test_members_find_their_organisations_requests_only(world, canary_record):
    mine = page(world.client("member"), url("portal-requests", world.org), str(canary_record.request_id))
    assert 'id="request-trail"' in mine
    assert "Alice Corp</a>" not in mine  # no link to the console's customer page
    other = make_record(world.other_key, at=datetime.now(UTC), request_id=uuid.uuid4())
    theirs = page(world.client("member"), url("portal-requests", world.org), str(other.request_id))
    assert 'id="request-missing"' in theirs
    assert str(other.request_id) not in theirs.split('id="request"')[1]  # only echoed in the form
    assert world.client("outsider").get(url("portal-requests", world.org)).status_code == 404
    assert world.client("member").get(reverse("console:requests")).status_code == 403
