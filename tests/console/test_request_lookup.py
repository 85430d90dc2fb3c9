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


# --- The request log -----------------------------------------------------------------------


def log_rows(html: str) -> list[str]:
    """The request ids the log shows, in its order."""
    if 'id="requests"' not in html:
        return []
    table = html.split('id="requests"')[1].split("</table>")[0]
    return [chunk.split('"')[0] for chunk in table.split('data-request="')[1:]]


def test_the_log_lists_the_newest_requests_first_each_opening_its_page(world):
    now = datetime.now(UTC)
    older = make_record(world.key, at=now - timedelta(minutes=5), model="log-chat", latency=1500)
    newer = make_record(world.key, at=now - timedelta(minutes=1), model="log-chat", status=499,
                        error_code="client_closed")  # fmt: skip
    theirs = make_record(world.other_key, at=now, model="log-chat")
    html = world.client("platform_admin").get(reverse("console:requests")).content.decode()
    assert log_rows(html) == [str(theirs.request_id), str(newer.request_id), str(older.request_id)]
    assert f'href="?id={older.request_id}"' in html
    assert "Bob Corp" in html  # the console shows every organisation's, with its name
    row = html.split(f'data-request="{newer.request_id}"')[1].split("</tr>")[0]
    assert "status-cancelled" in row  # a client's cancel is not an error
    assert "status-failed" not in row
    # Its page opens from the row's link.
    opened = page(world.client("platform_admin"), reverse("console:requests"), str(older.request_id))
    assert 'id="request-trail"' in opened
    assert 'id="requests"' not in opened


def test_a_member_sees_only_their_organisations_log(world):
    now = datetime.now(UTC)
    mine = make_record(world.key, at=now - timedelta(minutes=1))
    theirs = make_record(world.other_key, at=now)
    html = world.client("member").get(url("portal-requests", world.org)).content.decode()
    assert log_rows(html) == [str(mine.request_id)]
    assert str(theirs.request_id) not in html
    assert 'name="organization"' not in html  # the portal has no organisation filter
    # Another organisation's key cannot be chosen as a filter.
    response = world.client("member").get(url("portal-requests", world.org), {"key": world.other_key.pk})
    assert log_rows(response.content.decode()) == []
    assert "Select a valid choice" in response.content.decode()


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"outcome": "answered"}, ["ok", "cached", "slow"]),
        ({"outcome": "error"}, ["refused", "failed"]),
        ({"outcome": "client-error"}, ["refused"]),
        ({"outcome": "server-error"}, ["failed"]),
        ({"outcome": "cancelled"}, ["cancelled"]),
        ({"cache": "semantic-hit"}, ["cached"]),
        ({"slower_than": "1000"}, ["slow"]),
        ({"model": "log-embed"}, ["cached"]),
        ({"model": "log-chat", "version": "2"}, ["slow"]),
    ],
)
def test_the_log_filters_by_outcome_cache_latency_model_and_version(world, filters, expected):
    from registry.models import Model as RegisteredModel

    RegisteredModel.objects.create(name="log-chat", task="chat")
    RegisteredModel.objects.create(name="log-embed", task="embeddings")
    now = datetime.now(UTC)
    made = {
        "ok": make_record(world.key, at=now - timedelta(seconds=6), model="log-chat"),
        "cached": make_record(world.key, at=now - timedelta(seconds=5), model="log-embed", cache="semantic-hit"),
        "slow": make_record(world.key, at=now - timedelta(seconds=4), model="log-chat", version="2", latency=2500),
        "refused": make_record(world.key, at=now - timedelta(seconds=3), model="log-chat", status=400),
        "failed": make_record(
            world.key, at=now - timedelta(seconds=2), model="log-chat", status=502, error_code="engine_unavailable"
        ),
        "cancelled": make_record(world.key, at=now - timedelta(seconds=1), model="log-chat", status=499),
    }
    names = {str(record.request_id): name for name, record in made.items()}
    html = world.client("admin").get(url("portal-requests", world.org), filters).content.decode()
    assert sorted(names[i] for i in log_rows(html)) == sorted(expected)


def test_the_log_pages_by_cursor_without_repeating_or_skipping(world):
    from console.pages.requests import LOG_PAGE

    now = datetime.now(UTC)
    same_moment = now - timedelta(minutes=1)  # rows sharing a time are still paged in order
    records = [make_record(world.key, at=same_moment if i % 2 else now - timedelta(seconds=i))
               for i in range(LOG_PAGE + 7)]  # fmt: skip
    client = world.client("member")
    first = client.get(url("portal-requests", world.org), {"outcome": "answered"}).content.decode()
    assert len(log_rows(first)) == LOG_PAGE
    older = first.split('rel="next"')[0].rsplit('href="?', 1)[1].split('"')[0].replace("&amp;", "&")
    assert "outcome=answered" in older  # the filters travel with the cursor
    second = client.get(url("portal-requests", world.org) + "?" + older).content.decode()
    assert len(log_rows(second)) == 7
    assert 'rel="next"' not in second
    assert "← Newest" in second
    assert sorted(log_rows(first) + log_rows(second)) == sorted(str(r.request_id) for r in records)


def test_bad_filters_are_field_errors_not_a_500(world):
    client = world.client("platform_admin")
    for bad in ({"slower_than": "-5"}, {"slower_than": "fast"}, {"version": "v" * 51}, {"version": "1\x00"},
                {"outcome": "lost"}, {"organization": "999999"}, {"before": "²"}, {"before": "9" * 40}):  # fmt: skip
        response = client.get(reverse("console:requests"), bad)
        assert response.status_code == 200, bad
    html = client.get(reverse("console:requests"), {"slower_than": "-5"}).content.decode()
    assert "greater than or equal to 0" in html
