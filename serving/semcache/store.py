"""Cache entries in PostgreSQL + pgvector: find by signature or search by vector inside one
scope, insert, expire, purge.

The request path's lookup is ``find``: the scope's entries sharing a signature with the query
(``serving.semcache.signature``), from the GIN index on ``signatures``, no embedding needed.
``search`` (by vector, nearest first) is off the request path (the offline eval; the
retrieval a paraphrase tier would need). It runs one of two plans, both filtered on the
exact scope (and re-checked here, so no plan or index can ever hand back another scope's
entry):

- ``exact``: the scope's unexpired entries read from the covering ``cache_scope_vectors``
  index alone (scope, expiry, id and vector, an index-only scan), every distance computed,
  a top-N sort. Exact, and cheapest while the scope is small.
- ``hnsw``: the HNSW index of the scope's bucket (one per first hex digit of the scope,
  1/16 of the entries) with pgvector 0.8's iterative index scan, which keeps walking the
  graph until ``limit`` entries of the scope have passed the filter (or
  ``hnsw.max_scan_tuples`` were visited). Approximate, and cheapest once the scope is large.

Which one a scope gets depends on its entry count, kept in a Redis hash: recounted from
the table by ``scope_sizes_refresh`` (the purge task, every minute) and bumped by
``insert`` in between; ``SEMANTIC_CACHE_EXACT_MAX_ENTRIES`` is the crossover measured in
docs/performance.md ("Semantic cache: lookup at 1M entries").

Every statement sets ``statement_timeout`` for itself (``SET LOCAL`` in the same round
trip), at most ``SEMANTIC_CACHE_MAX_DB_CALLS`` calls per process are in flight, and after a
failure the store answers ``CacheUnavailable`` at once for ``SEMANTIC_CACHE_RETRY_AFTER``
seconds: a slow or absent database costs a lookup its timeout, never a worker thread or
a pooled connection per request. Callers treat any exception from ``search`` as a miss.

Expired rows are deleted in small batches (``purge_expired``), not by dropping partitions:
docs/architecture.md, "The semantic cache", says why.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TypeVar

import orjson
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from redis.exceptions import RedisError

from core import keys
from core.db import run_db
from core.redis import async_redis, sync_redis
from serving.semcache.models import EMBEDDING_DIMENSIONS, CacheEntry

logger = logging.getLogger(__name__)

R = TypeVar("R")

Plan = Literal["exact", "hnsw"]
TABLE = CacheEntry._meta.db_table
# Off the request path: an insert or a hit may wait longer than a search, a purge batch longer still.
WRITE_TIMEOUT_MS = 2000
PURGE_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class Candidate:
    """An unexpired entry of the scope, with its cosine similarity to the query (1 = same)."""

    entry_id: int
    similarity: float
    prompt: str
    response: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    strictness: int = 0  # raised by feedback: 1 serves only the same words, 2 only the same text
    evidence: Any = ()  # the paraphrase tier's observations, as stored (serving.semcache.bound)


@dataclass(frozen=True)
class Stored:
    """An unexpired entry of the scope sharing a signature with the query (``find``)."""

    entry_id: int
    prompt: str
    response: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    strictness: int
    embedding: list[float]  # for the similarity guard, computed only if its words pass
    same_bag: bool  # the same normalised words (not only a typo or joined-word variant)


class CacheUnavailable(Exception):
    """The store cannot answer now (database slow or down, or too many calls in flight): a miss."""


# --- Search -----------------------------------------------------------------------------

# Both plans return the same columns. ``scope`` comes back so that rows are checked again
# here: whatever plan the database picks, an entry of another scope is never a candidate.
# The statements are sent with their parameters bound client-side (Django's default, and
# the benchmark's ClientCursor), so the planner sees the bucket's LIKE literal and can match
# the partial HNSW index; server-side binding with generic plans would lose that.

# The scope's entries straight from the covering (scope, expires_at) INCLUDE (id, embedding)
# index (an index-only scan: neither the table nor the TOASTed vectors are read), all
# distances computed, a top-N sort; then only the winners are read from the table. Ordered
# by similarity, an expression no HNSW index produces, and with sequential and bitmap scans
# off for the statement: this plan is exact whatever the statistics say.
EXACT_SQL = f"""
WITH nearest AS MATERIALIZED (
    SELECT id, 1 - (embedding <=> %(query)s::vector) AS similarity FROM {TABLE}
    WHERE scope = %(scope)s AND expires_at > now()
    ORDER BY similarity DESC, id
    LIMIT %(limit)s
)
SELECT e.id, e.scope, n.similarity, e.prompt, e.response, e.prompt_tokens, e.completion_tokens, e.strictness,
       e.evidence
