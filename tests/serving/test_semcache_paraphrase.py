"""The paraphrase tier on the real PostgreSQL + pgvector and Redis, with a stand-in for the
learned verifier (its scores are the test's to choose; the real model's refusals are tested
in test_semcache_paraphrase_model.py): what is served, what is refused, each entry's own
threshold moving with its evidence, feedback, and tenant scopes."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from django.db import connections
from django.utils import timezone

from serving.gateway.routing import CacheRules
from serving.models import EMBEDDING_DIMENSIONS, CacheEntry
from serving.semcache import bound, budget, feedback, lookup, paraphrase, signature, store
from serving.semcache.policy import CacheIntent

QUESTION = "What is the capital of France?"
PARAPHRASE = "Tell me France's capital city"
ANSWER = "The capital of France is Paris."
# A calibration whose traps-served share is 5 % below 0.8 and 0.2 % from 0.8 up: with no
# evidence an entry's threshold is 0.8 at δ = 1 %.
CURVE = bound.curve_from([(0.3, 0.2), (0.6, 0.05), (0.8, 0.002)])


def vector(seed: int, *, near: list[float] | None = None, similarity: float = 0.9) -> list[float]:
    """A unit vector; with ``near``, one whose cosine to ``near`` is ``similarity``."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(EMBEDDING_DIMENSIONS)
    if near is not None:
        base = np.asarray(near)
        v -= v.dot(base) * base
        v = similarity * base + np.sqrt(1 - similarity**2) * v / np.linalg.norm(v)
    return [float(x) for x in v / np.linalg.norm(v)]


class FakeLocal(paraphrase.LocalModels):
    """Vectors and scores chosen by the test; counts its calls."""

    def __init__(self) -> None:
        self.vectors: dict[str, list[float]] = {}
        self.scores: dict[tuple[str, str], float] = {}
        self.scored: list[tuple[str, str]] = []
        self.embedded: list[str] = []
        self.embedding_started = threading.Event()

    def embed(self, texts: list[str]) -> list[list[float]]:
        self.embedded.extend(texts)
        self.embedding_started.set()
        return [self.vectors.setdefault(t, vector(abs(hash(t)) % 10_000)) for t in texts]

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        self.scored.extend(pairs)
        return [self.scores.get(pair, 0.0) for pair in pairs]

    def threshold_for(self, delta: float) -> float:
        return bound.threshold((), curve=CURVE, delta=delta, prior_weight=20)

    def curve(self) -> Callable[[float], float]:
        return CURVE


@pytest.fixture
def local(monkeypatch) -> FakeLocal:
    fake = FakeLocal()
    monkeypatch.setattr(paraphrase, "ready", lambda: fake)
    return fake


@pytest.fixture
def quiet(settings) -> None:
    """No random audits or exploration: what is served is the rule's alone."""
    settings.SEMANTIC_CACHE_AUDIT_RATE = 0.0
    settings.SEMANTIC_CACHE_PARAPHRASE_EXPLORE_RATE = 0.0
    settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_WEIGHT = 20
    # The tier's own error budget open (the default prior, 2 wrong of 71, keeps it closed at 1 %).
    settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_SERVED, settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_WRONG = 5000, 1


