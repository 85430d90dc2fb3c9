"""The canary controller: its statistics, its decisions over usage records fed with chosen
distributions (seeded), the management API, and one run through real gateways and fake engines."""

from __future__ import annotations

import json
import math
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.models import ApiKey, Role
from accounts.services import api_key_create, membership_set, organization_create, platform_organization
from billing.models import CacheOutcome, UsageRecord
from core.transitions import IllegalTransition
from registry.models import AuditEntry, Deployment, Model, ModelVersion
from rollout.canary import (
    CanaryConflict,
    canary_create,
    canary_decide,
    canary_pause,
    canary_resume,
    canary_rollback,
    canary_tick,
    plan_move,
)
from rollout.canary_stats import RequestSample, distribution_test, holm, judge, percentile, proportion_test
from rollout.models import Canary, CanaryDecision
from rollout.served_requests import served_requests

INTERVAL = 60


# --- Distributions ----------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """How a version answers: its server-error share and how much slower than the reference it is."""

    fail: float = 0.002
    slow: float = 1.0
    empty: float = 0.0
    truncated: float = 0.05
    cancelled: float = 0.0  # its clients' cancels (499): drawn only when set, so seeded runs stay as they were

    def sample(self, rng: random.Random) -> RequestSample:
        if self.cancelled and rng.random() < self.cancelled:
            return RequestSample(status_code=499, latency_ms=rng.randint(50, 4000), ttft_ms=rng.randint(20, 200))
        if rng.random() < self.fail:
            return RequestSample(status_code=502, latency_ms=rng.randint(5, 40))
        tokens = rng.randint(10, 120)
        ttft = rng.lognormvariate(math.log(90), 0.4) * self.slow
        tpot = rng.lognormvariate(math.log(18), 0.25) * self.slow
        streamed = rng.random() < 0.7
        if rng.random() < self.empty:
            return RequestSample(200, int(ttft), int(ttft) if streamed else None, 0, "stop")
        finish = "length" if rng.random() < self.truncated else "stop"
        return RequestSample(200, int(ttft + tpot * (tokens - 1)), int(ttft) if streamed else None, tokens, finish)


GOOD = Profile()


def samples(profile: Profile, n: int, seed: int) -> list[RequestSample]:
    rng = random.Random(seed)
    return [profile.sample(rng) for _ in range(n)]


# --- Statistics -------------------------------------------------------------------------