FROM nearest n JOIN {TABLE} e ON e.id = n.id
ORDER BY n.similarity DESC, n.id
"""

# The scope's bucket index (``scope LIKE 'a%'`` is its predicate), ordered by the index's own
# operator, with sorting off for the statement: the only plan left without a sort is that
# HNSW index's scan (PostgreSQL 18 counts disabled nodes rather than pricing them).
HNSW_SQL = f"""
SELECT id, scope, 1 - (embedding <=> %(query)s::vector) AS similarity,
       prompt, response, prompt_tokens, completion_tokens, strictness, evidence
FROM {TABLE}
WHERE scope = %(scope)s AND scope LIKE %(bucket)s AND expires_at > now()
ORDER BY embedding <=> %(query)s::vector
LIMIT %(limit)s
"""

_SCOPE = re.compile(r"[0-9a-f]{64}")


def check_scope(scope: str) -> str:
    """A scope is a lowercase hex SHA-256 (``policy.scope_of``): its first digit is its bucket."""
    if not _SCOPE.fullmatch(scope):
        raise ValueError("a cache scope is a lowercase hex SHA-256")
    return scope


@dataclass(frozen=True)
class SearchTuning:
    """The knobs of the two plans (defaults from the ``SEMANTIC_CACHE_*`` settings)."""

    timeout_ms: int
    ef_search: int
    iterative_scan: str  # strict_order | relaxed_order
    max_scan_tuples: int

    @classmethod
    def from_settings(cls) -> SearchTuning:
        return cls(
            timeout_ms=settings.SEMANTIC_CACHE_SEARCH_TIMEOUT_MS,
            ef_search=settings.SEMANTIC_CACHE_HNSW_EF_SEARCH,
            iterative_scan=settings.SEMANTIC_CACHE_HNSW_ITERATIVE_SCAN,
            max_scan_tuples=settings.SEMANTIC_CACHE_HNSW_MAX_SCAN_TUPLES,
        )

    def statement(self, plan: Plan, *, explain: str = "") -> str:
        """The ``SET LOCAL`` lines and the query, one string: a single round trip
        (``explain``, e.g. ``"EXPLAIN (ANALYZE, BUFFERS)"``, goes before the query).

        Several statements in one simple-protocol message run as one implicit transaction,
        so ``SET LOCAL`` holds for the query after it and ends with it (also on error),
        leaving nothing behind on the pooled connection.
        """
        lines = [f"SET LOCAL statement_timeout = {int(self.timeout_ms)}"]
        if plan == "exact":
            lines += ["SET LOCAL enable_seqscan = off", "SET LOCAL enable_bitmapscan = off"]
        else:
            if self.iterative_scan not in ("strict_order", "relaxed_order"):
                raise ValueError(f"unknown iterative scan mode {self.iterative_scan!r}")
            lines += [
                f"SET LOCAL hnsw.ef_search = {int(self.ef_search)}",
                f"SET LOCAL hnsw.iterative_scan = {self.iterative_scan}",
                f"SET LOCAL hnsw.max_scan_tuples = {int(self.max_scan_tuples)}",
                "SET LOCAL enable_sort = off",
            ]
        query = HNSW_SQL if plan == "hnsw" else EXACT_SQL
        return ";\n".join([*lines, f"{explain} {query.strip()}" if explain else query])


def vector_literal(embedding: Sequence[float]) -> str:
    """pgvector's text form; refuses a vector of the wrong size or with a NaN or infinity."""
    if len(embedding) != EMBEDDING_DIMENSIONS:
        raise ValueError(f"an embedding has {EMBEDDING_DIMENSIONS} dimensions, not {len(embedding)}")
    values = [float(v) for v in embedding]
    if not all(math.isfinite(v) for v in values):
        raise ValueError("an embedding must be finite")
    return "[" + ",".join(repr(v) for v in values) + "]"


