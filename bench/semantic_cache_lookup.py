"""Semantic-cache lookup at 1M entries over 100 scopes: exact vs HNSW per scope size, recall,
index build, expiry without bloat (docs/performance.md, "Semantic cache: lookup at 1M entries").

Runs by hand, against a scratch database on the embedded PostgreSQL that it creates (with
the project's migrations, so the table and indexes are the real ones) and drops at the end;
it never touches ``inference`` or a test database. Redis keys go under their own namespace.

    .venv/bin/python bench/semantic_cache_lookup.py                  # the whole run (~1 h on 2 cores)
    .venv/bin/python bench/semantic_cache_lookup.py --entries 100000 --queries-per-scope 10 --churn-cycles 4

The vectors are synthetic (embedding a million real prompts with MiniLM on two CPU cores
would take most of a day): unit vectors drawn around topic centroids, half from topics
every scope shares (the same popular questions asked of every model and tenant, the hard
case for a filtered index scan) and half from the scope's own topics; an entry is about
0.75 cosine from its topic, two entries of a topic about 0.56 apart. Hit-like queries are
a stored entry plus noise (about 0.95 cosine to it), miss-like ones a fresh draw from the
scope's topics. Scope sizes are log-uniform, from ~70 to ~70,000 entries.

Latencies are of ``serving.semcache.store.search_rows`` (the SQL ``search`` runs, one round
trip) from Python, excluding the embedding; ``search`` itself (Redis scope size, plan
choice, worker thread, pooled connection) is measured as well.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import re
import shutil
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import psycopg
from pgvector.psycopg import register_vector
from psycopg.types.json import Jsonb, set_json_dumps

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core import embedded  # noqa: E402  (the project root must be on the path first)

SCRATCH_DB = "semcache_bench"
DIM = 384
TABLE = "serving_cacheentry"
HNSW_PREFIX = "cache_embedding_hnsw"  # one index per first hex digit of the scope
COVERING_INDEX = "cache_scope_vectors"
COPY_COLUMNS = (
    "scope, organization_id, model, model_version, embedding, prompt, response, prompt_tokens,"
    " completion_tokens, created_at, expires_at, hit_count"
)
COPY_TYPES = ["varchar", "int8", "varchar", "varchar", "vector", "text", "jsonb", "int4", "int4",
              "timestamptz", "timestamptz", "int4"]  # fmt: skip

ENTRY_NOISE = 0.045  # per dimension: cosine ~0.75 to the topic centroid
QUERY_NOISE = 0.0168  # per dimension: cosine ~0.95 to the stored entry (a paraphrase)
SHARED_TOPICS = 5000
OWN_TOPICS = 50


def log(message: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", flush=True)


def admin_dsn(database: str = "postgres") -> str:
    return f"postgresql://postgres@{embedded.HOST}:{embedded.PG_PORT}/{database}"


def unit(rows: np.ndarray) -> np.ndarray:
    normalized: np.ndarray = (rows / np.linalg.norm(rows, axis=-1, keepdims=True)).astype(np.float32)
    return normalized


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"n": len(ordered), "p50": at(0.50), "p95": at(0.95), "p99": at(0.99), "max": round(ordered[-1], 3),
            "mean": round(statistics.fmean(ordered), 3)}  # fmt: skip


# --- The synthetic cache ----------------------------------------------------------------


@dataclass
class Corpus:
    """Scopes, their sizes and topic mixtures, and a few stored entries per scope to query."""

    rng: np.random.Generator
    scopes: list[str]
    sizes: list[int]
    models: list[tuple[str, str]]
    shared: np.ndarray  # topic centroids every scope draws from
    shared_weights: np.ndarray
    own: np.ndarray  # [scope, topic, dim]
    seeds: dict[int, list[np.ndarray]]

    @classmethod
    def make(cls, *, entries: int, scopes: int, seed: int) -> Corpus:
        rng = np.random.default_rng(seed)
        raw = np.logspace(2, 5, scopes)  # log-uniform sizes, scaled to the total
        sizes = np.maximum(1, np.round(raw * entries / raw.sum())).astype(int)
        sizes[-1] += entries - int(sizes.sum())
        popularity = 1 / (np.arange(SHARED_TOPICS) + 10.0) ** 1.1
        return cls(
            rng=rng,
            scopes=[rng.bytes(32).hex() for _ in range(scopes)],  # as policy.scope_of: hex SHA-256
            sizes=[int(s) for s in sizes],
            models=[(f"bench-model-{i % 10}", f"v{i % 3}") for i in range(scopes)],
            shared=unit(rng.standard_normal((SHARED_TOPICS, DIM))),
            shared_weights=popularity / popularity.sum(),
            own=unit(rng.standard_normal((scopes, OWN_TOPICS, DIM))),
            seeds=defaultdict(list),
        )

    def draw(self, scope_ids: np.ndarray, noise: float) -> np.ndarray:
        """One entry-like vector per scope id: around a shared topic or one of the scope's own."""
        n = len(scope_ids)
        shared = self.rng.random(n) < 0.5
        centroids = np.where(
            shared[:, None],
            self.shared[self.rng.choice(SHARED_TOPICS, size=n, p=self.shared_weights)],
            self.own[scope_ids, self.rng.integers(0, OWN_TOPICS, size=n)],
        )
        return unit(centroids + self.rng.standard_normal((n, DIM)).astype(np.float32) * noise)

    def chunks(self, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Entries in arrival order (scopes interleaved, as a live cache fills), ``size`` at a time,
        keeping ~40 per scope aside as query seeds."""
        order = np.repeat(np.arange(len(self.scopes)), self.sizes)
        self.rng.shuffle(order)
        keep = {i: min(1.0, 40 / s) for i, s in enumerate(self.sizes)}
        for start in range(0, len(order), size):
            scope_ids = order[start : start + size]
            vectors = self.draw(scope_ids, ENTRY_NOISE)
            for scope_id, vector in zip(scope_ids, vectors, strict=True):
                if self.rng.random() < keep[int(scope_id)]:
                    self.seeds[int(scope_id)].append(vector)
            yield scope_ids, vectors

    def queries(self, scope_id: int, count: int) -> list[tuple[str, np.ndarray]]:
        """Half hit-like (a stored entry, paraphrased), half miss-like (a new question of the scope)."""
        seeds = self.seeds[scope_id]
        out: list[tuple[str, np.ndarray]] = []
        for i in range(count):
            if i % 2 == 0 and seeds:
                seed = seeds[int(self.rng.integers(0, len(seeds)))]
                out.append(("hit", unit(seed + self.rng.standard_normal(DIM).astype(np.float32) * QUERY_NOISE)))
            else:
                out.append(("miss", self.draw(np.array([scope_id]), ENTRY_NOISE)[0]))
        return out


WORDS = [
    "the", "a", "model", "answer", "cache", "how", "why", "what", "when", "which", "price", "tenant", "token",
    "invoice", "scope", "vector", "index", "latency", "replica", "deploy", "version", "prompt", "reply", "paris",
    "london", "water", "bicycle", "tea", "history",
]  # fmt: skip


def filler(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def rows(corpus: Corpus, scope_ids: np.ndarray, vectors: np.ndarray, now: datetime, text: random.Random,
         *, expired_share: float = 0.01, expires_at: datetime | None = None) -> Iterator[tuple[Any, ...]]:  # fmt: skip
    for scope_id, vector in zip(scope_ids, vectors, strict=True):
        model, version = corpus.models[int(scope_id)]
        created = now - timedelta(seconds=text.uniform(0, 3600))
        if expires_at is not None:
            expires = expires_at
        elif text.random() < expired_share:
            expires = now - timedelta(seconds=text.uniform(1, 600))  # expired, not purged yet
        else:
            expires = created + timedelta(hours=text.uniform(2, 24))
        prompt = filler(text, text.randint(8, 60))
        content = filler(text, text.randint(30, 300))
        response = {"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        yield (corpus.scopes[int(scope_id)], None, model, version, vector, prompt, Jsonb(response),
               len(prompt) // 4, len(content) // 4, created, expires, 0)  # fmt: skip


def copy_rows(conn: psycopg.Connection[Any], batch: Iterator[tuple[Any, ...]]) -> int:
    n = 0
    with conn.cursor() as cur, cur.copy(f"COPY {TABLE} ({COPY_COLUMNS}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(COPY_TYPES)
        for row in batch:
            copy.write_row(row)
            n += 1
    return n


def sizes_of(conn: psycopg.Connection[Any]) -> dict[str, int]:
    row = conn.execute(
        f"""SELECT pg_table_size('{TABLE}'), pg_indexes_size('{TABLE}'), pg_relation_size('{COVERING_INDEX}'),
                   (SELECT sum(pg_relation_size(indexrelid))::bigint FROM pg_index
                    WHERE indrelid = '{TABLE}'::regclass AND indexrelid::regclass::text LIKE '{HNSW_PREFIX}%%')"""
    ).fetchone()
    assert row is not None
    table, indexes, covering, hnsw = row
    return {"table_bytes": table, "hnsw_bytes": hnsw, "covering_bytes": covering, "all_indexes_bytes": indexes}


# --- Phases -----------------------------------------------------------------------------


def create_scratch(args: argparse.Namespace) -> None:
    with psycopg.connect(admin_dsn(), autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {SCRATCH_DB} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {SCRATCH_DB}")
    log(f"created database {SCRATCH_DB}; migrating")
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def load(args: argparse.Namespace, corpus: Corpus, conn: psycopg.Connection[Any], result: dict[str, Any]) -> None:
    definitions = dict(conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s AND indexname <> %s",
        [TABLE, f"{TABLE}_pkey"],
    ).fetchall())  # fmt: skip
    for name in definitions:
        conn.execute(f"DROP INDEX {name}")
    log(f"loading {args.entries:,} entries over {args.scopes} scopes (COPY, binary)")
    now = datetime.now(UTC)
    text = random.Random(args.seed)
    started = time.perf_counter()
    loaded = 0
    for scope_ids, vectors in corpus.chunks(20_000):
        loaded += copy_rows(conn, rows(corpus, scope_ids, vectors, now, text))
        if loaded % 100_000 == 0 or loaded == args.entries:
            log(f"  {loaded:,} loaded ({time.perf_counter() - started:.0f} s)")
    result["load_seconds"] = round(time.perf_counter() - started, 1)

    conn.execute(f"SET maintenance_work_mem = '{args.maintenance_work_mem}'")
    conn.execute(f"SET max_parallel_maintenance_workers = {args.parallel_workers}")
    builds: dict[str, float] = {}
    for name, definition in definitions.items():
        if not name.startswith(HNSW_PREFIX):
            started = time.perf_counter()
            conn.execute(definition)
            builds[name] = round(time.perf_counter() - started, 1)
    result["btree_build_seconds"] = builds
    log(f"btree indexes rebuilt: {builds}; building the HNSW indexes")

    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    hnsw = sorted(name for name in definitions if name.startswith(HNSW_PREFIX))
    started = time.perf_counter()
    each = {}
    for name in hnsw:
        began = time.perf_counter()
        conn.execute(definitions[name])
        each[name] = round(time.perf_counter() - began, 1)
    result["hnsw_build"] = {
        "seconds": round(time.perf_counter() - started, 1),
        "each": each,
        "definition": definitions[hnsw[0]],
        "maintenance_work_mem": args.maintenance_work_mem,
        "max_parallel_maintenance_workers": args.parallel_workers,
        "notices": notices,
    }
    log(f"{len(hnsw)} HNSW indexes built in {result['hnsw_build']['seconds']} s {notices or ''}")
    conn.execute("RESET maintenance_work_mem")
    started = time.perf_counter()
    conn.execute(f"VACUUM (ANALYZE) {TABLE}")
    result["vacuum_analyze_seconds"] = round(time.perf_counter() - started, 1)
    result["sizes_after_load"] = sizes_of(conn)
    log(f"sizes: {result['sizes_after_load']}")


def plans(args: argparse.Namespace) -> dict[str, Any]:
    from serving.semcache.store import SearchTuning

    base = SearchTuning(timeout_ms=120_000, ef_search=40, iterative_scan="strict_order", max_scan_tuples=20_000)
    return {
        "exact": ("exact", base),
        "hnsw-strict-ef40": ("hnsw", base),
        "hnsw-relaxed-ef40": ("hnsw", replace(base, iterative_scan="relaxed_order")),
        "hnsw-strict-ef100": ("hnsw", replace(base, ef_search=100)),
        "hnsw-relaxed-ef100": ("hnsw", replace(base, iterative_scan="relaxed_order", ef_search=100)),
    }


def explain(conn: psycopg.Connection[Any], corpus: Corpus, args: argparse.Namespace) -> dict[str, str]:
    """The plan PostgreSQL picks for each variant, smallest and largest scope."""
    from serving.semcache.store import vector_literal

    out = {}
    for name, (plan, tuning) in plans(args).items():
        for scope_id in (0, len(corpus.scopes) - 1):
            sql = tuning.statement(plan, explain="EXPLAIN")
            query = corpus.queries(scope_id, 1)[0][1]
            with conn.cursor() as cur:
                scope = corpus.scopes[scope_id]
                cur.execute(sql, {"scope": scope, "bucket": f"{scope[0]}%", "query": vector_literal(query.tolist()),
                                  "limit": 4})  # fmt: skip
                while cur.description is None and cur.nextset():
                    pass
                lines = [r[0] for r in cur.fetchall()]
            text = " | ".join(line.strip() for line in lines[:4])
            out[f"{name} / {corpus.sizes[scope_id]} entries"] = re.sub(r"'\[[^']*\]'", "'[query]'", text)
    return out


def measure_plans(args: argparse.Namespace, corpus: Corpus, conn: psycopg.Connection[Any],
                  result: dict[str, Any]) -> None:  # fmt: skip
    from serving.semcache.store import search_rows

    variants = plans(args)
    per_scope: list[dict[str, Any]] = []
    bucket_sizes: dict[str, int] = defaultdict(int)
    for scope, size in zip(corpus.scopes, corpus.sizes, strict=True):
        bucket_sizes[scope[0]] += size
    log(f"plans x scopes: {len(variants)} plans, {len(corpus.scopes)} scopes, {args.queries_per_scope} queries each")
    # Warm up as a running cache would be (the index and the heap in the OS page cache; the
    # embedded server's shared_buffers are 256 MB): a pass of HNSW queries over every scope.
    with conn.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {TABLE}")
        for scope_id in range(len(corpus.scopes)):
            for _kind, query in corpus.queries(scope_id, 5):
                search_rows(cur, scope=corpus.scopes[scope_id], embedding=query.tolist(), limit=4, plan="hnsw",
                            tuning=variants["hnsw-strict-ef40"][1])  # fmt: skip
    threshold = args.relevant_similarity
    order = list(range(len(corpus.scopes)))
    for done, scope_id in enumerate(order, 1):
        scope = corpus.scopes[scope_id]
        latencies: dict[str, list[float]] = {name: [] for name in variants}
        top1: dict[str, dict[str, list[float]]] = {name: {"hit": [], "miss": []} for name in variants}
        relevant: dict[str, list[float]] = {name: [] for name in variants}
        for kind, query in corpus.queries(scope_id, args.queries_per_scope):
            vector = query.tolist()
            results = {}
            names = list(variants)
            random.shuffle(names)  # no plan always runs first (cold) or last (warm)
            for name in names:
                plan, tuning = variants[name]
                with conn.cursor() as cur:
                    started = time.perf_counter()
                    results[name] = search_rows(cur, scope=scope, embedding=vector, limit=4, plan=plan, tuning=tuning)
                    latencies[name].append((time.perf_counter() - started) * 1000)
            truth = results["exact"]
            if not truth:
                continue
            wanted = {c.entry_id for c in truth if c.similarity >= threshold}
            for name, got in results.items():
                top1[name][kind].append(float(bool(got) and abs(got[0].similarity - truth[0].similarity) < 1e-6))
                if wanted:  # the neighbours a lookup would verify: those above the similarity floor
                    relevant[name].append(len(wanted & {c.entry_id for c in got}) / len(wanted))
        per_scope.append({
            "scope": scope_id, "entries": corpus.sizes[scope_id], "bucket_entries": bucket_sizes[scope[0]],
            "plans": {
                name: {**percentiles(latencies[name]),
                       "latencies_ms": [round(x, 3) for x in latencies[name]],
                       "recall@1_hit": mean_or_none(top1[name]["hit"]),
                       "recall@1_miss": mean_or_none(top1[name]["miss"]),
                       "recall_relevant": mean_or_none(relevant[name]),
                       "relevant_queries": len(relevant[name])}
                for name in variants
            },
        })  # fmt: skip
        if done % 10 == 0 or done == len(order):
            row = per_scope[-1]["plans"]
            log(f"  {done}/{len(order)} scopes; scope of {corpus.sizes[scope_id]:,}: "
                + ", ".join(f"{n} p50 {row[n]['p50']} p99 {row[n]['p99']} ms r@1(hit) {row[n]['recall@1_hit']}"
                            for n in variants))  # fmt: skip
    result["per_scope"] = per_scope
    result["buckets"] = buckets(per_scope, list(variants))
    log("by scope size: " + json.dumps(result["buckets"], indent=1))


def mean_or_none(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def buckets(per_scope: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per-plan latency percentiles over all queries of the scopes in a size range, and recall."""
    edges = [0, 500, 1000, 2000, 3000, 5000, 10_000, 30_000, 10**9]
    out = []
    for low, high in itertools.pairwise(edges):
        members = [s for s in per_scope if low <= s["entries"] < high]
        if not members:
            continue
        row: dict[str, Any] = {"entries": f"{low}-{high if high < 10**9 else 'inf'}", "scopes": len(members)}
        for name in names:
            figures = [s["plans"][name] for s in members]
            pooled = percentiles([x for f in figures for x in f["latencies_ms"]])
            row[name] = {
                "p50": pooled["p50"], "p95": pooled["p95"], "p99": pooled["p99"],
                **{key: mean_or_none([f[key] for f in figures if f[key] is not None])
                   for key in ("recall@1_hit", "recall@1_miss", "recall_relevant")},
            }  # fmt: skip
        out.append(row)
    return out


def measure_search(args: argparse.Namespace, corpus: Corpus, result: dict[str, Any]) -> None:
    """``store.search`` itself, plan chosen by scope size, for traffic spread by entries and evenly."""
    from django.conf import settings

    from serving.semcache import store

    started = time.perf_counter()
    scopes_counted = store.scope_sizes_refresh()
    result["scope_sizes_refresh_seconds"] = round(time.perf_counter() - started, 3)
    log(f"scope sizes recounted ({scopes_counted} scopes) in {result['scope_sizes_refresh_seconds']} s")
    settings.SEMANTIC_CACHE_SEARCH_TIMEOUT_MS = 2000  # measure the tail rather than cut it off
    if args.exact_max_entries is not None:
        settings.SEMANTIC_CACHE_EXACT_MAX_ENTRIES = args.exact_max_entries
    weights = np.array(corpus.sizes, dtype=float)

    async def run(spread: str) -> dict[str, Any]:
        pick = corpus.rng.choice(len(corpus.scopes), size=args.search_queries,
                                 p=weights / weights.sum() if spread == "by-entries" else None)  # fmt: skip
        # Hit-like and miss-like queries alternate, as in the per-plan figures.
        queries = [(int(s), corpus.queries(int(s), 2)[i % 2][1].tolist()) for i, s in enumerate(pick)]
        for scope_id, vector in queries[:50]:  # warm the pool and the worker threads
            await store.search(scope=corpus.scopes[scope_id], embedding=vector)
        latencies, by_plan = [], defaultdict(list)
        for scope_id, vector in queries:
            plan = store.plan_for(corpus.sizes[scope_id])
            began = time.perf_counter()
            await store.search(scope=corpus.scopes[scope_id], embedding=vector)
            elapsed = (time.perf_counter() - began) * 1000
            latencies.append(elapsed)
            by_plan[plan].append(elapsed)
        return {"all": percentiles(latencies), **{plan: percentiles(v) for plan, v in by_plan.items()}}

    result["search"] = {
        "exact_max_entries": settings.SEMANTIC_CACHE_EXACT_MAX_ENTRIES,
        "ef_search": settings.SEMANTIC_CACHE_HNSW_EF_SEARCH,
        "iterative_scan": settings.SEMANTIC_CACHE_HNSW_ITERATIVE_SCAN,
        "by-entries": asyncio.run(run("by-entries")),
        "even": asyncio.run(run("even")),
    }
    log(f"search(): {json.dumps(result['search'])}")


def measure_writes(args: argparse.Namespace, corpus: Corpus, conn: psycopg.Connection[Any],
                   result: dict[str, Any]) -> None:  # fmt: skip
    """At 1M: purging the expired 1 %, what VACUUM then costs, inserts one by one, hits."""
    from serving.semcache import store

    out: dict[str, Any] = {"before": sizes_of(conn)}
    started = time.perf_counter()
    out["purged"] = store.purge_expired(batch_size=5000, max_batches=1000)
    out["purge_seconds"] = round(time.perf_counter() - started, 2)
    log(f"purged {out['purged']:,} expired entries in {out['purge_seconds']} s; VACUUM")
    started = time.perf_counter()
    conn.execute(f"VACUUM {TABLE}")
    out["vacuum_seconds"] = round(time.perf_counter() - started, 1)
    out["after_vacuum"] = sizes_of(conn)
    log(f"VACUUM after the purge: {out['vacuum_seconds']} s, sizes {out['after_vacuum']}")

    # Inserts one by one, as the LLM call's insert after each answer (index maintained).
    now = datetime.now(UTC)
    text = random.Random(args.seed + 1)
    scope_ids = corpus.rng.integers(0, len(corpus.scopes), size=args.single_inserts)
    vectors = corpus.draw(scope_ids, ENTRY_NOISE)
    columns = COPY_COLUMNS
    insert_sql = f"INSERT INTO {TABLE} ({columns}) VALUES ({', '.join(['%s'] * 12)})"
    latencies = []
    for row in rows(corpus, scope_ids, vectors, now, text, expired_share=0):
        began = time.perf_counter()
        conn.execute(insert_sql, row)
        latencies.append((time.perf_counter() - began) * 1000)
    out["single_insert_ms"] = percentiles(latencies)
    out["after_inserts"] = sizes_of(conn)
    log(f"{args.single_inserts} single inserts: {out['single_insert_ms']}; sizes {out['after_inserts']}")

    # Hits: does record_hit's UPDATE stay HOT (no new index entries), or does each hit add an
    # HNSW entry? Counted by PostgreSQL's own statistics.
    ids = [r[0] for r in conn.execute(f"SELECT id FROM {TABLE} TABLESAMPLE SYSTEM (1) LIMIT 2000").fetchall()]
    conn.execute("SELECT pg_stat_force_next_flush()")
    stats_sql = f"SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = '{TABLE}'"
    before = conn.execute(stats_sql).fetchone()
    latencies = []
    for entry_id in ids:
        began = time.perf_counter()
        conn.execute(f"UPDATE {TABLE} SET hit_count = hit_count + 1, last_hit_at = now() WHERE id = %s", [entry_id])
        latencies.append((time.perf_counter() - began) * 1000)
    conn.execute("SELECT pg_stat_force_next_flush()")
    time.sleep(1)
    after = conn.execute(stats_sql).fetchone()
    assert before is not None
    assert after is not None
    out["hits"] = {"updates": after[0] - before[0], "hot_updates": after[1] - before[1],
                   "latency_ms": percentiles(latencies)}  # fmt: skip
    log(f"record_hit UPDATEs: {out['hits']}")
    result["writes_at_1m"] = out


def churn(args: argparse.Namespace, corpus: Corpus, conn: psycopg.Connection[Any], result: dict[str, Any]) -> None:
    """Insert/expire cycles at a steady live set: HNSW size with and without VACUUM between them."""
    from serving.semcache import store

    live = args.churn_batch * args.churn_lifetime
    out: dict[str, Any] = {"live_entries": live, "batch": args.churn_batch, "lifetime_cycles": args.churn_lifetime}
    t0 = datetime(2030, 1, 1, tzinfo=UTC)  # a clock of its own: cycle c is hour c
    text = random.Random(args.seed + 2)
    for regime in ("no-vacuum", "vacuum-each-cycle"):
        conn.execute(f"TRUNCATE {TABLE}")
        conn.execute(f"ALTER TABLE {TABLE} SET (autovacuum_enabled = false)")  # this run decides when
        trace = []
        for cycle in range(args.churn_lifetime + args.churn_cycles):
            scope_ids = corpus.rng.integers(0, len(corpus.scopes), size=args.churn_batch)
            vectors = corpus.draw(scope_ids, ENTRY_NOISE)
            expires = t0 + timedelta(hours=cycle + args.churn_lifetime)
            began = time.perf_counter()
            copy_rows(conn, rows(corpus, scope_ids, vectors, t0, text, expires_at=expires))
            insert_s = time.perf_counter() - began
            began = time.perf_counter()
            purged = store.purge_expired(batch_size=5000, max_batches=10_000, now=t0 + timedelta(hours=cycle))
            purge_s = time.perf_counter() - began
            vacuum_s = None
            if regime == "vacuum-each-cycle" and purged:
                began = time.perf_counter()
                conn.execute(f"VACUUM {TABLE}")
                vacuum_s = round(time.perf_counter() - began, 2)
            sizes = sizes_of(conn)
            count = conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]  # type: ignore[index]
            trace.append({"cycle": cycle + 1, "rows": count, "purged": purged, "insert_s": round(insert_s, 1),
                          "purge_s": round(purge_s, 2), "vacuum_s": vacuum_s, **sizes})  # fmt: skip
            log(f"  {regime} cycle {cycle + 1}: {trace[-1]}")
        out[regime] = trace
        conn.execute(f"ALTER TABLE {TABLE} RESET (autovacuum_enabled)")
    # The no-vacuum run's index after one VACUUM: is the space reused, or does it take a REINDEX?
    result["churn"] = out