class Cache:
    """Entries of this test's own model, committed at once (outside a test transaction) from
    a thread of their own, deleted afterwards."""

    def __init__(self) -> None:
        self.model = f"paraphrase-test-{uuid.uuid4().hex[:8]}"
        self.thread = ThreadPoolExecutor(max_workers=1)

    def add(self, scope: str, embedding: list[float], *, prompt: str = QUESTION, answer: str = ANSWER,
            organization_id: int | None = None, signed: bool = False) -> int:  # fmt: skip
        """``signed``: with its word signatures, so the word tiers find it too."""

        def create() -> int:
            return CacheEntry.objects.create(
                signatures=signature.of_entry(scope, prompt) if signed else [],
                scope=scope, embedding=embedding, expires_at=timezone.now() + timedelta(hours=1), model=self.model,
                model_version="1", prompt=prompt, organization_id=organization_id, prompt_tokens=7, completion_tokens=8,
                response={"message": {"role": "assistant", "content": answer}, "finish_reason": "stop"},
            ).pk  # fmt: skip

        return self.thread.submit(create).result()

    def entry(self, entry_id: int) -> CacheEntry:
        return self.thread.submit(lambda: CacheEntry.objects.get(pk=entry_id)).result()

    def run(self, fn: Callable[[], Any]) -> Any:
        return self.thread.submit(fn).result()

    def remove(self) -> None:
        self.thread.submit(connections.close_all).result()
        self.thread.shutdown()
        CacheEntry.objects.filter(model=self.model).delete()
        budget.reset(self.model)


@pytest.fixture
def cache(django_db_setup: None, django_db_blocker: Any) -> Iterator[Cache]:
    with django_db_blocker.unblock():
        store.guard.reopen()
        made = Cache()
        try:
            yield made
        finally:
            made.remove()


def new_scope() -> str:
    return uuid.uuid4().hex + uuid.uuid4().hex


def probe_for(cache: Cache, scope: str, query: str, *, paraphrases: bool = True) -> lookup.CacheProbe:
    return lookup.CacheProbe(intent=CacheIntent(read=True, write=False), scope=scope, query=query, model=cache.model,
                             wrong_hit_budget=0.01, paraphrases=paraphrases)  # fmt: skip


async def settle() -> None:
    """Let the background writes (hit counts, observations) finish."""
    for _ in range(100):
        if not len(lookup._background):
            return
        await asyncio.sleep(0.02)


# --- The rule ------------------------------------------------------------------------------


class TestEntryBound:
    def test_with_no_evidence_the_calibrated_threshold_holds(self):
        assert bound.threshold((), curve=CURVE, delta=0.01, prior_weight=20) == 0.8
        # A looser bound accepts the looser part of the calibration.
        assert bound.threshold((), curve=CURVE, delta=0.06, prior_weight=20) == 0.6

    def test_one_disagreement_moves_the_threshold_above_its_score(self):
        evidence = [bound.Observation(0.9, agreed=False)]
        assert bound.threshold(evidence, curve=CURVE, delta=0.01, prior_weight=20) > 0.9
        evidence = [bound.Observation(0.99, agreed=False)]
        assert bound.threshold(evidence, curve=CURVE, delta=0.01, prior_weight=20) == bound.CLOSED

    def test_agreements_below_the_threshold_lower_it_only_when_there_are_enough(self):
        few = [bound.Observation(0.7, agreed=True)] * 3
        assert bound.threshold(few, curve=CURVE, delta=0.01, prior_weight=20) == 0.8
        many = [bound.Observation(0.7, agreed=True)] * 16
        # (20 x 5 % + 0) / (20 + 16) = 2.8 %: still above 1 %, so not at δ = 1 % …
        assert bound.threshold(many, curve=CURVE, delta=0.01, prior_weight=20) == 0.8
        # … but at δ = 3 % the entry's agreements open 0.70-0.79 to it.
        assert bound.threshold(many, curve=CURVE, delta=0.03, prior_weight=20) == 0.7

    def test_evidence_is_bounded_and_malformed_items_are_skipped(self):
        raw: list[Any] = [[0.5, 1]] * (bound.MAX_EVIDENCE + 4) + [["x", 1], [0.9], "junk"]
        assert len(bound.evidence_of(raw)) == bound.MAX_EVIDENCE

    def test_the_stored_evidence_stays_bounded_oldest_first_out(self, cache):
        entry_id = cache.add(new_scope(), vector(13))
        for i in range(bound.MAX_EVIDENCE + 1):
            cache.run(lambda i=i: store.observe_sync(entry_id=entry_id, score=i / 100, agreed=True))
        cache.run(lambda: store.observe_sync(entry_id=entry_id, score=0.9, agreed=False))
        evidence = cache.entry(entry_id).evidence
        assert len(evidence) == bound.MAX_EVIDENCE
        assert evidence[-1] == [0.9, 0]
        assert evidence[0] == [0.02, 1]  # 0.00 and 0.01 dropped


