"""A request's cache lookup (sign → find in its scope → verify → embed only for a would-be
hit), and storing a miss's answer.

The lookup never fails a request: anything that goes wrong within
SEMANTIC_CACHE_LOOKUP_TIMEOUT (the embedding replica, PostgreSQL slow or down) is a miss.
Storing happens off the request path, after the answer completed.

Chat answers live in PostgreSQL (``store``), found by their word signatures (``signature``)
and then verified. Embeddings
requests get an exact-match cache in Redis instead: the same input to the same model version
(in the same tenant scope, with the same encoding) has the same vectors.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import orjson
from django.conf import settings
from django.utils import timezone

from core import keys
from core.lifecycle import Background, unobserved
from core.redis import async_redis
from serving.gateway import metrics
from serving.semcache import bound, budget, feedback, paraphrase, signature, store
from serving.semcache.embed import cosine, embed_texts
from serving.semcache.policy import ANSWER_NEUTRAL, CacheIntent
from serving.semcache.verify import SAME, Thresholds, verify_words

logger = logging.getLogger(__name__)

R = TypeVar("R")

HIT = "hit"
SEMANTIC_HIT = "semantic-hit"
MISS = "miss"
# Entries sharing a signature verified per lookup (those with the query's own words first):
# one may be a trap that another is not.
CANDIDATES = 8
# Prompts longer than this (together) are signed and verified in a worker thread (a ~900-word
# prompt takes ~9 ms to analyse; short ones ~0.13 ms, cheaper than the hop to a thread).
VERIFY_INLINE_CHARS = 2000
# Embedding answers larger than this are not kept in Redis.
EMBEDDINGS_CACHE_MAX_BYTES = 512 * 1024


@dataclass(frozen=True)
class CacheHit:
    outcome: str  # HIT (the same text) or SEMANTIC_HIT (verified as asking the same)
    similarity: float
    answer: dict[str, Any]  # chat: {"message", "finish_reason"}; embeddings: the engine's JSON
    completion_tokens: int
    prompt_tokens: int  # embeddings: the stored answer's; chat: the request's own count is used
    entry_id: int | None = None
    wording: str = budget.EXACT  # the tier it was verified at (verify.TIERS, budget.PARAPHRASE), or the same text
    score: float | None = None  # the paraphrase verifier's score for a paraphrase hit


@dataclass(frozen=True)
class Audit:
    """The engine answers a prompt the cache held an answer for: its cached answer, to compare.

    A would-be hit (``counted``: the tier's error budget counts the comparison) or, for the
    paraphrase tier, a near miss (only the entry's evidence learns from it)."""

    wording: str
    cached: str
    entry_id: int | None = None
    score: float | None = None  # the paraphrase verifier's score: the comparison is the entry's evidence
    counted: bool = True


@dataclass
class CacheProbe:
    """What a request may do with the cache, and what its lookup learned (kept to store its
    answer on a miss without embedding the prompt a second time, and to audit a would-be hit)."""

    intent: CacheIntent
    scope: str
    query: str
    model: str
    wrong_hit_budget: float = 0.01  # the rate accepted (the model's CachePolicy or the default)
    paraphrases: bool = False  # the paraphrase tier may serve (the model's rules)
    embedding: list[float] | None = None
    audit: Audit | None = None
    # A miss's question embedded alongside its generation, for storing its answer (``remember``).
    embedding_ahead: asyncio.Future[list[float]] | None = None


_background = Background()


def _normalised(text: str) -> str:
    return " ".join(text.split())


async def lookup(probe: CacheProbe) -> CacheHit | None:
    """The verified answer for ``probe``, or None (a miss, whatever went wrong)."""
    started = time.perf_counter()
    try:
        async with asyncio.timeout(settings.SEMANTIC_CACHE_LOOKUP_TIMEOUT):
            return await _lookup(probe)
    except TimeoutError:
        metrics.CACHE_LOOKUPS.labels(probe.model, "timeout").inc()
        logger.warning("semantic cache lookup over %.0f ms: a miss", settings.SEMANTIC_CACHE_LOOKUP_TIMEOUT * 1000)
        return None
    except Exception:
        metrics.CACHE_LOOKUPS.labels(probe.model, "error").inc()
        logger.warning("semantic cache lookup failed: a miss", exc_info=True)
        return None
    finally:
        metrics.CACHE_LOOKUP_SECONDS.observe(time.perf_counter() - started)


async def _off_loop_if_long(size: int, fn: Callable[[], R]) -> R:
    # Long prompts take milliseconds to analyse: not on the event loop.
    return await asyncio.to_thread(fn) if size > VERIFY_INLINE_CHARS else fn()


async def _lookup(probe: CacheProbe) -> CacheHit | None:
    """Find the scope's entries by signature (no embedding), verify their words, and only for
    one whose words pass embed the query for the similarity guard. With the paraphrase tier
    on, the query's embedding and its nearest entries are fetched alongside the word tiers
    (``_Ahead``), so a miss waits for the slower of the two, not for both in turn."""
    scope, text = probe.scope, probe.query
    ahead = _Ahead.start(probe)
    try:
        signatures, bag = await _off_loop_if_long(
            len(text), lambda: (signature.of_query(scope, text), signature.bag_of(scope, text))
        )
        found = await store.find(scope=scope, prompt=text, signatures=signatures, bag=bag, limit=CANDIDATES)
        query = _normalised(text)
        found.sort(key=lambda entry: _normalised(entry.prompt) != query)  # the same text first (stable)
        for entry in found:
            if _normalised(entry.prompt) == query:
                outcome, wording, similarity = HIT, budget.EXACT, 1.0
            else:
                cached = entry.prompt
                verdict = await _off_loop_if_long(
                    len(text) + len(cached), functools.partial(verify_words, query=text, cached=cached)
                )
                if not verdict.ok:
                    metrics.CACHE_REJECTIONS.labels(verdict.category or "other").inc()
                    logger.debug("cache entry %s rejected (%s): %s", entry.entry_id, verdict.category, verdict.reason)
                    continue
                if entry.strictness >= feedback.SAME_TEXT_ONLY or (
                    entry.strictness == feedback.SAME_WORDS_ONLY and verdict.wording != SAME
                ):
                    metrics.CACHE_REJECTIONS.labels("tightened").inc()
                    continue  # reported wrong once: this entry and its neighbours serve less
                if probe.embedding is None:
                    # Only now, for a candidate whose words pass: a miss never waits on the embedder.
                    probe.embedding = await (ahead.embedding if ahead else _embed_query(text))
                similarity = cosine(probe.embedding, entry.embedding)
                minimum = Thresholds.from_settings().minimum
                if similarity < minimum:
                    metrics.CACHE_REJECTIONS.labels("low_similarity").inc()
                    logger.debug(
                        "cache entry %s rejected: similarity %.3f below %.3f", entry.entry_id, similarity, minimum
                    )
                    continue
                wording = verdict.wording
                if await budget.decide_for(probe.model, wording, budget=probe.wrong_hit_budget) == budget.AUDIT:
                    # Outside the error budget (or sampled): the engine answers, and the two are compared.
                    probe.audit = Audit(wording=wording, cached=_answer_text(entry.response))
                    metrics.CACHE_LOOKUPS.labels(probe.model, "audit").inc()
                    return None
                outcome = SEMANTIC_HIT
            return _served(probe, entry, outcome=outcome, similarity=similarity, wording=wording)
        if ahead is not None:
            probe.embedding = await ahead.embedding
            hit = await _paraphrase(probe, await ahead.neighbours)
            if hit is not None or (probe.audit is not None and probe.audit.counted):
                return hit
    finally:
        if ahead is not None:
            ahead.cancel()  # a word tier answered, or the lookup failed or ran out of time
    metrics.CACHE_LOOKUPS.labels(probe.model, MISS).inc()
    _embed_ahead(probe)
    return None


@dataclass
class _Ahead:
    """The paraphrase tier's inputs, fetched while the word tiers look: the query's embedding
    (a few ms in process), then the scope's nearest entries (pgvector)."""

    embedding: asyncio.Future[list[float]]
    neighbours: asyncio.Future[list[store.Candidate]]

    @classmethod
    def start(cls, probe: CacheProbe) -> _Ahead | None:
        if not probe.paraphrases or paraphrase.ready() is None:
            return None  # tier off, or its models still loading (in a thread, ``paraphrase.ready``)
        embedding = unobserved(asyncio.ensure_future(_embed_query(probe.query)))

        async def neighbours() -> list[store.Candidate]:
            return await store.search(
                scope=probe.scope, embedding=await embedding, limit=settings.SEMANTIC_CACHE_PARAPHRASE_CANDIDATES
            )

        return cls(embedding=embedding, neighbours=unobserved(asyncio.ensure_future(neighbours())))

    def cancel(self) -> None:
        for future in (self.neighbours, self.embedding):
            future.cancel()  # a no-op once done; a worker thread already running finishes unawaited


def _served(probe: CacheProbe, entry: store.Stored | store.Candidate, *, outcome: str, similarity: float,
            wording: str, score: float | None = None) -> CacheHit:  # fmt: skip
    """A hit of either tier: counted, its entry's hit recorded off the path."""
    metrics.CACHE_LOOKUPS.labels(probe.model, outcome).inc()
    _background.spawn(store.record_hit(entry_id=entry.entry_id), what="record a cache hit")
    return CacheHit(
        outcome=outcome,
        similarity=similarity,
        answer=entry.response,
        completion_tokens=entry.completion_tokens,
        prompt_tokens=entry.prompt_tokens,
        entry_id=entry.entry_id,
        wording=wording,
        score=score,
    )


def _answer_text(response: dict[str, Any]) -> str:
    """A stored chat answer's text (what an audit compares with the engine's)."""
    return str((response.get("message") or {}).get("content") or "")


async def _embed_query(text: str) -> list[float]:
    """The prompt's embedding: in process when the cache's local models are built (a few ms,
    the same all-MiniLM-L6-v2 vectors), else from an embedding replica."""
    local = paraphrase.ready()
    if local is not None:
        [vector] = await asyncio.to_thread(local.embed, [text])
        return vector
    [vector] = await embed_texts([text])
    return vector


async def _paraphrase(probe: CacheProbe, neighbours: list[store.Candidate]) -> CacheHit | None:
    """The paraphrase tier: the scope's nearest entries by embedding (``neighbours``), scored
    by the learned verifier, each held to its own threshold (``bound``); the model's error
    budget and the exploration rate send some would-be hits to the engine, to compare."""
    local = paraphrase.ready()
    if local is None:
        return None
    found = [
        candidate
        for candidate in neighbours
        if candidate.similarity >= settings.SEMANTIC_CACHE_PARAPHRASE_MIN_SIMILARITY
        and candidate.strictness == 0  # reported wrong once: no paraphrases for it or its neighbours
        and _normalised(candidate.prompt) != _normalised(probe.query)  # the signature tier's own
    ]
    if not found:
        return None
    # Milliseconds of a cross-encoder: never on the event loop.
    scores = await asyncio.to_thread(local.score, [(candidate.prompt, probe.query) for candidate in found])
    curve = local.curve()
    near: tuple[store.Candidate, float] | None = None
    for candidate, score in sorted(zip(found, scores, strict=True), key=lambda pair: -pair[1]):
        threshold = bound.threshold(
            bound.evidence_of(candidate.evidence), curve=curve, delta=probe.wrong_hit_budget,
            prior_weight=settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_WEIGHT,
        )  # fmt: skip
        if score < threshold:
            if near is None and score >= threshold - bound.NEAR_MISS_BAND:
                near = (candidate, score)
            metrics.CACHE_REJECTIONS.labels("paraphrase_score").inc()
            continue
        decision = await budget.decide_for(probe.model, budget.PARAPHRASE, budget=probe.wrong_hit_budget)
        if decision == budget.AUDIT or random.random() < settings.SEMANTIC_CACHE_PARAPHRASE_EXPLORE_RATE:
            # The engine answers, and the answers are compared: the tier's estimate and this
            # entry's evidence both learn from it.
            probe.audit = Audit(wording=budget.PARAPHRASE, cached=_answer_text(candidate.response),
                                entry_id=candidate.entry_id, score=score)  # fmt: skip
            metrics.CACHE_LOOKUPS.labels(probe.model, "audit").inc()
            return None
        return _served(probe, candidate, outcome=SEMANTIC_HIT, similarity=candidate.similarity,
                       wording=budget.PARAPHRASE, score=score)  # fmt: skip
    if near is not None:
        candidate, score = near
        probe.audit = Audit(wording=budget.PARAPHRASE, cached=_answer_text(candidate.response),
                            entry_id=candidate.entry_id, score=score, counted=False)  # fmt: skip
    return None


def _embed_ahead(probe: CacheProbe) -> None:
    """A miss whose answer will be stored: embed its question now, while the engine generates
    (the miss does not wait for it), so the answer is stored the moment it completes and an
    immediate repeat finds it."""
    if not probe.intent.write or probe.embedding is not None or probe.embedding_ahead is not None:
        return
    ahead: asyncio.Future[list[float]] = unobserved(asyncio.get_running_loop().create_future())

    async def embed() -> None:
        try:
            embedding = await _embed_query(probe.query)
        except Exception as exc:  # noqa: BLE001 - handed to ``remember``, which embeds again
            ahead.set_exception(exc)
        else:
            ahead.set_result(embedding)
        finally:
            if not ahead.done():  # cancelled
                ahead.cancel()

    probe.embedding_ahead = ahead
    _background.spawn(embed(), what="embed a question for the semantic cache")


def note_served(probe: CacheProbe, hit: CacheHit, *, request_id: uuid.UUID, organization_id: int,
                model_version: str) -> None:  # fmt: skip
    """A chat answer was served from the cache: keep what for feedback, count it (off the path)."""
    served = feedback.Served(
        organization_id=organization_id, model=probe.model, model_version=model_version, entry_id=hit.entry_id,
        wording=hit.wording, scope=probe.scope, score=hit.score,
    )  # fmt: skip
    _background.spawn(feedback.note_served(request_id, served), what="note a served cache answer")


def audit_answer(probe: CacheProbe, live: str) -> None:
    """The engine answered a would-be hit (an audit): compare its answer with the cached one,
    off the request path."""
    if probe.audit is None or not live:
        return
    _background.spawn(_compare(probe.model, probe.audit, live), what="audit a cache answer")


async def _compare(model: str, found: Audit, live: str) -> None:
    if found.counted:
        agreed = await budget.audit(model=model, tier=found.wording, cached=found.cached, live=live)
    else:
        agreed = await budget.agree(found.cached, live)
    if found.entry_id is not None and found.score is not None:
        await store.observe(entry_id=found.entry_id, score=found.score, agreed=agreed)


def remember(
    probe: CacheProbe,
    *,
    organization_id: int,
    model_version: str,
    answer: dict[str, Any],
    prompt_tokens: int,
    completion_tokens: int,
    ttl_seconds: int,
) -> None:
    """Store a completed answer for later requests, off the request path."""

    async def write() -> None:
        embedding = probe.embedding
        if embedding is None and probe.embedding_ahead is not None:
            try:
                embedding = await probe.embedding_ahead
            except Exception:
                logger.debug("the question's embedding ahead failed; embedding it again", exc_info=True)
        if embedding is None:
            embedding = await _embed_query(probe.query)
        scope, text = probe.scope, probe.query
        signatures = await _off_loop_if_long(len(text), lambda: signature.of_entry(scope, text))
        await store.insert(
            signatures=signatures,
            scope=probe.scope,
            organization_id=organization_id,
            model=probe.model,
            model_version=model_version,
            embedding=embedding,
            prompt=probe.query,
            response=answer,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            expires_at=timezone.now() + timedelta(seconds=ttl_seconds),
        )
        metrics.CACHE_STORED.labels(probe.model).inc()

    _background.spawn(write(), what="store an answer in the semantic cache")


# --- The embeddings exact-match cache (Redis) ------------------------------------------------


def embeddings_key(*, payload: dict[str, Any], version_id: int, tenant: str) -> str:
    material = {k: v for k, v in payload.items() if k not in ANSWER_NEUTRAL}
    digest = hashlib.sha256(orjson.dumps({"v": version_id, "t": tenant, "p": material}, option=orjson.OPT_SORT_KEYS))
    return keys.embeddings_cache(digest.hexdigest())


async def embeddings_get(key: str, *, model: str) -> CacheHit | None:
    try:
        async with asyncio.timeout(settings.SEMANTIC_CACHE_LOOKUP_TIMEOUT):
            raw = await async_redis().get(key)
    except Exception:
        metrics.CACHE_LOOKUPS.labels(model, "error").inc()
        logger.warning("embeddings cache lookup failed: a miss", exc_info=True)
        return None
    if raw is None:
        metrics.CACHE_LOOKUPS.labels(model, MISS).inc()
        return None
    metrics.CACHE_LOOKUPS.labels(model, HIT).inc()
    answer = orjson.loads(raw)
    return CacheHit(
        outcome=HIT,
        similarity=1.0,
        answer=answer,
        completion_tokens=0,
        prompt_tokens=int((answer.get("usage") or {}).get("prompt_tokens") or 0),
    )


def embeddings_put(key: str, answer: dict[str, Any], *, ttl_seconds: int) -> None:
    raw = orjson.dumps(answer)
    if len(raw) > EMBEDDINGS_CACHE_MAX_BYTES:
        return
    _background.spawn(async_redis().set(key, raw, ex=ttl_seconds), what="store an embeddings answer")