def search_rows(
    cursor: Any, *, scope: str, embedding: Sequence[float], limit: int, plan: Plan, tuning: SearchTuning
) -> list[Candidate]:
    """Run one plan on ``cursor`` (a Django or client-side-binding psycopg cursor in
    autocommit mode, never inside a transaction: ``SET LOCAL`` would outlive the query).
    Shared with bench/semantic_cache_lookup.py, so the benchmark measures this very SQL."""
    params = {"scope": check_scope(scope), "bucket": f"{scope[0]}%", "query": vector_literal(embedding),
              "limit": int(limit)}  # fmt: skip
    cursor.execute(tuning.statement(plan), params)
    while cursor.description is None and cursor.nextset():  # past the SET results
        pass
    candidates = [
        Candidate(
            entry_id=int(entry_id),
            similarity=float(similarity),
            prompt=prompt,
            response=orjson.loads(response) if isinstance(response, str | bytes) else response,
            prompt_tokens=int(prompt_tokens),
            completion_tokens=int(completion_tokens),
            strictness=int(strictness),
            evidence=orjson.loads(evidence) if isinstance(evidence, str | bytes) else evidence,
        )
        for (
            entry_id,
            row_scope,
            similarity,
            prompt,
            response,
            prompt_tokens,
            completion_tokens,
            strictness,
            evidence,
        ) in cursor.fetchall()
        if row_scope == scope
    ]
    # relaxed_order may emit rows slightly out of order; callers get them most similar first.
    candidates.sort(key=lambda c: (-c.similarity, c.entry_id))
    return candidates


def plan_for(size: int | None) -> Plan:
    """Exact search up to the measured crossover; HNSW beyond it, or when the size is unknown
    (Redis unreachable): its cost is bounded by ``hnsw.max_scan_tuples`` whatever the size."""
    if size is not None and size <= settings.SEMANTIC_CACHE_EXACT_MAX_ENTRIES:
        return "exact"
    return "hnsw"


async def search(*, scope: str, embedding: list[float], limit: int = 4, plan: Plan | None = None) -> list[Candidate]:
    """The ``limit`` nearest unexpired entries of ``scope``, most similar first.

    ``plan`` forces one plan (tests, benchmarks); by default the scope's size picks it.
    Raises ``CacheUnavailable`` (or ``ValueError`` for a malformed embedding) instead of
    waiting on a database that does not answer.
    """
    check_scope(scope)
    if plan is None:
        plan = plan_for(await scope_size(scope))
    tuning = SearchTuning.from_settings()

    def run() -> list[Candidate]:
        with connection.cursor() as cursor:
            return search_rows(cursor, scope=scope, embedding=embedding, limit=limit, plan=plan, tuning=tuning)

    return await _guarded(run, timeout_s=tuning.timeout_ms / 1000)


# The request path's lookup: entries of the scope sharing any signature with the query
# (serving.semcache.signature). The rows come from the GIN index on ``signatures`` alone (a
# signature hashes the scope in, so the overlap is selective by itself): the CTE has no
# other predicate an index could serve, and ``find_rows`` turns sequential scans off, so
# neither a large scope's B-tree nor a whole-table read is ever walked instead. Scope and
# expiry are then checked on those few rows (and the scope again in Python). The same text
# first, then entries with the query's own word bag, then the newest.
FIND_SQL = f"""
WITH sharing AS MATERIALIZED (
    SELECT id, scope, expires_at, prompt, response, prompt_tokens, completion_tokens, strictness, embedding,
           signatures && %(bag)s::bigint[] AS same_bag
    FROM {TABLE} WHERE signatures && %(signatures)s::bigint[]
)
SELECT id, scope, prompt, response, prompt_tokens, completion_tokens, strictness, embedding::text, same_bag
FROM sharing
WHERE scope = %(scope)s AND expires_at > now()
ORDER BY prompt = %(prompt)s DESC, same_bag DESC, id DESC
LIMIT %(limit)s
"""