# --- Main -----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--scopes", type=int, default=100)
    parser.add_argument("--queries-per-scope", type=int, default=30, help="per plan, for the per-scope figures")
    parser.add_argument("--search-queries", type=int, default=3000, help="through search(), per traffic spread")
    parser.add_argument("--single-inserts", type=int, default=1000)
    parser.add_argument("--churn-batch", type=int, default=10_000)
    parser.add_argument("--churn-lifetime", type=int, default=10, help="cycles an entry lives")
    parser.add_argument("--churn-cycles", type=int, default=15, help="cycles after the live set is full")
    parser.add_argument("--maintenance-work-mem", default="1GB", help="for the index builds only")
    parser.add_argument("--parallel-workers", type=int, default=1, help="max_parallel_maintenance_workers")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--relevant-similarity",
        type=float,
        default=0.90,
        help="recall is counted over the exact neighbours at least this similar",
    )
    parser.add_argument("--exact-max-entries", type=int, help="the plan threshold search() runs with")
    parser.add_argument("--skip", nargs="*", default=[], choices=["plans", "search", "writes", "churn"])
    parser.add_argument("--keep", action="store_true", help="keep the scratch database (then --reuse)")
    parser.add_argument("--reuse", action="store_true", help="reuse a kept scratch database (same arguments)")
    args = parser.parse_args()

    # Django on the scratch database and a Redis namespace of its own, before anything imports settings.
    os.environ["DATABASE_URL"] = admin_dsn(SCRATCH_DB)
    os.environ["REDIS_NAMESPACE"] = "semcache-bench"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.db import connections

    assert settings.DATABASES["default"]["NAME"] == SCRATCH_DB, "refusing to run on any other database"

    usage = shutil.disk_usage(ROOT)
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "disk_free_gb_at_start": round(usage.free / 2**30, 1),
            "load_average_at_start": os.getloadavg(),
        },
        "arguments": vars(args),
    }
    log(f"disk free: {usage.free / 2**30:.1f} GiB")
    corpus = Corpus.make(entries=args.entries, scopes=args.scopes, seed=args.seed)
    if not args.reuse:
        create_scratch(args)
    # Autocommit, like Django's: search_rows' SET LOCAL lines must not outlive their statement.
    conn = psycopg.connect(admin_dsn(SCRATCH_DB), autocommit=True, cursor_factory=psycopg.ClientCursor)
    register_vector(conn)
    set_json_dumps(lambda obj: orjson.dumps(obj).decode(), context=conn)
    result["server"] = {
        name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
        for name in ("server_version", "shared_buffers", "work_mem", "max_parallel_workers_per_gather")
    }
    pgvector = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    result["server"]["pgvector"] = pgvector[0] if pgvector else None
    try:
        if args.reuse:
            # Seeds are drawn while loading: draw them again without writing.
            for _ in corpus.chunks(20_000):
                pass
        else:
            load(args, corpus, conn, result)
        result["explain"] = explain(conn, corpus, args)
        log(f"plans: {json.dumps(result['explain'], indent=1)}")
        if "plans" not in args.skip:
            measure_plans(args, corpus, conn, result)
        if "search" not in args.skip:
            measure_search(args, corpus, result)
        if "writes" not in args.skip:
            measure_writes(args, corpus, conn, result)
        if "churn" not in args.skip:
            churn(args, corpus, conn, result)
    finally:
        conn.close()
        connections.close_all()
        from core.redis import sync_redis

        sync_redis().delete("semcache-bench:semcache:scope_sizes")
        result["machine"]["load_average_at_end"] = os.getloadavg()
        out = ROOT / "bench" / "results" / f"semantic_cache_lookup-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
        log(f"results: {out}")
        if not args.keep:
            for alias in connections:
                connections[alias].close_pool()  # type: ignore[attr-defined]
            with psycopg.connect(admin_dsn(), autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {SCRATCH_DB} WITH (FORCE)")
            log(f"dropped {SCRATCH_DB}")


if __name__ == "__main__":
    main()
