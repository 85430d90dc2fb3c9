"""The overview dashboard: who may see it, figures that say what the rollups say, the live socket."""

from __future__ import annotations

import json
import math
import random
import re
import uuid
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from accounts.models import Membership, Role
from accounts.services import api_key_create, organization_create
from billing.models import BudgetAlert, UsageRollup
from billing.rollups import rollups_rebuild
from console.pages.overview_data import dashboard, gateway_rates, gateway_sample
from core import sketch
from serving.gateway import metrics
from tests.support.usage_records import make_record

NOW = datetime(2031, 1, 15, 12, 30, tzinfo=UTC)
THIS_HOUR = NOW.replace(minute=0)
LAST_HOUR = THIS_HOUR - timedelta(hours=1)


def disc(values: list[int], q: float) -> int | None:
    """PostgreSQL's percentile_disc: the value at rank ceil(q * n)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)), 1) - 1] if ordered else None


def histogram(values: list[int]) -> dict[str, int]:
    return {str(bucket): n for bucket, n in Counter(sketch.bucket_of(v) for v in values).items()}


def rollup(key, *, start, model="alpha", version="1", period=UsageRollup.Period.HOUR, requests=None, errors=0,
           output_tokens=0, cache_hits=0, latencies=(), ttfts=()) -> UsageRollup:  # fmt: skip
    latencies, ttfts = list(latencies), list(ttfts)
    return UsageRollup.objects.create(
        period=period, start=start, organization_id=key.organization_id, api_key=key, model=model,
        model_version=version, requests=len(latencies) if requests is None else requests, errors=errors,
        output_tokens=output_tokens, cache_hits=cache_hits, cost=Decimal("0.01"),
        latency_p50_ms=disc(latencies, 0.5), latency_p99_ms=disc(latencies, 0.99), ttft_p50_ms=disc(ttfts, 0.5),
        ttft_p99_ms=disc(ttfts, 0.99), latency_histogram=histogram(latencies), ttft_histogram=histogram(ttfts),
    )  # fmt: skip


@pytest.fixture
def keys(db):
    org = organization_create(name="Overview Org")
    return api_key_create(organization=org, name="one").api_key, api_key_create(organization=org, name="two").api_key


def page_data(response) -> dict[str, Any]:
    found = re.search(
        r'<script id="overview-data" type="application/json">(.*?)</script>', response.content.decode(), re.S
    )
    assert found, "the page carries its figures"
    return json.loads(found.group(1))


def trace(data: dict[str, Any], chart: str, name: str) -> dict[str, Any]:
    traces = {t["name"]: t for t in data["figures"][chart]["data"]}
    assert name in traces, sorted(traces)
    return traces[name]


def y_at(data: dict[str, Any], chart: str, name: str, at: datetime) -> float | None:
    found = trace(data, chart, name)
    xs = [datetime.fromisoformat(x) for x in found["x"]]
    return found["y"][xs.index(at)]


@pytest.mark.django_db
class TestPermissions:
    def test_anonymous_visitors_go_to_the_login_page(self):
        response = Client().get("/console/")
        assert response.status_code == 302
        assert response["Location"].startswith("/accounts/login/")

    def test_organisation_members_and_admins_get_403(self, alice_org):
        for role in (Role.ORG_MEMBER, Role.ORG_ADMIN):
            user = get_user_model().objects.create_user(username=f"u-{role}", password="pw-123456789")
            Membership.objects.create(user=user, organization=alice_org, role=role)
            client = Client()
            client.force_login(user)
            assert client.get("/console/").status_code == 403

    def test_a_platform_admin_by_role_sees_it(self, alice_org):
        user = get_user_model().objects.create_user(username="ops", password="pw-123456789")
        Membership.objects.create(user=user, organization=alice_org, role=Role.PLATFORM_ADMIN)
        client = Client()
        client.force_login(user)
        response = client.get("/console/")
        assert response.status_code == 200
        assert 'src="/static/plotly/plotly.min.js"' in response.content.decode()


class TestFigures:
    def test_hourly_figures_say_what_the_rollups_say(self, keys):
        one, two = keys
        rng = random.Random(5)
        # Key one: an LLM's slow answers; key two: many fast ones of the same version.
        slow = [int(rng.lognormvariate(7.0, 0.5)) for _ in range(360)]
        fast = [int(rng.lognormvariate(4.5, 0.3)) for _ in range(720)]
        first_tokens = [int(rng.lognormvariate(3.0, 0.4)) for _ in range(360)]
        rollup(one, start=LAST_HOUR, errors=36, output_tokens=7200, cache_hits=90, latencies=slow, ttfts=first_tokens)
        rollup(two, start=LAST_HOUR, errors=0, output_tokens=0, cache_hits=0, latencies=fast)
        rollup(one, start=THIS_HOUR, requests=180, output_tokens=900)
        rollup(one, start=LAST_HOUR, model="beta", version="2", requests=36)
        # Not in the window: a daily row, and an hour older than a day.
        rollup(one, start=THIS_HOUR.replace(hour=0), period=UsageRollup.Period.DAY, requests=10_000)
        rollup(one, start=THIS_HOUR - timedelta(days=2), requests=10_000)

        data = dashboard(range_key="day", now=NOW)

        assert [t["name"] for t in data["figures"]["requests"]["data"]] == ["alpha:1", "beta:2"]
        assert len(trace(data, "requests", "alpha:1")["x"]) == 25  # every hour of the day, empty ones too
        assert y_at(data, "requests", "alpha:1", LAST_HOUR) == pytest.approx((360 + 720) / 3600)
        # The current hour is half over: its rate is over the 30 minutes past.
        assert y_at(data, "requests", "alpha:1", THIS_HOUR) == pytest.approx(180 / 1800)
        assert y_at(data, "requests", "alpha:1", LAST_HOUR - timedelta(hours=1)) == 0
        assert y_at(data, "tokens", "alpha:1", LAST_HOUR) == pytest.approx(7200 / 3600)
        assert y_at(data, "errors", "alpha:1", LAST_HOUR) == pytest.approx(100 * 36 / 1080, abs=1e-3)
        assert y_at(data, "cache", "alpha:1", LAST_HOUR) == pytest.approx(100 * 90 / 1080, abs=1e-3)
        # Percentiles across keys: those of the merged distribution (within 1 %), not a mean of the keys'.
        both = slow + fast
        assert y_at(data, "latency", "alpha:1 p50", LAST_HOUR) == pytest.approx(disc(both, 0.5), rel=0.01)
        assert y_at(data, "latency", "alpha:1 p99", LAST_HOUR) == pytest.approx(disc(both, 0.99), rel=0.01)
        weighted_mean = (disc(slow, 0.99) * 360 + disc(fast, 0.99) * 720) / 1080
        assert disc(both, 0.99) > 1.5 * weighted_mean  # what the old mean of percentiles got wrong
        # TTFT only from the key that had one.
        assert y_at(data, "ttft", "alpha:1 p50", LAST_HOUR) == pytest.approx(disc(first_tokens, 0.5), rel=0.01)
        assert y_at(data, "ttft", "alpha:1 p50", THIS_HOUR) is None
        assert y_at(data, "latency", "beta:2 p50", LAST_HOUR) is None

        window = (NOW - (THIS_HOUR - timedelta(days=1))).total_seconds()
        assert data["headline"]["requests"] == f"{360 + 720 + 180 + 36:,}"
        assert data["headline"]["requests_per_second"] == f"{(360 + 720 + 180 + 36) / window:,.3f}"
        assert data["headline"]["error_rate"] == f"{100 * 36 / (360 + 720 + 180 + 36):.2f} %"
        rows = {(r["model"], r["version"]): r for r in data["rows"]}
        assert rows[("alpha", "1")]["requests"] == "1,260"
        assert rows[("beta", "2")]["requests"] == "36"

    def test_thirty_days_read_the_daily_rollups(self, keys):
        one, _ = keys
        day = THIS_HOUR.replace(hour=0) - timedelta(days=3)
        rollup(one, start=day, period=UsageRollup.Period.DAY, requests=86_400, output_tokens=864_000)
        rollup(one, start=LAST_HOUR, requests=5)  # hourly: not read for this window

        data = dashboard(range_key="30d", now=NOW)

        assert y_at(data, "requests", "alpha:1", day) == pytest.approx(1.0)
        assert y_at(data, "tokens", "alpha:1", day) == pytest.approx(10.0)
        assert data["headline"]["requests"] == "86,400"

    def test_no_traffic_draws_empty_charts(self, db):
        data = dashboard(range_key="hour", now=NOW)
        assert data["figures"]["requests"]["data"] == []
        assert data["headline"]["latency_p50_ms"] == "—"
        assert data["rows"] == []


class TestGatewayCounters:
    def test_a_clients_cancel_is_not_counted_as_an_error(self):
        """The live view's "errors since last update" counted every status but 2xx, 499 included."""
        before = gateway_sample()
        metrics.REQUESTS.labels("cancels-model", "1", "chat", "499").inc(26)
        metrics.REQUESTS.labels("cancels-model", "1", "chat", "502").inc(2)
        metrics.REQUESTS.labels("cancels-model", "1", "chat", "200").inc(3)
        after = gateway_sample()
        assert after.requests - before.requests == 31
        assert after.errors - before.errors == 2
        assert getattr(after, "cancelled", 0) - getattr(before, "cancelled", 0) == 26
        rates = gateway_rates(before, replace(after, at=before.at + 1))
        assert (rates["errors"], rates.get("cancelled")) == ("2", "26")