def find_rows(cursor: Any, *, scope: str, prompt: str, signatures: Sequence[int], bag: int, limit: int,
              timeout_ms: int) -> list[Stored]:  # fmt: skip
    """Run the lookup's query on ``cursor`` (autocommit, as ``search_rows``). Shared with
    bench/semantic_cache_signatures.py, so the benchmark measures this very SQL."""
    params = {"scope": check_scope(scope), "prompt": prompt, "signatures": [int(s) for s in signatures],
              "bag": [int(bag)], "limit": int(limit)}  # fmt: skip
    # Sequential scans off for the statement: the planner, guessing an overlap of many
    # hashes to be unselective, would otherwise read a small table whole (tens of ms).
    cursor.execute(f"SET LOCAL statement_timeout = {int(timeout_ms)};\nSET LOCAL enable_seqscan = off;\n{FIND_SQL}",
                   params)  # fmt: skip
    while cursor.description is None and cursor.nextset():  # past the SET result
        pass
    out = []
    for row in cursor.fetchall():
        entry_id, row_scope, prompt, response, prompt_tokens, completion_tokens, strictness, embedding, same_bag = row
        if row_scope != scope:
            continue
        out.append(Stored(
            entry_id=int(entry_id),
            prompt=prompt,
            response=orjson.loads(response) if isinstance(response, str | bytes) else response,
            prompt_tokens=int(prompt_tokens),
            completion_tokens=int(completion_tokens),
            strictness=int(strictness),
            embedding=orjson.loads(embedding),
            same_bag=bool(same_bag),
        ))  # fmt: skip
    return out


async def find(*, scope: str, prompt: str, signatures: Sequence[int], bag: int, limit: int = 8) -> list[Stored]:
    """The entries of ``scope`` that share a signature with the query ``prompt`` (entries of
    that very text first, then those of its own word bag, hashed as ``bag``). Raises ``CacheUnavailable`` instead of
    waiting on a database that does not answer."""
    check_scope(scope)
    if not signatures:
        return []
    timeout_ms = settings.SEMANTIC_CACHE_SEARCH_TIMEOUT_MS

    def run() -> list[Stored]:
        with connection.cursor() as cursor:
            return find_rows(cursor, scope=scope, prompt=prompt, signatures=signatures, bag=bag, limit=limit,
                             timeout_ms=timeout_ms)  # fmt: skip

    return await _guarded(run, timeout_s=timeout_ms / 1000)


# --- Writes on the request's behalf -------------------------------------------------------


async def insert(
    *,
    scope: str,
    organization_id: int | None,
    model: str,
    model_version: str,
    embedding: list[float],
    prompt: str,
    response: dict[str, Any],
    prompt_tokens: int,
    completion_tokens: int,
    expires_at: datetime,
    signatures: Sequence[int] = (),
) -> int:
    """Store an answer (found by ``signatures``: ``signature.of_entry``); returns the entry id."""
    check_scope(scope)  # the same checks as search, before a connection is taken
    vector_literal(embedding)
    timeout_ms = WRITE_TIMEOUT_MS

    def run() -> int:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL statement_timeout = {int(timeout_ms)}")
            entry = CacheEntry.objects.create(
                scope=scope, organization_id=organization_id, model=model, model_version=model_version,
                embedding=embedding, prompt=prompt, response=response, prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens, expires_at=expires_at, signatures=list(signatures),
            )  # fmt: skip
        return entry.pk

    entry_id = await _guarded(run, timeout_s=timeout_ms / 1000)
    try:
        await async_redis().hincrby(_scope_sizes_key(), scope, 1)
    except RedisError:
        logger.warning("could not count a cache entry of scope %s (recounted within minutes)", scope[:12])
    return entry_id


