"""The semantic cache's error budget and feedback: a tier is served only while its measured
wrong-hit rate stays inside the budget (a simulation with a noisy verifier and a noisy judge),
feedback tightens an entry and its neighbours at once and is counted, per organisation."""

from __future__ import annotations

import asyncio
import importlib
import sys
import uuid
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest
from django.utils import timezone

from accounts.services import organization_create
from serving.models import EMBEDDING_DIMENSIONS, CacheEntry, CacheFeedback
from serving.semcache import budget, feedback
from serving.semcache.budget import AUDIT, SERVE, Prior, TierRecord, agree_by_text, decide, estimate
from serving.semcache.feedback import NotServedFromCache, Served, parse_request_id, report

PRIOR = Prior(n=585, wrong=1)  # the held-out measurement the settings carry


class TestEstimate:
    def test_the_prior_alone_opens_a_tier_at_one_percent_but_not_at_half_a_percent(self):
        assert estimate(TierRecord(), PRIOR).high < 0.01
        assert decide(TierRecord(), budget=0.01, prior=PRIOR, audit_rate=0, draw=0.5) == SERVE
        assert decide(TierRecord(), budget=0.005, prior=PRIOR, audit_rate=0, draw=0.5) == AUDIT

    def test_disagreements_and_reports_close_a_tier(self):
        assert decide(TierRecord(audits=100, disagreed=3), budget=0.01, prior=PRIOR, audit_rate=0, draw=0.5) == AUDIT
        assert decide(TierRecord(reported=3), budget=0.01, prior=PRIOR, audit_rate=0, draw=0.5) == AUDIT
        # many agreeing audits open it again
        assert decide(TierRecord(audits=3000, disagreed=3), budget=0.01, prior=PRIOR, audit_rate=0, draw=0.5) == SERVE

    def test_an_open_tier_is_audited_at_the_audit_rate(self):
        assert decide(TierRecord(), budget=0.01, prior=PRIOR, audit_rate=0.02, draw=0.01) == AUDIT
        assert decide(TierRecord(), budget=0.01, prior=PRIOR, audit_rate=0.02, draw=0.03) == SERVE

    def test_answers_agree_by_text_or_disagree_by_numbers(self):
        assert agree_by_text("Paris is the capital.", "  paris is the  CAPITAL.") is True
        assert agree_by_text("It takes 5 days.", "It takes 7 days.") is False
        assert agree_by_text("Open the settings.", "Go to settings.") is None  # meaning decides


def simulate(*, use_budget: bool, seed: int = 22, n: int = 60_000) -> dict[str, tuple[int, int, int]]:
    """bench/semantic_cache_budget.py's simulation: would-be hits of three tiers whose
    verifier is wrong at different, drifting rates, a noisy judge, some reports."""
    bench = str(Path(__file__).resolve().parents[2] / "bench")
    sys.path.insert(0, bench)
    try:
        module = importlib.import_module("semantic_cache_budget")
    finally:
        sys.path.remove(bench)
    return module.simulate(use_budget=use_budget, seed=seed, n=n)


class TestTheBudgetUnderNoise:
    def test_without_a_budget_the_noisy_verifier_would_break_it(self):
        result = simulate(use_budget=False)
        served, wrong = sum(r[1] for r in result.values()), sum(r[2] for r in result.values())
        assert wrong / served > 0.02

    def test_the_budget_holds_and_only_the_bad_tiers_close(self):
        result = simulate(use_budget=True)
        served, wrong = sum(r[1] for r in result.values()), sum(r[2] for r in result.values())
        assert wrong / served <= 0.01
        same, typo, reordered = result["same"], result["typo"], result["reordered"]
        assert same[1] / same[0] >= 0.9  # the good tier keeps serving
        assert reordered[1] / reordered[0] <= 0.05  # the bad one closes early
        assert typo[2] / max(typo[1], 1) <= 0.02  # the drifting one closes after the drift

    @pytest.mark.parametrize("seed", [1, 2, 3])
    def test_it_holds_for_other_draws(self, seed):
        result = simulate(use_budget=True, seed=seed, n=30_000)
        served, wrong = sum(r[1] for r in result.values()), sum(r[2] for r in result.values())
        assert wrong / served <= 0.01