class TestOverviewPage:
    def test_it_shows_the_rollups_of_the_chosen_range(self, admin_client, keys):
        one, _ = keys
        now = datetime.now(UTC)
        rollup(one, start=now.replace(minute=0, second=0, microsecond=0), model="gamma", latencies=[120] * 41 + [300])

        response = admin_client.get("/console/?range=hour")

        assert response.status_code == 200
        data = page_data(response)
        assert data["range"] == "hour"
        assert "gamma:1" in [t["name"] for t in data["figures"]["requests"]["data"]]
        html = response.content.decode()
        assert 'data-headline="requests">42<' in html
        assert 'data-version-row="gamma:1"' in html
        assert '<option value="hour" selected>' in html
        assert len(re.findall(r'class="plot" id="chart-', html)) == 6

    def test_a_clients_cancels_are_their_own_outcome_not_errors(self, admin_client, keys):
        """Issue 34, defect 12, the audit's case: a chat model's 26 requests were 26 playground
        Stops (499, client_closed), and the overview said 26 errors, an error rate of 100 %."""
        one, _ = keys
        now = datetime.now(UTC)
        for i in range(26):
            make_record(
                one, at=now - timedelta(seconds=i), model="stopped-chat", status=499, error_code="client_closed"
            )
        rollups_rebuild(start=now - timedelta(hours=1), end=now + timedelta(hours=1))

        response = admin_client.get("/console/?range=hour")

        data = page_data(response)
        [row] = [r for r in data["rows"] if r["model"] == "stopped-chat"]
        assert (row["requests"], row["error_rate"], row.get("cancelled")) == ("26", "—", "26")
        errors = trace(data, "errors", "stopped-chat:1")["y"]
        assert not any(errors), errors  # no error rate at any hour
        assert sum(y or 0 for y in trace(data, "errors", "stopped-chat:1 cancelled")["y"]) > 0
        html = response.content.decode()
        assert 'data-headline="cancelled">26<' in html
        assert "Cancelled by client" in html

    def test_a_chart_names_the_five_busiest_versions_and_sums_the_rest(self, keys):
        one, _ = keys
        for i in range(7):
            rollup(one, start=LAST_HOUR, model=f"m{i}", requests=10 + i, output_tokens=100 * (i + 1),
                   latencies=[100 + i] * (10 + i))  # fmt: skip
        data = dashboard(range_key="day", now=NOW)
        names = [t["name"] for t in data["figures"]["requests"]["data"]]
        assert names == ["m2:1", "m3:1", "m4:1", "m5:1", "m6:1", "2 other versions"]
        assert y_at(data, "requests", "2 other versions", LAST_HOUR) == pytest.approx((10 + 11) / 3600, abs=1e-6)
        assert y_at(data, "tokens", "2 other versions", LAST_HOUR) == pytest.approx((100 + 200) / 3600, abs=1e-6)
        # Percentiles of the merged distributions, not an average of percentiles.
        assert y_at(data, "latency", "2 other versions p99", LAST_HOUR) == pytest.approx(101, rel=0.02)
        assert len({t["line"]["color"] for t in data["figures"]["requests"]["data"]}) == 6
        assert len(data["rows"]) == 7  # the table still lists every version
        layout = data["figures"]["requests"]["layout"]
        assert layout["legend"]["orientation"] == "v"  # beside the plot, not under it
        assert layout["height"] >= 300

    def test_at_a_glance_revenue_replicas_alerts_canaries_and_backlog_with_links(self, admin_client, keys):
        one, _ = keys
        today = datetime.now(UTC)
        UsageRollup.objects.create(period=UsageRollup.Period.DAY, start=today.replace(hour=0, minute=0, second=0,
                                   microsecond=0), organization_id=one.organization_id, api_key=one, model="rev",
                                   model_version="1", requests=3, cost=Decimal("0.0043"))  # fmt: skip
        BudgetAlert.objects.create(organization_id=one.organization_id, budget=BudgetAlert.Budget.SPEND,
                                   month=f"{today:%Y-%m}", threshold_percent=80, used=Decimal("8"),
                                   limit=Decimal("10"))  # fmt: skip
        html = admin_client.get("/console/").content.decode()
        glance = html.split('aria-label="At a glance"')[1].split("</section>")[0]
        revenue = glance.split('data-glance="revenue"')[1].split("</a>")[0]
        assert "$0.0043" in revenue  # the platform's money format: a sub-cent amount by its digits
        assert 'href="/console/invoices/"' in glance
        alerts = glance.split('data-glance="budget_alerts"')[1].split("</a>")[0]
        assert "<strong>1</strong>" in alerts
        assert "glance-warn" in glance.split('data-glance="budget_alerts"')[0].rsplit("<a", 1)[1]
        for key, link in (("replicas", "/console/deployments/"), ("canaries", "/console/canaries/"),
                          ("batch_backlog", "/console/batches/")):  # fmt: skip
            assert f'href="{link}" data-glance="{key}"' in glance

    def test_an_unknown_range_falls_back_to_the_last_day(self, admin_client):
        response = admin_client.get("/console/?range=forever")
        assert response.status_code == 200
        assert page_data(response)["range"] == "day"