async def record_hit(*, entry_id: int) -> None:
    """Count a hit on an entry (hit_count, last_hit_at); best effort."""
    timeout_ms = WRITE_TIMEOUT_MS

    def run() -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                f"SET LOCAL statement_timeout = {int(timeout_ms)};"
                f" UPDATE {TABLE} SET hit_count = hit_count + 1, last_hit_at = now() WHERE id = %(id)s",
                {"id": int(entry_id)},
            )

    try:
        await _guarded(run, timeout_s=timeout_ms / 1000)
    except CacheUnavailable:
        logger.debug("hit on cache entry %s not recorded", entry_id)


_OBSERVE_SQL = f"""
UPDATE {TABLE} SET evidence = (
    CASE WHEN jsonb_array_length(evidence) >= %(keep)s THEN evidence - 0 ELSE evidence END
) || jsonb_build_array(jsonb_build_array(%(score)s::float8, %(agreed)s::int))
WHERE id = %(id)s
"""


def observe_sync(*, entry_id: int, score: float, agreed: bool) -> None:
    """Append one paraphrase observation to an entry's evidence (the oldest beyond
    ``bound.MAX_EVIDENCE`` dropped), in one statement: concurrent observations never lose
    each other."""
    from serving.semcache.bound import MAX_EVIDENCE

    with connection.cursor() as cursor:
        cursor.execute(
            _OBSERVE_SQL,
            {"id": int(entry_id), "score": round(float(score), 4), "agreed": int(agreed), "keep": MAX_EVIDENCE},
        )


async def observe(*, entry_id: int, score: float, agreed: bool) -> None:
    """``observe_sync`` off the request path, bounded like every write; best effort."""

    def run() -> None:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL statement_timeout = {int(WRITE_TIMEOUT_MS)}")
            observe_sync(entry_id=entry_id, score=score, agreed=agreed)

    try:
        await _guarded(run, timeout_s=WRITE_TIMEOUT_MS / 1000)
    except CacheUnavailable:
        logger.debug("observation on cache entry %s not recorded", entry_id)


# --- Scope sizes (the plan choice's input) ------------------------------------------------


def _scope_sizes_key() -> str:
    return keys.namespaced("semcache", "scope_sizes")


async def scope_size(scope: str) -> int | None:
    """The scope's entry count as last counted (0 for a scope never seen), or None when
    Redis cannot say."""
    try:
        raw = await async_redis().hget(_scope_sizes_key(), scope)
    except RedisError:
        return None
    return int(raw) if raw is not None else 0


def scope_sizes_refresh() -> int:
    """Recount every scope's unexpired entries into Redis; returns how many scopes.

    Replaces the hash whole, so scopes that emptied (expiry, purge) drop out. An insert
    counted between the count and the swap is lost until the next run: harmless, the size
    only picks a plan.
    """
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT scope, count(*) FROM {TABLE} WHERE expires_at > now() GROUP BY scope")
        sizes = {scope: int(count) for scope, count in cursor.fetchall()}
    key = _scope_sizes_key()
    pipe = sync_redis().pipeline(transaction=True)
    if sizes:
        draft = f"{key}:draft"
        pipe.delete(draft)
        pipe.hset(draft, mapping=sizes)
        pipe.rename(draft, key)
    else:
        pipe.delete(key)
    pipe.execute()
    return len(sizes)


# --- Expiry -------------------------------------------------------------------------------

_PURGE_EXPIRED_SQL = f"""
DELETE FROM {TABLE} WHERE id IN (
    SELECT id FROM {TABLE} WHERE expires_at <= coalesce(%(now)s::timestamptz, now())
    ORDER BY expires_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED
)
"""


def delete_in_batches(sql: str, params: dict[str, Any], *, batch_size: int, max_batches: int) -> int:
    """Run ``sql`` (a DELETE of at most ``%(batch)s`` rows) until it deletes fewer; returns
    how many. Each batch commits on its own unless the caller holds a transaction."""
    total = 0
    statement = f"SET LOCAL statement_timeout = {PURGE_TIMEOUT_MS};\n{sql}"
    for _ in range(max_batches):
        with connection.cursor() as cursor:
            cursor.execute(statement, {**params, "batch": int(batch_size)})
            while cursor.nextset():  # to the DELETE's result
                pass
            deleted = max(cursor.rowcount, 0)
        total += deleted
        if deleted < batch_size:
            break
    return total