# --- Feedback on the real PostgreSQL + Redis --------------------------------------------------


def vector(seed: int, near: list[float] | None = None, noise: float = 0.0) -> list[float]:
    rng = np.random.default_rng(seed)
    base = np.asarray(near) if near is not None else rng.standard_normal(EMBEDDING_DIMENSIONS)
    v = base + noise * rng.standard_normal(EMBEDDING_DIMENSIONS)
    return [float(x) for x in v / np.linalg.norm(v)]


@pytest.fixture
def scene(db):
    alice, bob = organization_create(name="Alice Feedback"), organization_create(name="Bob Feedback")
    model, scope = f"fb-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex + uuid.uuid4().hex
    expires = timezone.now() + timedelta(hours=1)

    def entry(embedding: list[float], prompt: str, scope: str = scope) -> CacheEntry:
        return CacheEntry.objects.create(
            scope=scope, organization=alice, model=model, model_version="1", embedding=embedding, prompt=prompt,
            response={"message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"},
            prompt_tokens=7, completion_tokens=2, expires_at=expires,
        )  # fmt: skip

    served_vector = vector(1)
    served = entry(served_vector, "What is the capital of France?")
    neighbour = entry(vector(2, near=served_vector, noise=0.01), "what is the capital of france please")
    far = entry(vector(3), "How do I bake bread?")
    elsewhere = entry(served_vector, "What is the capital of France?", scope=uuid.uuid4().hex * 2)
    yield alice, bob, model, scope, served, neighbour, far, elsewhere
    budget.reset(model)


def serve(request_id: uuid.UUID, *, alice, model, scope, entry, wording="typo") -> None:
    asyncio.run(feedback.note_served(request_id, Served(
        organization_id=alice.pk, model=model, model_version="1", entry_id=entry.pk, wording=wording, scope=scope,
    )))  # fmt: skip


class TestFeedback:
    def test_a_report_tightens_the_entry_and_its_neighbours_at_once_and_counts(self, scene):
        alice, _, model, scope, served, neighbour, far, elsewhere = scene
        request_id = uuid.uuid4()
        serve(request_id, alice=alice, model=model, scope=scope, entry=served, wording="typo")
        assert budget.records_sync(model)["typo"].served == 1
        made = report(request_id, organization_id=alice.pk, reported_by="key sk-abc", reason="wrong city")
        assert made.tightened == 2
        for row, strictness in ((served, 1), (neighbour, 1), (far, 0), (elsewhere, 0)):
            row.refresh_from_db()
            assert row.strictness == strictness, row.prompt
        assert budget.records_sync(model)["typo"].reported == 1
        assert CacheFeedback.objects.get(request_id=request_id.hex).reason == "wrong city"

    def test_a_report_on_the_same_words_keeps_them_to_the_same_text(self, scene):
        alice, _, model, scope, served, *_ = scene
        request_id = uuid.uuid4()
        serve(request_id, alice=alice, model=model, scope=scope, entry=served, wording="same")
        report(request_id, organization_id=alice.pk, reported_by="admin")
        served.refresh_from_db()
        assert served.strictness == 2

    def test_a_report_on_the_same_text_withdraws_the_entry(self, scene):
        alice, _, model, scope, served, *_ = scene
        request_id = uuid.uuid4()
        serve(request_id, alice=alice, model=model, scope=scope, entry=served, wording=budget.EXACT)
        report(request_id, organization_id=alice.pk, reported_by="admin")
        served.refresh_from_db()
        assert served.expires_at <= timezone.now()

    def test_a_second_report_changes_nothing(self, scene):
        alice, _, model, scope, served, *_ = scene
        request_id = uuid.uuid4()
        serve(request_id, alice=alice, model=model, scope=scope, entry=served)
        first = report(request_id, organization_id=alice.pk, reported_by="key a")
        second = report(request_id, organization_id=alice.pk, reported_by="key b")
        assert first.pk == second.pk
        assert budget.records_sync(model)["typo"].reported == 1

    def test_another_organisation_cannot_report_it_and_unknown_requests_are_refused(self, scene):
        alice, bob, model, scope, served, *_ = scene
        request_id = uuid.uuid4()
        serve(request_id, alice=alice, model=model, scope=scope, entry=served)
        with pytest.raises(NotServedFromCache):
            report(request_id, organization_id=bob.pk, reported_by="key bob")
        with pytest.raises(NotServedFromCache):
            report(uuid.uuid4(), organization_id=alice.pk, reported_by="key a")
        served.refresh_from_db()
        assert served.strictness == 0
        report(request_id, organization_id=None, reported_by="platform admin")  # an admin may

    def test_request_ids_as_the_platform_shows_them(self):
        rid = uuid.uuid4()
        assert parse_request_id(str(rid)) == rid
        assert parse_request_id(f"chatcmpl-{rid.hex}") == rid
        assert parse_request_id(rid.hex.upper()) == rid
        assert parse_request_id("chatcmpl-xyz") is None
        assert parse_request_id("") is None