class TestStatistics:
    def test_percentile_is_nearest_rank(self):
        assert percentile([], 0.5) is None
        assert percentile([3, 1, 2], 0.5) == 2
        assert percentile(list(range(1, 101)), 0.99) == 99
        assert percentile([7], 0.99) == 7

    def test_holm_steps_down(self):
        assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
        assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
        assert holm([]) == []

    def test_tpot_is_for_streamed_answers_of_two_tokens_or_more(self):
        assert RequestSample(200, 1000, 100, 10).tpot_ms == pytest.approx(100)
        assert RequestSample(200, 1000, None, 10).tpot_ms is None  # not streamed
        assert RequestSample(200, 1000, 100, 1).tpot_ms is None
        assert RequestSample(502, 1000, 100, 10).tpot_ms is None

    def test_proportions_are_judged_by_fishers_exact_test(self):
        small = proportion_test("errors", base_hits=0, base_n=950, canary_hits=5, canary_n=50, min_increase=0.02)
        assert small.test == "fisher_exact"
        assert small.p_value < 1e-5
        assert small.effect == pytest.approx(0.1)
        large = proportion_test("errors", base_hits=100, base_n=1000, canary_hits=150, canary_n=1000, min_increase=0.02)
        assert large.test == "fisher_exact"
        assert large.p_value == pytest.approx(0.0004, abs=0.0002)
        assert large.statistic == pytest.approx(1.59, abs=0.01)  # the odds ratio
        # The minimum effect: 2 points, and at least twice the base's share.
        assert large.min_effect == pytest.approx(0.10)
        # One-sided: a canary with fewer errors is never "worse".
        better = proportion_test("errors", base_hits=150, base_n=1000, canary_hits=100, canary_n=1000, min_increase=0)
        assert better.p_value > 0.99

    def test_mann_whitney_is_one_sided(self):
        slow = distribution_test("latency_ms", base=[10.0] * 30 + [11.0] * 30, canary=[30.0] * 40, min_ratio=1.25)
        assert slow.test == "mann_whitney_u"
        assert slow.p_value < 1e-10
        assert slow.effect == pytest.approx(3.0)
        fast = distribution_test("latency_ms", base=[30.0] * 40, canary=[10.0] * 30, min_ratio=1.25)
        assert fast.p_value > 0.99

    def test_nothing_is_judged_before_the_minimum_sample(self):
        result = judge(samples(GOOD, 900, 1), samples(Profile(fail=1.0), 49, 2), min_samples=50)
        assert result.verdict == "hold"
        assert "canary has 49 of 50 requests" in result.reasons[0]
        assert result.figures["arms"]["canary"]["n"] == 49
        assert result.figures["tests"] == {}

    def test_a_canary_failing_10_percent_is_worse(self):
        result = judge(samples(GOOD, 950, 1), samples(Profile(fail=0.10), 50, 2), min_samples=50)
        assert result.verdict == "rollback"
        errors = result.figures["tests"]["error_rate"]
        assert errors["worse"]
        assert errors["test"] == "fisher_exact"
        assert any(reason.startswith("canary error_rate worse") for reason in result.reasons)

    def test_a_canary_3x_slower_is_worse_on_latency_ttft_and_tpot(self):
        result = judge(samples(GOOD, 950, 1), samples(Profile(slow=3.0), 50, 2), min_samples=50)
        assert result.verdict == "rollback"
        tests = result.figures["tests"]
        assert tests["latency_ms"]["worse"]
        assert tests["ttft_ms"]["worse"]
        assert tests["tpot_ms"]["worse"]
        assert tests["latency_ms"]["effect"] == pytest.approx(3.0, rel=0.3)

    def test_empty_and_truncated_answers_are_judged(self):
        empty = judge(samples(GOOD, 2000, 1), samples(Profile(empty=0.2), 300, 2), min_samples=50)
        assert empty.verdict == "rollback"
        assert empty.figures["tests"]["empty_share"]["worse"]
        cut = judge(samples(GOOD, 2000, 1), samples(Profile(truncated=0.3), 300, 2), min_samples=50)
        assert cut.verdict == "rollback"
        assert cut.figures["tests"]["truncated_share"]["worse"]

    def test_a_canary_that_looks_worse_without_the_evidence_is_held(self):
        # 3 failures in 60 against 0.2 %: past the minimum effect, p about 0.01, not significant.
        base = [RequestSample(502, 10)] * 2 + samples(Profile(fail=0), 998, 1)
        canary = [RequestSample(502, 10)] * 3 + samples(Profile(fail=0), 57, 2)
        result = judge(base, canary, min_samples=50)
        errors = result.figures["tests"]["error_rate"]
        assert errors["suspicious"]
        assert not errors["worse"]
        assert result.verdict == "hold"
        assert result.reasons[0].startswith("not yet significant, holding for more requests: canary error_rate")

    def test_a_significant_but_small_difference_is_not_worse(self):
        # 10 % slower on 20,000 requests a side: significant, yet below the 1.25x minimum effect.
        result = judge(samples(GOOD, 20_000, 1), samples(Profile(slow=1.1), 20_000, 2), min_samples=50)
        latency = result.figures["tests"]["latency_ms"]
        assert latency["significant"]
        assert not latency["worse"]
        assert result.verdict == "pass"

    def test_an_a_a_comparison_is_never_worse_over_200_seeds(self):
        verdicts = Counter()
        for seed in range(200):
            n_canary = random.Random(seed).choice([50, 100, 300, 1000])
            result = judge(samples(GOOD, 1000, 2 * seed), samples(GOOD, n_canary, 2 * seed + 1), min_samples=50)
            assert result.verdict != "rollback", (seed, result.reasons)
            verdicts[result.verdict] += 1
        # Now and then a window looks worse by chance and is held for more requests.
        assert verdicts["pass"] >= 180, verdicts

    def test_absolute_criteria_apply_to_the_canary(self):
        base, canary = samples(Profile(fail=0.03), 500, 1), samples(Profile(fail=0.03), 500, 2)
        assert judge(base, canary, min_samples=50, criteria={"min_success_rate": 0.9}).verdict == "pass"
        strict = judge(base, canary, min_samples=50, criteria={"min_success_rate": 0.99})
        assert strict.verdict == "rollback"
        assert "success rate" in strict.reasons[-1]
        p99 = judge(base, samples(GOOD, 500, 2), min_samples=50, criteria={"max_p99_latency_ms": 100})
        assert p99.verdict == "rollback"
        assert "p99 latency" in p99.reasons[-1]
        ttft = judge(base, samples(GOOD, 500, 2), min_samples=50, criteria={"max_ttft_p99_ms": 50})
        assert "p99 TTFT" in ttft.reasons[-1]

    def test_figures_are_plain_json(self):
        result = judge(samples(GOOD, 100, 1), samples(Profile(fail=1.0), 60, 2), min_samples=50)
        # No NaN or infinity (Fisher's odds ratio is infinite here): PostgreSQL's jsonb refuses them.
        text = json.dumps(result.figures, allow_nan=False)
        figures = json.loads(text)
        assert figures["arms"]["canary"]["error_rate"] == 1.0
        assert figures["tests"]["error_rate"]["statistic"] is None
        assert set(figures["skipped"]) == {"latency_ms", "ttft_ms", "tpot_ms", "empty_share", "truncated_share"}

    def test_the_move_of_each_judgement(self):
        steps = [5, 25, 50, 100]
        assert plan_move(steps=steps, current_step=0, auto_promote=True, judged="hold").verdict == "hold"
        step = plan_move(steps=steps, current_step=0, auto_promote=True, judged="pass")
        assert (step.verdict, step.next_step, step.canary_percent, step.status) == ("promote_step", 1, 25, None)
        end = plan_move(steps=steps, current_step=2, auto_promote=True, judged="pass")
        assert (end.verdict, end.canary_percent, end.status) == ("promote", 100, "promoted")
        waiting = plan_move(steps=steps, current_step=2, auto_promote=False, judged="pass")
        assert (waiting.verdict, waiting.canary_percent, waiting.status) == ("promote_step", 100, "completed")
        below = plan_move(steps=[10, 50], current_step=1, auto_promote=False, judged="pass")
        assert (below.verdict, below.canary_percent, below.status) == ("hold", None, "completed")
        back = plan_move(steps=steps, current_step=1, auto_promote=True, judged="rollback")
        assert (back.verdict, back.canary_percent, back.status) == ("rollback", 0, "rolled_back")