# --- The tier, end to end below the gateway --------------------------------------------------


class TestParaphraseTier:
    async def test_a_paraphrase_the_verifier_accepts_is_served_at_its_tier(self, cache, local, quiet):
        scope = new_scope()
        local.vectors[PARAPHRASE] = vector(2, near=local.embed([QUESTION])[0], similarity=0.85)
        entry_id = cache.add(scope, local.embed([QUESTION])[0])
        local.scores[(QUESTION, PARAPHRASE)] = 0.93

        hit = await lookup.lookup(probe_for(cache, scope, PARAPHRASE))

        assert hit is not None
        assert (hit.outcome, hit.wording, hit.entry_id) == (lookup.SEMANTIC_HIT, budget.PARAPHRASE, entry_id)
        assert hit.score == pytest.approx(0.93)
        assert hit.similarity == pytest.approx(0.85, abs=1e-3)
        assert hit.answer["message"]["content"] == ANSWER

    async def test_a_pair_the_verifier_refuses_is_a_miss_compared_for_free(self, cache, local, quiet):
        scope = new_scope()
        trap = "What is the capital of Germany?"
        local.vectors[trap] = vector(3, near=local.embed([QUESTION])[0], similarity=0.9)
        entry_id = cache.add(scope, local.embed([QUESTION])[0])
        local.scores[(QUESTION, trap)] = 0.65  # below 0.8, inside the near-miss band

        probe = probe_for(cache, scope, trap)
        assert await lookup.lookup(probe) is None
        # The engine answers it anyway: its answer becomes the entry's evidence, not the tier's audit.
        assert probe.audit is not None
        assert (probe.audit.entry_id, probe.audit.counted, probe.audit.score) == (entry_id, False, 0.65)

    async def test_the_paraphrase_tier_is_off_when_the_model_says_so(self, cache, local, quiet):
        scope = new_scope()
        cache.add(scope, local.embed([QUESTION])[0])
        local.vectors[PARAPHRASE] = vector(4, near=local.embed([QUESTION])[0], similarity=0.9)
        local.scores[(QUESTION, PARAPHRASE)] = 0.99
        assert await lookup.lookup(probe_for(cache, scope, PARAPHRASE, paraphrases=False)) is None
        assert local.scored == []

    async def test_a_mismatch_raises_the_entrys_threshold(self, cache, local, quiet, settings):
        scope = new_scope()
        local.vectors[PARAPHRASE] = vector(5, near=local.embed([QUESTION])[0], similarity=0.9)
        entry_id = cache.add(scope, local.embed([QUESTION])[0], answer="Bake it for 12 minutes.")
        local.scores[(QUESTION, PARAPHRASE)] = 0.9
        settings.SEMANTIC_CACHE_PARAPHRASE_EXPLORE_RATE = 1.0  # this would-be hit is explored
        settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_SERVED = 5000  # one disagreement leaves the tier open

        probe = probe_for(cache, scope, PARAPHRASE)
        assert await lookup.lookup(probe) is None
        assert probe.audit is not None
        assert probe.audit.counted
        lookup.audit_answer(probe, "Bake it for 25 minutes.")  # the engine's own answer differs
        await settle()

        assert cache.entry(entry_id).evidence == [[0.9, 0]]
        records = await budget.records_of(cache.model)
        assert (records[budget.PARAPHRASE].audits, records[budget.PARAPHRASE].disagreed) == (1, 1)
        settings.SEMANTIC_CACHE_PARAPHRASE_EXPLORE_RATE = 0.0
        assert await lookup.lookup(probe_for(cache, scope, PARAPHRASE)) is None  # 0.9 no longer passes
        local.scores[(QUESTION, PARAPHRASE)] = 0.95
        assert await lookup.lookup(probe_for(cache, scope, PARAPHRASE)) is not None  # above the mismatch

    async def test_an_agreement_is_recorded_as_evidence(self, cache, local, quiet, settings):
        scope = new_scope()
        local.vectors[PARAPHRASE] = vector(6, near=local.embed([QUESTION])[0], similarity=0.9)
        entry_id = cache.add(scope, local.embed([QUESTION])[0])
        local.scores[(QUESTION, PARAPHRASE)] = 0.7
        probe = probe_for(cache, scope, PARAPHRASE)
        assert await lookup.lookup(probe) is None
        lookup.audit_answer(probe, ANSWER.upper())  # the same answer
        await settle()
        assert cache.entry(entry_id).evidence == [[0.7, 1]]
        records = await budget.records_of(cache.model)
        assert budget.PARAPHRASE not in records  # a near miss is not one of the tier's audits

    async def test_the_default_prior_keeps_the_tier_closed_at_one_percent(self, cache, local, settings):
        settings.SEMANTIC_CACHE_PARAPHRASE_EXPLORE_RATE = 0.0
        scope = new_scope()
        local.vectors[PARAPHRASE] = vector(12, near=local.embed([QUESTION])[0], similarity=0.9)
        cache.add(scope, local.embed([QUESTION])[0])
        local.scores[(QUESTION, PARAPHRASE)] = 0.99
        probe = probe_for(cache, scope, PARAPHRASE)
        assert await lookup.lookup(probe) is None  # 2 wrong of 71 offline: not certain of 1 %
        assert probe.audit is not None
        assert probe.audit.counted

    async def test_a_tier_outside_its_budget_is_audited_not_served(self, cache, local, quiet, settings):
        scope = new_scope()
        local.vectors[PARAPHRASE] = vector(7, near=local.embed([QUESTION])[0], similarity=0.9)
        cache.add(scope, local.embed([QUESTION])[0])
        local.scores[(QUESTION, PARAPHRASE)] = 0.95
        settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_WRONG = 300  # 6 % wrong offline: outside 1 %
        probe = probe_for(cache, scope, PARAPHRASE)
        assert await lookup.lookup(probe) is None
        assert probe.audit is not None
        assert probe.audit.counted

    async def test_another_tenants_scope_never_sees_the_entry(self, cache, local, quiet):
        ours, theirs = new_scope(), new_scope()
        local.vectors[PARAPHRASE] = vector(8, near=local.embed([QUESTION])[0], similarity=0.95)
        cache.add(ours, local.embed([QUESTION])[0])
        local.scores[(QUESTION, PARAPHRASE)] = 0.99
        assert await lookup.lookup(probe_for(cache, theirs, PARAPHRASE)) is None
        assert local.scored == []  # nothing of another scope was even judged
        assert await lookup.lookup(probe_for(cache, ours, PARAPHRASE)) is not None

    async def test_feedback_on_a_paraphrase_hit_tightens_the_entry_and_its_neighbours(self, cache, local, quiet):
        from accounts.services import platform_organization

        org = await asyncio.to_thread(lambda: cache.run(lambda: platform_organization().pk))
        scope = new_scope()
        question_vector = local.embed([QUESTION])[0]
        local.vectors[PARAPHRASE] = vector(9, near=question_vector, similarity=0.9)
        entry_id = cache.add(scope, question_vector, organization_id=org)
        neighbour = cache.add(scope, vector(10, near=question_vector, similarity=0.95), prompt="France capital?",
                              organization_id=org)  # fmt: skip
        local.scores[(QUESTION, PARAPHRASE)] = 0.97
        local.scores[("France capital?", PARAPHRASE)] = 0.0
        probe = probe_for(cache, scope, PARAPHRASE)
        hit = await lookup.lookup(probe)
        assert hit is not None
        assert hit.entry_id == entry_id
        request_id = uuid.uuid4()
        served = feedback.Served(organization_id=org, model=cache.model, model_version="1", entry_id=entry_id,
                                 wording=hit.wording, scope=scope, score=hit.score)  # fmt: skip
        await feedback.note_served(request_id, served)

        report = cache.run(lambda: feedback.report(request_id, organization_id=org, reported_by="test"))

        assert report.wording == budget.PARAPHRASE
        assert report.tightened == 2
        assert cache.entry(entry_id).strictness == feedback.SAME_WORDS_ONLY
        assert cache.entry(neighbour).strictness == feedback.SAME_WORDS_ONLY
        assert cache.entry(entry_id).evidence == [[0.97, 0]]
        assert await lookup.lookup(probe_for(cache, scope, PARAPHRASE)) is None
        records = await budget.records_of(cache.model)
        assert records[budget.PARAPHRASE].reported == 1

    async def test_no_local_models_means_no_paraphrase_tier(self, cache, monkeypatch, quiet):
        monkeypatch.setattr(paraphrase, "ready", lambda: None)
        scope = new_scope()
        cache.add(scope, vector(11))
        probe = probe_for(cache, scope, PARAPHRASE)
        probe.intent = CacheIntent(read=True, write=False)
        assert await lookup.lookup(probe) is None