class TestPurgeAfterFeedback:
    def test_a_reported_entry_is_purged_when_it_expires_and_the_report_stays(self, scene):
        from serving.semcache import store

        alice, _, model, scope, served, *_ = scene
        request_id = uuid.uuid4()
        serve(request_id, alice=alice, model=model, scope=scope, entry=served, wording=budget.EXACT)
        report(request_id, organization_id=alice.pk, reported_by="admin")  # withdrawn: expired now
        store.purge_expired(now=timezone.now() + timedelta(seconds=1))
        assert not CacheEntry.objects.filter(pk=served.pk).exists()
        assert CacheFeedback.objects.get(request_id=request_id.hex).entry_id == served.pk


class TestOrganisationBudget:
    def test_an_org_admin_sets_it_and_the_grant_carries_it(self, db):
        from django.contrib.auth import get_user_model
        from django.core.exceptions import PermissionDenied

        from accounts.grants import KeyGrant
        from accounts.models import Membership, Role
        from accounts.services import api_key_create, organization_update
        from core.errors import InvalidInput

        org = organization_create(name="Budget Org")
        users = get_user_model().objects
        admin, member = users.create_user(username="budget-admin"), users.create_user(username="budget-member")
        Membership.objects.create(user=admin, organization=org, role=Role.ORG_ADMIN)
        Membership.objects.create(user=member, organization=org, role=Role.ORG_MEMBER)
        key = api_key_create(organization=org, name="k").api_key
        assert KeyGrant.of(key).cache_wrong_hit_budget is None
        organization_update(organization=org, actor=admin, cache_wrong_hit_budget="0.5")
        org.refresh_from_db()
        assert org.cache_wrong_hit_budget == Decimal("0.50")
        key.refresh_from_db()
        assert KeyGrant.of(key).cache_wrong_hit_budget == pytest.approx(0.005)
        with pytest.raises(PermissionDenied):
            organization_update(organization=org, actor=member, cache_wrong_hit_budget="2")
        with pytest.raises(PermissionDenied):  # the plan stays the platform admins'
            organization_update(organization=org, actor=admin, cache_wrong_hit_budget="2", tier="free")
        for bad in ("101", "-1", "0.123", "abc"):
            with pytest.raises(InvalidInput):
                organization_update(organization=org, actor=admin, cache_wrong_hit_budget=bad)
        organization_update(organization=org, actor=admin, cache_wrong_hit_budget="")
        org.refresh_from_db()
        assert org.cache_wrong_hit_budget is None
