"""The console's canary pages: the list, a canary with its charts and decisions, the start
wizard, the pause/resume/promote/rollback buttons, and the shadow policy."""

from __future__ import annotations

import json
import random
import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from accounts.models import Membership, Role
from registry.models import AuditEntry, Deployment, Model
from rollout.canary import canary_create
from rollout.canary_stats import RequestSample, judge
from rollout.models import Canary, CanaryDecision
from serving.models import ShadowPolicy
from tests.support.registry import make_version

pytestmark = pytest.mark.django_db


@pytest.fixture
def chat_model() -> Model:
    """gpt-tiny: v1 running at 100 %, v2 running at 0 %."""
    model = Model.objects.create(name="gpt-tiny", task="chat")
    for name, weight in (("v1", 100), ("v2", 0)):
        Deployment.objects.create(version=make_version(model, name), status="running", traffic_weight=weight)
    return model


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser(username="ops", password="x"))
    return client


def weights(model: Model) -> dict[str, int]:
    return dict(Deployment.objects.filter(version__model=model).values_list("version__version", "traffic_weight"))


def served(n: int, *, seed: int, slow: float = 1.0) -> list[RequestSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = rng.randint(10, 60)
        ttft = int(rng.lognormvariate(4.5, 0.3) * slow)
        out.append(RequestSample(200, ttft + int(18 * slow) * (tokens - 1), ttft, tokens, "stop"))
    return out


def decide(canary: Canary, *, slow: float, verdict: str, seed: int = 1) -> CanaryDecision:
    """A decision as rollout.canary.canary_decide stores it: the judgement's figures and reasons."""
    judgement = judge(served(400, seed=seed), served(120, seed=seed + 1, slow=slow), min_samples=50)
    return CanaryDecision.objects.create(
        canary=canary, at=timezone.now(), step=canary.current_step, canary_percent=canary.canary_percent,
        verdict=verdict, reasons=judgement.reasons,
        figures={**judgement.figures, "window_start": canary.step_started_at.isoformat()},
    )  # fmt: skip


@pytest.fixture
def canary(chat_model) -> Canary:
    return canary_create(
        actor=None, model=chat_model, base_version="v1", canary_version="v2", steps=[5, 25, 50, 100],
        interval_seconds=60,
    )  # fmt: skip


class TestAccess:
    def test_anonymous_visitors_go_to_the_login_page(self, chat_model):
        for url in ("/console/canaries/", "/console/canaries/gpt-tiny/", "/console/canaries/gpt-tiny/new/"):
            response = Client().get(url)
            assert response.status_code == 302
            assert response["Location"].startswith("/accounts/login/")

    def test_organisation_users_are_refused(self, canary, alice_org):
        for role in (Role.ORG_ADMIN, Role.ORG_MEMBER):
            user = get_user_model().objects.create_user(username=f"u-{role}", password="x")
            Membership.objects.create(user=user, organization=alice_org, role=role)
            client = Client()
            client.force_login(user)
            for url in ("/console/canaries/", "/console/canaries/gpt-tiny/", "/console/canaries/gpt-tiny/new/",
                        "/console/canaries/gpt-tiny/state/"):  # fmt: skip
                assert client.get(url).status_code == 403
            for action in ("pause", "rollback"):
                response = client.post(f"/console/canaries/gpt-tiny/{action}/", {"confirm": "yes"})
                assert response.status_code == 403
        canary.refresh_from_db()
        assert canary.status == "running"


class TestList:
    def test_it_lists_models_with_their_canary(self, admin_client, canary):
        Model.objects.create(name="embedder", task="embedding")
        html = admin_client.get("/console/canaries/").content.decode()
        assert 'href="/console/canaries/gpt-tiny/"' in html
        assert "v1 → v2" in html
        row = html[html.index('data-model="gpt-tiny"') :].split("</tr>")[0]
        assert '<span class="status status-canary" data-lifecycle="canary">canary at 5 %</span>' in row
        assert "never canaried" in html
        # A model with one version is not offered a canary: the row says why.
        make_version(Model.objects.get(name="embedder"), "1")
        html = admin_client.get("/console/canaries/").content.decode()
        row = html[html.index('data-model="embedder"') :].split("</tr>")[0]
        assert "Start a canary" not in row
        assert "one version: nothing to compare it with" in row
        row = html[html.index('data-model="gpt-tiny"') :].split("</tr>")[0]
        assert 'href="/console/canaries/gpt-tiny/new/">Start a canary</a>' in row
        filtered = admin_client.get("/console/canaries/?status=active").content.decode()
        assert 'data-model="gpt-tiny"' in filtered
        assert 'data-model="embedder"' not in filtered
        assert 'data-model="gpt-tiny"' not in admin_client.get("/console/canaries/?model=emb").content.decode()


class TestProgress:
    """Issue 40: a promoted canary read "Promoted" beside "2 of 3 (50 %)": the step it was
    promoted from, not the share it left. The list and the canary's page say the same."""

    def progress(self, client: Client) -> tuple[str, str]:
        listed = client.get("/console/canaries/").content.decode()
        row = listed.split('data-model="gpt-tiny"')[1].split("</tr>")[0]
        page = client.get("/console/canaries/gpt-tiny/").content.decode()
        in_list = re.search(r'<td data-col="progress">([^<]*)</td>', row)
        on_page = re.search(r'<dd data-field="progress">([^<]*) <span', page)
        assert in_list
        assert on_page
        return in_list.group(1), on_page.group(1)

    def test_a_minimum_of_one_request_reads_as_one(self, admin_client, canary):
        Canary.objects.filter(pk=canary.pk).update(min_samples=1)
        html = admin_client.get("/console/canaries/gpt-tiny/").content.decode()
        assert "60 s, at least 1 request per arm" in html

    def test_a_running_canary_says_its_step_and_share(self, admin_client, canary):
        assert self.progress(admin_client) == ("Step 1 of 4 · canary at 5 %",) * 2

    def test_auto_promoted_before_a_last_step_of_100_it_is_done(self, admin_client, chat_model):
        canary = canary_create(actor=None, model=chat_model, base_version="v1", canary_version="v2",
                               steps=[10, 50, 100], interval_seconds=60, auto_promote=True)  # fmt: skip
        Canary.objects.filter(pk=canary.pk).update(current_step=1)
        canary.refresh_from_db()
        decide(canary, slow=1.0, verdict="promote")  # the controller's: judged figures, no actor
        Canary.objects.filter(pk=canary.pk).update(status="promoted")
        assert self.progress(admin_client) == ("All 3 steps done · promoted to 100 %",) * 2

    def test_a_person_promoting_early_says_where_from(self, admin_client, canary):
        assert admin_client.post("/console/canaries/gpt-tiny/promote/", {"confirm": "yes"}).status_code == 302
        assert self.progress(admin_client) == ("Promoted at step 1 of 4 (5 %) · now 100 %",) * 2

    def test_a_rollback_says_where_from(self, admin_client, canary):
        assert admin_client.post("/console/canaries/gpt-tiny/rollback/", {"confirm": "yes"}).status_code == 302
        assert self.progress(admin_client) == ("Rolled back at step 1 of 4 (5 %) · now 0 %",) * 2

    def test_a_completed_canary_has_done_every_step(self, admin_client, canary):
        Canary.objects.filter(pk=canary.pk).update(current_step=3, status="completed")
        assert self.progress(admin_client) == ("All 4 steps done · canary at 100 %",) * 2


class TestCanaryPage:
    def test_it_shows_state_split_and_decisions_with_their_statistics(self, admin_client, canary):
        hold = decide(canary, slow=1.0, verdict="promote_step", seed=3)
        worse = decide(canary, slow=1.6, verdict="rollback", seed=5)
        html = admin_client.get("/console/canaries/gpt-tiny/").content.decode()
        assert "Running" in html
        assert "v1 95 %" in html
        assert "v2 5 %" in html
        assert 'v1 <span class="status status-base" data-lifecycle="base">canary base at 95 %</span>' in html
        assert 'v2 <span class="status status-canary" data-lifecycle="canary">canary at 5 %</span>' in html
        assert f'data-decision="{hold.pk}"' in html
        assert f'data-decision="{worse.pk}"' in html
        assert 'data-test="latency_ms"' in html
        assert "mann_whitney_u" in html
        latency = worse.figures["tests"]["latency_ms"]
        assert f"{latency['n_base']} / {latency['n_canary']}" in html  # sample sizes
        assert f"{latency['p_value']:.3g}" in html  # p-value as the page rounds it
        for reason in worse.reasons:
            assert reason.replace(">", "&gt;") in html
        # The comparison charts, built server-side: both arms, four panels, one point per window.
        figure = json.loads(html.split('id="canary-figure" type="application/json">')[1].split("</script>")[0])
        titles = [a["text"] for a in figure["layout"]["annotations"]]
        assert titles == [
            "Success rate (%)",
            "p99 latency (ms)",
            "p99 time to first token (ms)",
            "Time per output token, median (ms)",
        ]  # fmt: skip; no empty-plot note: every series has values
        layout = figure["layout"]
        assert [layout[f"yaxis{n}"]["title"]["text"] for n in ("", "2", "3", "4")] == ["%", "ms", "ms", "ms"]
        assert layout["xaxis3"]["title"]["text"] == layout["xaxis4"]["title"]["text"] == "step: canary share"
        assert figure["data"][0]["x"] == [f"{canary.current_step + 1}: 5 %"] * 2
        assert len(figure["data"]) == 8
        assert {t["name"] for t in figure["data"]} == {"base", "canary"}
        canary_latency = next(t for t in figure["data"] if t["name"] == "canary" and t["yaxis"] == "y2")
        assert canary_latency["y"][1] == worse.figures["arms"]["canary"]["latency_ms"]["p99"]
        assert 'src="/static/plotly/plotly.min.js"' in html

    def test_plots_with_nothing_to_show_say_why(self, admin_client, canary):
        """Requests that did not stream have no TTFT or TPOT: those plots say so instead of an empty grid."""
        unstreamed = [RequestSample(200, 300 + i, None, 20, "stop") for i in range(200)]
        judgement = judge(unstreamed[:150], unstreamed[150:], min_samples=20)
        CanaryDecision.objects.create(
            canary=canary, at=timezone.now(), step=0, canary_percent=5, verdict="hold", reasons=judgement.reasons,
            figures=judgement.figures,
        )  # fmt: skip
        html = admin_client.get("/console/canaries/gpt-tiny/").content.decode()
        figure = json.loads(html.split('id="canary-figure" type="application/json">')[1].split("</script>")[0])
        notes = {a["text"]: (a["xref"], a["yref"]) for a in figure["layout"]["annotations"] if a["xref"] != "paper"}
        assert notes == {
            "TTFT: streamed requests only, none yet": ("x3 domain", "y3 domain"),
            "TPOT: streams of 2+ tokens only, none yet": ("x4 domain", "y4 domain"),
        }

    def test_a_page_without_decisions_says_when_the_first_comes(self, admin_client, canary):
        html = admin_client.get("/console/canaries/gpt-tiny/").content.decode()
        assert "No judged window yet" in html
        assert "canary-figure" not in html

    def test_a_model_without_canary_offers_the_wizard(self, admin_client, chat_model):
        html = admin_client.get("/console/canaries/gpt-tiny/").content.decode()
        assert "never had a canary" in html
        assert 'action="/console/canaries/gpt-tiny/new/"' in html
        assert admin_client.get("/console/canaries/nope/").status_code == 404

    def test_the_state_changes_with_a_decision_and_the_fragment_shows_it(self, admin_client, canary):
        before = admin_client.get("/console/canaries/gpt-tiny/state/").json()
        decision = decide(canary, slow=1.0, verdict="hold")
        after = admin_client.get("/console/canaries/gpt-tiny/state/").json()
        assert before["stamp"] != after["stamp"]
        assert after["decisions"] == 1
        fragment = admin_client.get("/console/canaries/gpt-tiny/?fragment=1").content.decode()
        assert f'data-decision="{decision.pk}"' in fragment
        assert "<html" not in fragment
        # The history's decision count moves with it (it is part of what the page refreshes).
        history = fragment.split('id="canary-history"')[1].split(f'data-canary="{canary.pk}"')[1].split("</tr>")[0]
        assert '<td class="num">1</td>' in history


class TestWizard:
    def form(self, **changes: str) -> dict[str, str]:
        return {
            "base_version": "v1", "canary_version": "v2", "steps": "10, 50, 100", "interval_seconds": "120",
            "min_samples": "40", "max_p99_latency_ms": "2000", "min_success_rate": "99", "max_ttft_p99_ms": "",
            "auto_promote": "on", **changes,
        }  # fmt: skip

    def test_it_starts_a_canary_through_the_service(self, admin_client, chat_model):
        assert "Start a canary of gpt-tiny" in admin_client.get("/console/canaries/gpt-tiny/new/").content.decode()
        response = admin_client.post("/console/canaries/gpt-tiny/new/", self.form())
        assert response.status_code == 302
        assert response["Location"] == "/console/canaries/gpt-tiny/"
        canary = Canary.objects.get(model=chat_model)
        assert canary.steps == [10, 50, 100]
        assert canary.interval_seconds == 120
        assert canary.min_samples == 40
        assert canary.success_criteria == {"max_p99_latency_ms": 2000.0, "min_success_rate": 0.99}
        assert canary.auto_promote is True
        assert canary.created_by is not None
        assert canary.created_by.username == "ops"
        assert weights(chat_model) == {"v1": 90, "v2": 10}
        assert AuditEntry.objects.filter(action="canary.create", actor_name="ops").exists()
        page = admin_client.get(response["Location"]).content.decode()
        assert "Canary of gpt-tiny started" in page
        assert "p99 latency ≤ 2,000 ms" in page  # the units of the wizard
        assert "success rate ≥ 99 %" in page

    def test_the_wizard_offers_only_valid_versions_and_shows_the_schedule(self, admin_client, chat_model):
        html = admin_client.get("/console/canaries/gpt-tiny/new/").content.decode()
        base = re.search(r'<select name="base_version"[^>]*>(.*?)</select>', html, re.S)
        candidate = re.search(r'<select name="canary_version"[^>]*>(.*?)</select>', html, re.S)
        assert base
        assert candidate
        assert re.findall(r'<option value="([^"]*)"', base.group(1)) == ["v1"]  # serving now
        assert re.findall(r'<option value="([^"]*)"', candidate.group(1)) == ["v2"]  # deployed, not serving
        schedule = re.findall(r"<li>(\d+) % of the requests to the candidate from (\d+) s to (\d+) s</li>", html)
        assert schedule == [("5", "0", "300"), ("25", "300", "600"), ("50", "600", "900"), ("100", "900", "1200")]
        assert "The earliest it can finish is 1200 s after it starts" in html

    @pytest.mark.parametrize(
        ("changes", "message"),
        [
            ({"steps": "50, 25"}, "Steps must increase."),
            ({"steps": "five"}, "Give whole percentages separated by commas"),
            ({"canary_version": "v1"}, "Select a valid choice. v1 is not one of the available choices."),
            ({"min_success_rate": "150"}, "Ensure this value is less than or equal to 100."),
            ({"interval_seconds": "0"}, "Ensure this value is greater than or equal to 1."),
        ],
    )
    def test_errors_show_on_their_fields(self, admin_client, chat_model, changes, message):
        response = admin_client.post("/console/canaries/gpt-tiny/new/", self.form(**changes))
        assert response.status_code == 200
        assert message.replace("'", "&#x27;") in response.content.decode()
        assert not Canary.objects.exists()
        assert weights(chat_model) == {"v1": 100, "v2": 0}

    def test_the_same_version_on_both_sides_is_a_form_error(self, admin_client, chat_model):
        """Issue 40: with the candidate's choices falling back to every deployed version (here both
        serve), the wizard took v1 → v1 and left the refusal to the service."""
        Deployment.objects.filter(version__model=chat_model, version__version="v2").update(traffic_weight=50)
        Deployment.objects.filter(version__model=chat_model, version__version="v1").update(traffic_weight=50)
        response = admin_client.post("/console/canaries/gpt-tiny/new/", self.form(canary_version="v1"))
        assert response.status_code == 200
        html = response.content.decode()
        assert "The candidate must be another version than the base: v1 is both." in html
        assert not Canary.objects.exists()

    def test_a_model_with_one_version_is_told_why_and_gets_no_form(self, admin_client):
        model = Model.objects.create(name="solo", task="chat")
        Deployment.objects.create(version=make_version(model, "v1"), status="running", traffic_weight=100)
        html = admin_client.get("/console/canaries/solo/new/").content.decode()
        assert "solo has one version (v1): a canary compares a second version with it." in html
        assert 'href="/console/models/register/?name=solo"' in html
        assert 'value="solo"' in admin_client.get("/console/models/register/?name=solo").content.decode()
        assert 'name="base_version"' not in html
        assert admin_client.post("/console/canaries/solo/new/", self.form(base_version="v1")).status_code == 200
        assert not Canary.objects.exists()

    def test_a_second_active_canary_is_refused(self, admin_client, canary):
        assert "has an active canary already" in admin_client.get("/console/canaries/gpt-tiny/new/").content.decode()
        response = admin_client.post("/console/canaries/gpt-tiny/new/", self.form())
        assert "has an active canary already; promote or roll it back first." in response.content.decode()
        assert Canary.objects.count() == 1


class TestButtons:
    def test_pause_and_resume(self, admin_client, canary):
        response = admin_client.post("/console/canaries/gpt-tiny/pause/")
        assert response.status_code == 302
        canary.refresh_from_db()
        assert canary.status == "paused"
        assert "Canary of gpt-tiny paused" in admin_client.get(response["Location"]).content.decode()
        admin_client.post("/console/canaries/gpt-tiny/resume/")
        canary.refresh_from_db()
        assert canary.status == "running"
        refused = admin_client.post("/console/canaries/gpt-tiny/resume/", follow=True).content.decode()
        assert "The canary is running: it cannot resume." in refused

    @pytest.mark.parametrize(("action", "status", "split"), [
        ("promote", "promoted", {"v1": 0, "v2": 100}),
        ("rollback", "rolled_back", {"v1": 100, "v2": 0}),
    ])  # fmt: skip
    def test_promote_and_rollback_ask_first(self, admin_client, canary, action, status, split):
        confirm = admin_client.get(f"/console/canaries/gpt-tiny/{action}/").content.decode()
        assert 'name="confirm" value="yes"' in confirm
        unconfirmed = admin_client.post(f"/console/canaries/gpt-tiny/{action}/")
        assert unconfirmed.status_code == 200
        assert 'name="confirm"' in unconfirmed.content.decode()
        canary.refresh_from_db()
        assert canary.status == "running"
        response = admin_client.post(f"/console/canaries/gpt-tiny/{action}/", {"confirm": "yes"})
        assert response.status_code == 302
        canary.refresh_from_db()
        assert canary.status == status
        assert weights(canary.model) == split
        page = admin_client.get(response["Location"]).content.decode()
        assert "by ops" in page  # the person's decision in the timeline
        assert (
            admin_client.post(f"/console/canaries/gpt-tiny/{action}/", {"confirm": "yes"}, follow=True)
            .content.decode()
            .count("has no active canary")
            == 1
        )

    def test_every_canary_stays_in_the_history(self, admin_client, canary):
        assert admin_client.post("/console/canaries/gpt-tiny/rollback/", {"confirm": "yes"}).status_code == 302
        second = canary_create(actor=None, model=canary.model, base_version="v1", canary_version="v2", steps=[50, 100],
                               interval_seconds=60)  # fmt: skip
        html = admin_client.get("/console/canaries/gpt-tiny/").content.decode()
        history = re.search(r'<section class="card" id="canary-history">(.*?)</section>', html, re.S)
        assert history
        rows = re.findall(r'<tr data-canary="(\d+)"', history.group(1))
        assert rows == [str(second.pk), str(canary.pk)]  # newest first, the rolled-back one kept
        assert "Rolled back" in history.group(1)
        assert "50 → 100 %" in history.group(1)

    def test_an_unknown_action_is_404(self, admin_client, canary):
        assert admin_client.post("/console/canaries/gpt-tiny/explode/").status_code == 404


class TestShadow:
    def test_it_sets_and_stops_a_shadow(self, admin_client, chat_model):
        response = admin_client.post("/console/canaries/gpt-tiny/shadow/", {"version": "v2", "percent": "12.5"})
        assert response.status_code == 302
        policy = ShadowPolicy.objects.get(model=chat_model)
        assert policy.candidate.version == "v2"
        assert str(policy.percent) == "12.50"
        html = admin_client.get("/console/canaries/gpt-tiny/").content.decode()
        assert "Mirroring 12.5 % of gpt-tiny" in html
        assert 'data-arm="candidate"' in html
        assert admin_client.post("/console/canaries/gpt-tiny/shadow/stop/").status_code == 302
        assert not ShadowPolicy.objects.exists()
        again = admin_client.post("/console/canaries/gpt-tiny/shadow/stop/", follow=True).content.decode()
        assert "gpt-tiny has no shadow policy." in again

    def test_each_version_is_offered_as_what_it_is_now(self, admin_client, chat_model):
        """Issue 40: the form called every version "deployed", a registered one too."""
        make_version(chat_model, "v3")
        html = admin_client.get("/console/canaries/gpt-tiny/").content.decode()
        select = re.search(r'<select name="version"[^>]*>(.*?)</select>', html, re.S)
        assert select
        options = dict(re.findall(r'<option value="([^"]*)"[^>]*>([^<]*)</option>', select.group(1)))
        assert options == {"v1": "v1 (serving 100 %)", "v2": "v2 (deployed, no traffic)",
                           "v3": "v3 (registered, not deployed)"}  # fmt: skip
        assert "deployed (its weight may be 0)" not in html

    def test_the_version_answering_every_request_is_refused(self, admin_client, chat_model):
        response = admin_client.post("/console/canaries/gpt-tiny/shadow/", {"version": "v1", "percent": "10"})
        assert response.status_code == 200
        assert "gpt-tiny:v1 answers every request of gpt-tiny itself" in response.content.decode()
        assert not ShadowPolicy.objects.exists()

    def test_a_bad_percent_is_a_field_error(self, admin_client, chat_model):
        response = admin_client.post("/console/canaries/gpt-tiny/shadow/", {"version": "v2", "percent": "150"})
        assert response.status_code == 200
        assert "Ensure this value is less than or equal to 100." in response.content.decode()
        assert not ShadowPolicy.objects.exists()


def test_a_clients_cancels_show_apart_from_the_judged_requests(admin_client, canary):
    """Issue 34, defect 12: the canary answered 90 and failed 10; its clients cancelled 900. The
    timeline says so: n 100, success 90 %, 900 cancelled by their clients (not 1,000 at 99 %)."""
    failed = [RequestSample(502, 30)] * 10
    cancelled = [RequestSample(499, 2000, 90)] * 900
    judgement = judge(served(400, seed=3), served(90, seed=4) + failed + cancelled, min_samples=50)
    decision = CanaryDecision.objects.create(
        canary=canary, at=timezone.now(), step=0, canary_percent=5, verdict="rollback", reasons=judgement.reasons,
        figures=judgement.figures,
    )  # fmt: skip
    html = admin_client.get("/console/canaries/gpt-tiny/").content.decode()
    article = html[html.index(f'data-decision="{decision.pk}"') :].split("</article>")[0]
    row = article[article.index('data-arm="canary"') :].split("</tr>")[0]
    assert re.findall(r"<td>([^<]*)</td>", row)[:3] == ["100", "900", "90"]  # n, cancelled, success %
    assert "Cancelled by client" in article


def test_the_controllers_decision_is_shown(admin_client, canary):
    """A decision the controller itself made (canary_decide with its own loader) shows, figures and all."""
    from rollout.canary import canary_decide

    def loader(*, model: str, version: str, since: object) -> list[RequestSample]:
        return served(300, seed=7) if version == "v1" else served(80, seed=8)

    decision = canary_decide(canary_id=canary.pk, load_samples=loader, now=timezone.now() + timedelta(seconds=61))
    assert decision is not None
    assert decision.verdict == "promote_step"
    html = admin_client.get("/console/canaries/gpt-tiny/").content.decode()
    assert f'data-decision="{decision.pk}"' in html
    assert "Promote to the next step" in html
    assert "v1 75 %" in html
    assert "v2 25 %" in html