def purge_expired(*, batch_size: int = 5000, max_batches: int = 100, now: datetime | None = None) -> int:
    """Delete expired entries in batches; returns how many. ``now`` (default: the database's
    clock) is for tests and benchmarks that play out hours of expiry at once.

    Small batches, each its own transaction: row locks are short, WAL comes in small
    pieces, concurrent purgers skip each other's rows, and the index space the dead rows
    held is freed by (auto)vacuum and reused by later inserts, so the HNSW index stays the
    size of the live set (docs/performance.md). Searches never see expired rows either
    way: they filter on ``expires_at``.
    """
    return delete_in_batches(_PURGE_EXPIRED_SQL, {"now": now}, batch_size=batch_size, max_batches=max_batches)


# --- Stats for operators ------------------------------------------------------------------


def cache_stats() -> dict[str, Any]:
    """Entries (live and expired-but-not-yet-purged) and hits per model and version, and the
    table's size on disk with its indexes."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT model, model_version, count(*) FILTER (WHERE expires_at > now()),
                   count(*) FILTER (WHERE expires_at <= now()), coalesce(sum(hit_count), 0)
            FROM {TABLE} GROUP BY model, model_version ORDER BY model, model_version
            """
        )
        rows = cursor.fetchall()
        cursor.execute(
            "SELECT pg_table_size(%(t)s::regclass), pg_indexes_size(%(t)s::regclass),"
            " (SELECT coalesce(sum(pg_relation_size(indexrelid)), 0) FROM pg_index"
            "  WHERE indrelid = %(t)s::regclass AND indexrelid::regclass::text LIKE 'cache_embedding_hnsw%%')",
            {"t": TABLE},
        )
        table_bytes, index_bytes, hnsw_bytes = cursor.fetchone()
    return {
        "models": [
            {"model": model, "version": version, "entries": int(live), "expired": int(expired), "hits": int(hits)}
            for model, version, live, expired, hits in rows
        ],
        "entries": sum(int(r[2]) for r in rows),
        "table_bytes": int(table_bytes),
        "index_bytes": int(index_bytes),
        "hnsw_index_bytes": int(hnsw_bytes),
    }


# --- What a failing database may cost -------------------------------------------------------


class _Guard:
    """Calls in flight, and until when the store refuses calls after a failure."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.closed_until = 0.0

    def reopen(self) -> None:
        """Try the database again on the next call (tests; calls in flight still count)."""
        with self.lock:
            self.closed_until = 0.0


guard = _Guard()


async def _guarded(fn: Callable[[], R], *, timeout_s: float) -> R:
    """``fn`` through ``run_db``, refused at once while the database recently failed or too
    many calls are in flight (a worker thread abandoned by a timeout still counts until it
    returns: that is what keeps an unreachable database from taking every thread)."""
    now = time.monotonic()
    with guard.lock:
        if now < guard.closed_until:
            raise CacheUnavailable("the cache's database failed recently")
        if guard.in_flight >= settings.SEMANTIC_CACHE_MAX_DB_CALLS:
            raise CacheUnavailable("too many cache calls in flight")
        guard.in_flight += 1

    def call() -> R:
        try:
            return fn()
        finally:
            with guard.lock:
                guard.in_flight -= 1

    try:
        # A little above the statement timeout: this one also bounds waiting for a pooled
        # connection, which the statement timeout cannot.
        async with asyncio.timeout(timeout_s + 0.25):
            return await run_db(call)
    except (DatabaseError, TimeoutError) as exc:
        with guard.lock:
            guard.closed_until = time.monotonic() + settings.SEMANTIC_CACHE_RETRY_AFTER
        raise CacheUnavailable(f"the cache's database did not answer: {exc or type(exc).__name__}") from exc