# --- The live view's socket -------------------------------------------------------------------


@pytest.fixture
def session_cookies(django_db_setup, django_db_blocker, settings):
    """Committed sessions (the consumer reads them from another thread) of a platform admin and
    of an organisation member, and one committed rollup; all removed after. Not transactional_db:
    its flush at the end would wipe what the session's other tests committed (the bundled models)."""
    from django.contrib.sessions.models import Session

    from accounts.models import ApiKey, Organization

    settings.CONSOLE_LIVE_INTERVAL_SECONDS = 0.2
    tag = uuid.uuid4().hex[:6]
    with django_db_blocker.unblock():
        org = organization_create(name=f"Live Org {tag}")
        admin = get_user_model().objects.create_superuser(username=f"live-admin-{tag}", password="pw-123456789")
        member = get_user_model().objects.create_user(username=f"live-member-{tag}", password="pw-123456789")
        Membership.objects.create(user=member, organization=org, role=Role.ORG_ADMIN)
        key = api_key_create(organization=org, name="live").api_key
        rollup(key, start=datetime.now(UTC).replace(minute=0, second=0, microsecond=0), model="live", requests=7)
        cookies = {}
        for name, user in (("admin", admin), ("member", member)):
            client = Client()
            client.force_login(user)
            cookies[name] = client.cookies[settings.SESSION_COOKIE_NAME].value
    with django_db_blocker.unblock():  # the consumer's threads read the committed rows
        yield cookies
    with django_db_blocker.unblock():
        Session.objects.filter(session_key__in=cookies.values()).delete()
        UsageRollup.objects.filter(organization=org).delete()
        ApiKey.objects.filter(organization=org).delete()
        admin.delete()
        member.delete()
        Organization.objects.filter(pk=org.pk).delete()