# --- The controller over usage records ------------------------------------------------------


@pytest.fixture
def api_key(db) -> ApiKey:
    org = organization_create(name=f"Canary traffic {uuid.uuid4().hex[:6]}")
    return api_key_create(organization=org, name="traffic").api_key


def deployed_model(name: str | None = None) -> Model:
    """A chat model with v1 (all the traffic) and v2 (none yet), each with a running deployment."""
    model = Model.objects.create(name=name or f"chat-{uuid.uuid4().hex[:8]}", task="chat")
    for version, weight in (("v1", 100), ("v2", 0)):
        found = ModelVersion.objects.create(
            model=model, version=version, framework="fake", artifact_uri=f"local://{model.name}/{version}",
            artifact_sha256="0" * 64, artifact_size=1, status="active",
        )  # fmt: skip
        Deployment.objects.create(version=found, status="running", traffic_weight=weight)
    return model


def weights(model: Model) -> dict[str, int]:
    split: dict[str, int] = {}
    for version, weight in Deployment.objects.filter(version__model=model).values_list(
        "version__version", "traffic_weight"
    ):
        split[version] = split.get(version, 0) + weight
    return split


def serve(
    key: ApiKey, model: Model, version: str, profile: Profile, count: int, rng: random.Random, start: datetime
) -> list[datetime]:
    """``count`` usage records of ``version``, admitted at random times in the interval from ``start``."""
    records = []
    for _ in range(count):
        sample = profile.sample(rng)
        records.append(
            UsageRecord(
                api_key=key,
                organization_id=key.organization_id,
                model=model.name,
                model_version=version,
                prompt_tokens=12,
                completion_tokens=sample.completion_tokens,
                total_tokens=12 + sample.completion_tokens,
                latency_ms=sample.latency_ms,
                ttft_ms=sample.ttft_ms,
                status_code=sample.status_code,
                finish_reason=sample.finish_reason,
                error_code="client_closed" if sample.status_code == 499 else "",
                created_at=start + timedelta(seconds=INTERVAL * rng.random()),
            )
        )
    UsageRecord.objects.bulk_create(records, batch_size=2000)
    return [record.created_at for record in records]


@dataclass
class Run:
    canary: Canary
    decisions: list[CanaryDecision]
    # When the canary's window first held min_samples requests (None: never).
    minimum_reached_at: datetime | None


def run(
    key: ApiKey,
    model: Model,
    *,
    canary_profile: Profile,
    seed: int,
    per_interval: int = 400,
    intervals: int = 12,
    auto_promote: bool = True,
    steps: list[int] | None = None,
    start: datetime | None = None,
) -> Run:
    """Start a canary of v2 against v1, then for each interval serve ``per_interval`` requests
    split by the canary's current share, and run the controller's tick at the boundary."""
    rng = random.Random(seed)
    now = start or timezone.now() - timedelta(days=1)
    canary = canary_create(
        actor=None, model=model, base_version="v1", canary_version="v2", steps=steps or [5, 25, 50, 100],
        interval_seconds=INTERVAL, auto_promote=auto_promote, now=now,
    )  # fmt: skip
    decisions: list[CanaryDecision] = []
    window: list[datetime] = []
    minimum_reached_at = None
    for _ in range(intervals):
        canary.refresh_from_db()
        if canary.status != Canary.Status.RUNNING:
            break
        if canary.step_started_at == now:  # a new step: a new window
            window = []
        share = canary.canary_percent
        canary_count = round(per_interval * share / 100)
        serve(key, model, "v1", GOOD, per_interval - canary_count, rng, now)
        window += serve(key, model, "v2", canary_profile, canary_count, rng, now)
        if minimum_reached_at is None and len(window) >= canary.min_samples:
            minimum_reached_at = sorted(window)[canary.min_samples - 1]
        now += timedelta(seconds=INTERVAL)
        decisions += canary_tick(load_samples=served_requests, now=now)
    canary.refresh_from_db()
    return Run(canary, decisions, minimum_reached_at)