class TestAlongsideTheWordTiers:
    """With the tier on, the query's embedding and nearest entries are fetched while the word
    tiers look (a miss waits for the slower of the two), and dropped when a word tier answers."""

    async def test_the_embedding_starts_before_the_word_tiers_answer(self, cache, local, quiet, monkeypatch):
        scope = new_scope()
        cache.add(scope, vector(20))
        find = store.find
        seen_during_find: list[bool] = []

        async def find_after_a_while(**kwargs: Any) -> list[store.Stored]:
            # Sequential code would embed only after this returns: give it a second to start.
            seen_during_find.append(await asyncio.to_thread(local.embedding_started.wait, 1.0))
            return await find(**kwargs)

        monkeypatch.setattr(store, "find", find_after_a_while)
        assert await lookup.lookup(probe_for(cache, scope, "Something else entirely?")) is None
        assert seen_during_find == [True]

    async def test_a_word_tier_hit_drops_the_search_and_embeds_once(self, cache, local, quiet, monkeypatch):
        scope = new_scope()
        question_vector = local.embed([QUESTION])[0]
        local.embedded.clear()
        cache.add(scope, question_vector, signed=True)
        searches: list[str] = []

        async def slow_search(**kwargs: Any) -> list[store.Candidate]:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                searches.append("cancelled")
                raise
            return []

        monkeypatch.setattr(store, "search", slow_search)
        casing = QUESTION.lower().rstrip("?")  # the same words: the word tier's, with the similarity guard
        local.vectors[casing] = vector(21, near=question_vector, similarity=0.99)
        async with asyncio.timeout(10):
            hit = await lookup.lookup(probe_for(cache, scope, casing))
        assert hit is not None
        assert hit.wording != budget.PARAPHRASE
        await asyncio.sleep(0)
        assert searches == ["cancelled"]
        assert local.embedded == [casing]  # the guard used the embedding made alongside
        assert local.scored == []

    async def test_without_the_tier_a_miss_embeds_nothing(self, cache, local, quiet):
        scope = new_scope()
        cache.add(scope, vector(22))
        local.embedded.clear()
        probe = probe_for(cache, scope, "Something else entirely?", paraphrases=False)
        assert await lookup.lookup(probe) is None
        assert local.embedded == []


def test_the_rules_carry_the_models_choice(settings):
    settings.SEMANTIC_CACHE_PARAPHRASES = True
    assert CacheRules.defaults().paraphrases is True
    settings.SEMANTIC_CACHE_PARAPHRASES = False
    assert CacheRules.defaults().paraphrases is False