def communicator(cookie: str | None, origin: str = "http://testserver", path: str = "/ws/console/live?range=hour"):
    from channels.routing import URLRouter
    from channels.testing import WebsocketCommunicator
    from django.conf import settings

    from console.routing import websocket_urlpatterns

    headers = [(b"origin", origin.encode()), (b"host", b"testserver")]
    if cookie is not None:
        headers.append((b"cookie", f"{settings.SESSION_COOKIE_NAME}={cookie}".encode()))
    return WebsocketCommunicator(URLRouter(websocket_urlpatterns), path, headers=headers)


class TestLiveConsumer:
    async def test_a_platform_admin_gets_figures_now_and_every_interval(self, session_cookies):
        socket = communicator(session_cookies["admin"])
        connected, _ = await socket.connect()
        assert connected
        first = await socket.receive_json_from(timeout=10)
        assert first["type"] == "overview"
        assert first["range"] == "hour"
        # Its row (the table lists every version; a chart names only the five busiest of them all).
        assert "live:1" in [f"{row['model']}:{row['version']}" for row in first["rows"]]
        assert first["figures"]["requests"]["data"]
        # Platform-wide: other tests' committed usage may add to the 7 requests of this one.
        assert int(first["headline"]["requests"].replace(",", "")) >= 7
        assert set(first["gateway"]) >= {"requests_per_second", "output_tokens_per_second", "in_flight"}
        second = await socket.receive_json_from(timeout=10)
        assert second["type"] == "overview"
        assert second["at"] >= first["at"]
        assert second["gateway"]["requests_per_second"] != "—"  # a rate, now that there are two samples
        await socket.disconnect()

    async def test_the_client_switches_the_window(self, session_cookies):
        socket = communicator(session_cookies["admin"])
        assert (await socket.connect())[0]
        await socket.receive_json_from(timeout=10)
        await socket.send_json_to({"range": "30d"})
        for _ in range(10):
            message = await socket.receive_json_from(timeout=10)
            if message["range"] == "30d":
                break
        assert message["range"] == "30d"
        await socket.disconnect()

    @pytest.mark.parametrize("who", ["member", None])
    async def test_anyone_else_is_refused(self, session_cookies, who):
        socket = communicator(session_cookies[who] if who else None)
        connected, code = await socket.connect()
        assert not connected
        assert code == 4403
        await socket.disconnect()

    async def test_another_origin_is_refused(self, session_cookies):
        socket = communicator(session_cookies["admin"], origin="https://evil.example")
        connected, _ = await socket.connect()
        assert not connected
        await socket.disconnect()