class TestController:
    def test_a_canary_failing_10_percent_is_rolled_back_within_two_intervals(self, api_key):
        model = deployed_model()
        result = run(api_key, model, canary_profile=Profile(fail=0.10), seed=1)
        assert result.canary.status == "rolled_back"
        assert [d.verdict for d in result.decisions] == ["hold", "hold", "rollback"]  # 20 canary requests an interval
        rollback = result.decisions[-1]
        assert result.minimum_reached_at is not None
        assert rollback.at - result.minimum_reached_at <= timedelta(seconds=2 * INTERVAL)
        assert rollback.figures["tests"]["error_rate"]["worse"]
        assert rollback.figures["arms"]["canary"]["n"] == 60
        assert weights(model) == {"v1": 100, "v2": 0}

    def test_a_canary_3x_slower_is_rolled_back_within_two_intervals(self, api_key):
        model = deployed_model()
        result = run(api_key, model, canary_profile=Profile(slow=3.0), seed=2)
        assert result.canary.status == "rolled_back"
        rollback = result.decisions[-1]
        assert rollback.verdict == "rollback"
        assert result.minimum_reached_at is not None
        assert rollback.at - result.minimum_reached_at <= timedelta(seconds=2 * INTERVAL)
        assert {"latency_ms", "ttft_ms", "tpot_ms"} <= {
            name for name, test in rollback.figures["tests"].items() if test["worse"]
        }
        assert weights(model) == {"v1": 100, "v2": 0}

    def test_a_good_canary_goes_step_by_step_to_100_and_is_promoted(self, api_key):
        model = deployed_model()
        result = run(api_key, model, canary_profile=Profile(slow=0.9), seed=3, per_interval=1000)
        assert [d.verdict for d in result.decisions] == ["promote_step", "promote_step", "promote"]
        assert [d.canary_percent for d in result.decisions] == [5, 25, 50]
        assert result.canary.status == "promoted"
        assert weights(model) == {"v1": 0, "v2": 100}
        first = result.decisions[0].figures
        assert first["arms"]["canary"]["n"] == 50
        assert first["arms"]["base"]["n"] == 950
        # Each step's window starts with the step: the second decision saw only 25 % traffic.
        assert result.decisions[1].figures["arms"]["canary"]["n"] == 250
        actions = list(AuditEntry.objects.filter(target=model.name).values_list("action", flat=True))
        assert actions.count("canary.promote_step") == 2
        assert "canary.promote" in actions
        assert actions.count("traffic.set") == 4  # the start, two steps, the promotion
        on_its_own = AuditEntry.objects.filter(target=model.name, action="traffic.set", actor_name="canary controller")
        assert on_its_own.count() == 3  # the two steps and the promotion (auto_promote): the controller's

    def test_without_auto_promote_it_stops_at_100_and_waits_for_a_person(self, api_key):
        model = deployed_model()
        result = run(api_key, model, canary_profile=GOOD, seed=4, per_interval=1000, auto_promote=False)
        assert result.canary.status == "completed"
        assert [d.verdict for d in result.decisions] == ["promote_step", "promote_step", "promote_step"]
        assert weights(model) == {"v1": 0, "v2": 100}
        assert result.canary.canary_percent == 100
        assert canary_tick(load_samples=served_requests, now=timezone.now() + timedelta(days=1)) == []

    def test_last_step_below_100_completes_there(self, api_key):
        model = deployed_model()
        result = run(api_key, model, canary_profile=GOOD, seed=5, per_interval=1000, auto_promote=False, steps=[10, 50])
        assert result.canary.status == "completed"
        assert [d.verdict for d in result.decisions] == ["promote_step", "hold"]
        assert weights(model) == {"v1": 50, "v2": 50}

    def test_an_a_a_canary_is_never_rolled_back_in_20_seeded_runs(self, api_key):
        outcomes = []
        for seed in range(20):
            model = deployed_model()
            result = run(api_key, model, canary_profile=GOOD, seed=100 + seed, per_interval=1000)
            outcomes.append(result.canary.status)
            assert all(d.verdict != "rollback" for d in result.decisions), (seed, result.decisions[-1].reasons)
        assert outcomes == ["promoted"] * 20

    def test_it_holds_until_the_minimum_sample_and_the_window_keeps_growing(self, api_key):
        model = deployed_model()
        result = run(api_key, model, canary_profile=GOOD, seed=6, per_interval=200, intervals=3)
        # 10 canary requests an interval: 10, 20, 30 < 50, so three holds, each over a growing window.
        assert [d.verdict for d in result.decisions] == ["hold", "hold", "hold"]
        assert [d.figures["arms"]["canary"]["n"] for d in result.decisions] == [10, 20, 30]
        assert "canary has 30 of 50 requests" in result.decisions[-1].reasons[0]
        assert result.canary.status == "running"
        assert result.canary.current_step == 0

    def test_cache_hits_say_nothing_about_a_version(self, api_key):
        model = deployed_model()
        now = timezone.now()
        canary = canary_create(
            actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL, now=now
        )
        rng = random.Random(7)
        serve(api_key, model, "v1", GOOD, 100, rng, now)
        serve(api_key, model, "v2", GOOD, 100, rng, now)
        UsageRecord.objects.filter(model=model.name, model_version="v2").update(cache=CacheOutcome.SEMANTIC_HIT)
        assert served_requests(model=model.name, version="v2", since=now) == []
        decision = canary_decide(canary_id=canary.pk, load_samples=served_requests, now=now + timedelta(minutes=1))
        assert decision is not None
        assert decision.verdict == "hold"
        assert decision.figures["arms"]["canary"]["n"] == 0

    def test_a_clients_cancel_is_in_neither_side_of_the_failure_rate(self, api_key):
        """Issue 34, defect 12: the canary answered 90 requests and failed 10 (10 %); its clients
        cancelled 900 more. Counted in the denominator, the cancels made that 1 % and a pass."""
        model = deployed_model()
        now = timezone.now()
        canary = canary_create(
            actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL,
            success_criteria={"min_success_rate": 0.95}, min_samples=50, now=now,
        )  # fmt: skip
        rng = random.Random(11)
        serve(api_key, model, "v1", GOOD, 400, rng, now)
        serve(api_key, model, "v2", Profile(fail=0.0), 90, rng, now)
        serve(api_key, model, "v2", Profile(fail=1.0), 10, rng, now)
        serve(api_key, model, "v2", Profile(cancelled=1.0), 900, rng, now)
        assert UsageRecord.objects.filter(model=model.name, model_version="v2", status_code=499).count() == 900
        decision = canary_decide(canary_id=canary.pk, load_samples=served_requests, now=now + timedelta(minutes=1))
        assert decision is not None
        arm = decision.figures["arms"]["canary"]
        assert (arm["n"], arm["errors"], arm.get("cancelled")) == (100, 10, 900)
        assert arm["error_rate"] == pytest.approx(0.10)
        assert decision.figures["tests"]["error_rate"]["n_canary"] == 100
        assert decision.verdict == "rollback"
        assert any("min_success_rate" in reason for reason in decision.reasons)

    def test_cancels_do_not_make_up_the_minimum_sample(self, api_key):
        """A canary whose clients cancelled 500 requests and that answered 30 has 30 of its 50."""
        model = deployed_model()
        now = timezone.now()
        canary = canary_create(
            actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL,
            min_samples=50, now=now,
        )  # fmt: skip
        rng = random.Random(12)
        serve(api_key, model, "v1", GOOD, 400, rng, now)
        serve(api_key, model, "v2", GOOD, 30, rng, now)
        serve(api_key, model, "v2", Profile(cancelled=1.0), 500, rng, now)
        decision = canary_decide(canary_id=canary.pk, load_samples=served_requests, now=now + timedelta(minutes=1))
        assert decision is not None
        assert decision.verdict == "hold"
        assert "canary has 30 of 50 requests" in decision.reasons[0]

    def test_it_decides_once_per_boundary(self, api_key):
        model = deployed_model()
        now = timezone.now()
        canary = canary_create(
            actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL, now=now
        )
        early = now + timedelta(seconds=INTERVAL - 1)
        assert canary_tick(load_samples=served_requests, now=early) == []
        boundary = now + timedelta(seconds=INTERVAL)
        assert len(canary_tick(load_samples=served_requests, now=boundary)) == 1
        # A second beat at the same moment (overlapping, or a retried task) finds the boundary moved on.
        assert canary_tick(load_samples=served_requests, now=boundary) == []
        assert canary_decide(canary_id=canary.pk, load_samples=served_requests, now=boundary) is None
        canary.refresh_from_db()
        assert canary.next_decision_at == now + timedelta(seconds=2 * INTERVAL)
        # A beat that was away for a while decides once and skips the boundaries it missed.
        late = now + timedelta(seconds=5 * INTERVAL + 7)
        assert len(canary_tick(load_samples=served_requests, now=late)) == 1
        canary.refresh_from_db()
        assert canary.next_decision_at == now + timedelta(seconds=6 * INTERVAL)

    def test_a_paused_canary_is_not_judged_and_resumes_with_a_fresh_window(self, api_key):
        model = deployed_model()
        now = timezone.now()
        canary = canary_create(
            actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL, now=now
        )
        canary_pause(actor=None, canary=canary)
        assert canary_tick(load_samples=served_requests, now=now + timedelta(hours=1)) == []
        later = now + timedelta(hours=1)
        resumed = canary_resume(actor=None, canary=canary, now=later)
        assert resumed.step_started_at == later
        assert resumed.next_decision_at == later + timedelta(seconds=INTERVAL)
        assert weights(model) == {"v1": 95, "v2": 5}
        with pytest.raises(IllegalTransition):
            canary_resume(actor=None, canary=canary)

    def test_one_active_canary_per_model(self, api_key):
        model = deployed_model()
        canary_create(actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL)
        with pytest.raises(CanaryConflict):
            canary_create(actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL)
        canary_rollback(actor=None, canary=Canary.objects.get(model=model))
        again = canary_create(
            actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL
        )
        assert again.status == "running"

    def test_a_version_under_an_active_canary_cannot_be_swapped_away(self, api_key):
        """Defect 10 of issue 18: a swap of the base would leave the canary's rollback unable to
        set {base: 100}, and a canary judged worse would keep its share."""
        from core.errors import InvalidInput
        from rollout.hotswap import deployment_swap_version

        model = deployed_model()
        v3 = ModelVersion.objects.create(
            model=model, version="v3", framework="fake", artifact_uri=f"local://{model.name}/v3",
            artifact_sha256="0" * 64, artifact_size=1, status="active",
        )  # fmt: skip
        canary = canary_create(
            actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL
        )
        for version in ("v1", "v2"):
            deployment = Deployment.objects.get(version__model=model, version__version=version)
            with pytest.raises(InvalidInput, match="canary"):
                deployment_swap_version(actor=None, deployment=deployment, version=v3)
        canary_rollback(actor=None, canary=canary)
        assert weights(model) == {"v1": 100, "v2": 0}
        base = Deployment.objects.get(version__model=model, version__version="v1")
        assert deployment_swap_version(actor=None, deployment=base, version=v3).version == v3  # free again

    def test_a_rollback_announces_the_new_split_to_every_gateway(self, api_key, django_capture_on_commit_callbacks):
        from core import keys
        from core.redis import sync_redis

        model = deployed_model()
        now = timezone.now()
        canary = canary_create(
            actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL, now=now
        )
        rng = random.Random(8)
        serve(api_key, model, "v1", GOOD, 200, rng, now)
        serve(api_key, model, "v2", Profile(fail=0.5), 60, rng, now)
        pubsub = sync_redis().pubsub()
        pubsub.subscribe(keys.routing_invalidation_channel())
        try:
            with django_capture_on_commit_callbacks(execute=True):
                decision = canary_decide(
                    canary_id=canary.pk, load_samples=served_requests, now=now + timedelta(seconds=INTERVAL)
                )
            assert decision is not None
            assert decision.verdict == "rollback"
            messages = []
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not any(m["type"] == "message" for m in messages):
                message = pubsub.get_message(timeout=0.5)
                if message:
                    messages.append(message)
            assert any(m["type"] == "message" and m["data"] in (b"traffic", "traffic") for m in messages)
        finally:
            pubsub.close()
        assert weights(model) == {"v1": 100, "v2": 0}

    def test_a_version_no_longer_deployed_holds_instead_of_half_moving(self, api_key):
        model = deployed_model()
        now = timezone.now()
        canary = canary_create(
            actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL, now=now
        )
        rng = random.Random(9)
        serve(api_key, model, "v1", GOOD, 950, rng, now)
        serve(api_key, model, "v2", GOOD, 50, rng, now)
        Deployment.objects.filter(version__model=model, version__version="v2").update(status="stopped")
        decision = canary_decide(canary_id=canary.pk, load_samples=served_requests, now=now + timedelta(seconds=60))
        assert decision is not None
        assert decision.verdict == "hold"
        assert "could not be set" in decision.reasons[-1]
        canary.refresh_from_db()
        assert (canary.status, canary.current_step) == ("running", 0)


# --- The API ------------------------------------------------------------------------------


@pytest.fixture
def people(alice_org) -> dict[str, Any]:
    users = get_user_model().objects
    ml, alice = (users.create_user(username=name, password="pw-1234567890") for name in ("ml", "alice"))
    membership_set(user=ml, organization=platform_organization(), role=Role.PLATFORM_ADMIN)
    membership_set(user=alice, organization=alice_org, role=Role.ORG_ADMIN)
    return {"ml": ml, "alice": alice}


@pytest.fixture
def ml(people) -> APIClient:
    client = APIClient()
    client.force_authenticate(people["ml"])
    return client


def body(**overrides: Any) -> dict[str, Any]:
    return {
        "base_version": "v1",
        "canary_version": "v2",
        "steps": [5, 25, 50, 100],
        "interval_seconds": 300,
        "success_criteria": {"max_p99_latency_ms": 5000, "min_success_rate": 0.99},
        "auto_promote": True,
        **overrides,
    }


class TestApi:
    def test_it_starts_a_canary(self, ml):
        model = deployed_model("gpt-canary")
        response = ml.post("/api/v1/models/gpt-canary/canary", body(), format="json")
        assert response.status_code == 201, response.content
        data = response.json()
        assert (data["status"], data["current_step"], data["canary_percent"]) == ("running", 0, 5)
        assert data["weights"] == {"v1": 95, "v2": 5}
        assert data["steps"] == [5, 25, 50, 100]
        assert data["success_criteria"] == {"max_p99_latency_ms": 5000.0, "min_success_rate": 0.99}
        assert (data["min_samples"], data["auto_promote"], data["created_by"]) == (50, True, "ml")
        assert data["decisions"] == []
        assert weights(model) == {"v1": 95, "v2": 5}
        entry = AuditEntry.objects.get(action="canary.create")
        assert (entry.actor_name, entry.target, entry.after["canary_version"]) == ("ml", "gpt-canary", "v2")

    def test_canary_percentage_is_the_first_step_when_steps_are_omitted(self, ml):
        deployed_model("gpt-canary")
        payload = body(canary_percentage=10)
        del payload["steps"]
        response = ml.post("/api/v1/models/gpt-canary/canary", payload, format="json")
        assert response.status_code == 201, response.content
        assert response.json()["steps"] == [10, 25, 50, 100]
        assert response.json()["weights"] == {"v1": 90, "v2": 10}

    @pytest.mark.parametrize(
        ("overrides", "field"),
        [
            ({"steps": [25, 5]}, "steps"),
            ({"steps": []}, "steps"),
            ({"steps": [100]}, "steps"),
            ({"steps": [5, 101]}, "steps"),
            ({"steps": ["a"]}, "steps"),
            ({"canary_percentage": 10}, "canary_percentage"),
            ({"interval_seconds": 0}, "interval_seconds"),
            ({"interval_seconds": "soon"}, "interval_seconds"),
            ({"min_samples": 0}, "min_samples"),
            ({"success_criteria": {"min_success_rate": 1.5}}, "success_criteria"),
            ({"success_criteria": {"max_p50": 3}}, "success_criteria"),
            ({"success_criteria": {"max_p99_latency_ms": "fast"}}, "success_criteria"),
            ({"canary_version": "v1"}, "canary_version"),
            ({"canary_version": "v9"}, "canary_version"),
            ({"base_version": "v0"}, "base_version"),
            ({"base_version": None}, "base_version"),
        ],
    )
    def test_bad_input_is_a_400_naming_the_field(self, ml, overrides, field):
        model = deployed_model("gpt-canary")
        response = ml.post("/api/v1/models/gpt-canary/canary", body(**overrides), format="json")
        assert response.status_code == 400, response.content
        assert field in response.json(), response.json()
        assert not Canary.objects.exists()
        assert weights(model) == {"v1": 100, "v2": 0}

    def test_the_same_version_on_both_sides_is_a_400_saying_so(self, ml):
        deployed_model("gpt-canary")
        response = ml.post("/api/v1/models/gpt-canary/canary", body(canary_version="v1"), format="json")
        assert response.status_code == 400
        assert response.json()["canary_version"] == ["Must be another version than base_version: 'v1' is both."]

    def test_an_undeployed_version_is_a_400(self, ml):
        model = deployed_model("gpt-canary")
        Deployment.objects.filter(version__model=model, version__version="v2").update(status="stopped")
        response = ml.post("/api/v1/models/gpt-canary/canary", body(), format="json")
        assert response.status_code == 400
        assert "no pending or running deployment" in response.json()["canary_version"][0]

    def test_a_second_active_canary_is_a_409(self, ml):
        deployed_model("gpt-canary")
        assert ml.post("/api/v1/models/gpt-canary/canary", body(), format="json").status_code == 201
        response = ml.post("/api/v1/models/gpt-canary/canary", body(), format="json")
        assert response.status_code == 409
        assert "active canary" in response.json()["detail"]

    def test_only_platform_admins(self, people):
        deployed_model("gpt-canary")
        for user in (people["alice"], None):
            client = APIClient()
            if user is not None:
                client.force_authenticate(user)
            assert client.post("/api/v1/models/gpt-canary/canary", body(), format="json").status_code in (401, 403)
            assert client.get("/api/v1/models/gpt-canary/canary").status_code in (401, 403)
            assert client.post("/api/v1/models/gpt-canary/canary/rollback").status_code in (401, 403)
        assert not Canary.objects.exists()

    def test_unknown_model_or_no_canary_is_a_404(self, ml):
        assert ml.get("/api/v1/models/nothing/canary").status_code == 404
        deployed_model("gpt-canary")
        assert ml.get("/api/v1/models/gpt-canary/canary").status_code == 404
        assert ml.post("/api/v1/models/gpt-canary/canary/pause").status_code == 404

    def test_pause_resume_promote(self, ml):
        model = deployed_model("gpt-canary")
        ml.post("/api/v1/models/gpt-canary/canary", body(), format="json")
        paused = ml.post("/api/v1/models/gpt-canary/canary/pause")
        assert (paused.status_code, paused.json()["status"]) == (200, "paused")
        assert ml.post("/api/v1/models/gpt-canary/canary/pause").status_code == 409
        resumed = ml.post("/api/v1/models/gpt-canary/canary/resume")
        assert (resumed.status_code, resumed.json()["status"]) == (200, "running")
        promoted = ml.post("/api/v1/models/gpt-canary/canary/promote")
        assert promoted.status_code == 200
        data = promoted.json()
        assert (data["status"], data["weights"]) == ("promoted", {"v1": 0, "v2": 100})
        [decision] = data["decisions"]
        assert (decision["verdict"], decision["actor"], decision["reasons"]) == ("promote", "ml", ["promoted by ml"])
        assert weights(model) == {"v1": 0, "v2": 100}
        # Nothing is active any more; GET still shows the last one.
        assert ml.post("/api/v1/models/gpt-canary/canary/rollback").status_code == 404
        assert ml.get("/api/v1/models/gpt-canary/canary").json()["status"] == "promoted"
        actions = set(AuditEntry.objects.filter(actor_name="ml").values_list("action", flat=True))
        assert {"canary.create", "canary.pause", "canary.resume", "canary.promote", "traffic.set"} <= actions

    def test_rollback_sets_the_canary_to_0_at_once(self, ml):
        model = deployed_model("gpt-canary")
        ml.post("/api/v1/models/gpt-canary/canary", body(), format="json")
        response = ml.post("/api/v1/models/gpt-canary/canary/rollback")
        assert response.status_code == 200
        assert (response.json()["status"], response.json()["weights"]) == ("rolled_back", {"v1": 100, "v2": 0})
        assert weights(model) == {"v1": 100, "v2": 0}
        assert AuditEntry.objects.filter(action="canary.rollback", actor_name="ml").exists()
        assert ml.post("/api/v1/models/gpt-canary/canary/nonsense").status_code == 404

    def test_get_shows_every_decision_with_its_figures(self, ml, api_key):
        model = deployed_model("gpt-canary")
        ml.post("/api/v1/models/gpt-canary/canary", body(interval_seconds=INTERVAL), format="json")
        canary = Canary.objects.get(model=model)
        rng = random.Random(10)
        serve(api_key, model, "v1", GOOD, 950, rng, canary.step_started_at)
        serve(api_key, model, "v2", Profile(slow=3.0), 50, rng, canary.step_started_at)
        canary_tick(load_samples=served_requests, now=canary.step_started_at + timedelta(seconds=INTERVAL))
        data = ml.get("/api/v1/models/gpt-canary/canary").json()
        assert data["status"] == "rolled_back"
        [decision] = data["decisions"]
        assert decision["verdict"] == "rollback"
        assert decision["actor"] is None
        figures = decision["figures"]
        assert figures["arms"]["canary"]["n"] == 50
        assert figures["arms"]["base"]["n"] == 950
        assert {"p50", "p99"} <= figures["arms"]["canary"]["latency_ms"].keys()
        latency = figures["tests"]["latency_ms"]
        assert latency["test"] == "mann_whitney_u"
        assert latency["worse"]
        assert latency["n_canary"] == 50
        assert {"statistic", "p_value", "p_adjusted", "effect"} <= latency.keys()


class TestAdmin:
    def test_canaries_are_shown_read_only(self, client, api_key):
        model = deployed_model()
        canary = canary_create(
            actor=None, model=model, base_version="v1", canary_version="v2", interval_seconds=INTERVAL
        )
        canary_rollback(actor=None, canary=canary)
        admin = get_user_model().objects.create_superuser(username="root", password="pw-1234567890")
        client.force_login(admin)
        assert client.get("/admin/rollout/canary/").status_code == 200
        page = client.get(f"/admin/rollout/canary/{canary.pk}/change/")
        assert page.status_code == 200
        assert b"rolled back by the operator" in page.content
        assert b'name="_save"' not in page.content
