"""The semantic cache's request-path lookup at 1M entries: what it adds to a miss (issue 22's
target: at most 15 ms p99), and what finding a would-be hit costs before the embedding.

Since the verifier serves only prompts with the same normalised words, a lookup finds its
candidates by signature (``serving.semcache.signature``: hashes of the word bag and its typo
and joined-word variants, in a GIN-indexed array), not by embedding the query and searching
vectors. This bench loads 1M entries over 100 scopes into a scratch database made with the
project's migrations (the real table, signatures and indexes; the per-bucket HNSW indexes
are dropped and not rebuilt: the lookup does not use them, and they take minutes to build),
then times, per query:

- ``miss``: ``serving.semcache.lookup.lookup`` itself, the function the gateway awaits, for a
  question nobody asked in that scope (signing, the one indexed query through the store's
  guarded worker-thread call, verifying whatever shares a signature): the whole cost a miss
  pays, with no embedding (none is made unless a candidate's words pass);
- ``near``: a stored prompt asked again with a change the verifier accepts (casing and
  punctuation, "please", a misspelt word): signing and ``store.find`` until the candidate's
  words are verified (what a would-be hit costs before its embedding);
- ``sql``: ``store.find_rows`` alone, one round trip from Python, for the same queries.

Prompts are synthetic questions: a question frame and 4-18 words drawn from
``pyspellchecker``'s English word frequencies (Zipf-like, so popular words recur), a quarter
of them from a pool of 20,000 questions every scope is asked (the same text in many scopes:
different signatures, since the scope is hashed in). Vectors are random (the lookup never
compares them unless a candidate's words pass). Scope sizes are log-uniform, ~70 to ~70,000.

    .venv/bin/python bench/semantic_cache_signatures.py                    # 1M entries (~15 min here)
    .venv/bin/python bench/semantic_cache_signatures.py --entries 100000   # a quick run
    .venv/bin/python bench/semantic_cache_signatures.py --paraphrase       # with the paraphrase tier (~25 min)

``--paraphrase`` (issue 39) rebuilds the per-bucket HNSW indexes after the load and times a
miss as the gateway pays it with the paraphrase tier on: the signature lookup, then the
question embedded in process (the cache's local all-MiniLM-L6-v2), the scope's nearest
entries searched (pgvector, exact or HNSW by the scope's size) and those at least
SEMANTIC_CACHE_PARAPHRASE_MIN_SIMILARITY alike scored by the learned verifier. The stored
vectors are random, so a fresh question's neighbours are rarely that similar: ``miss`` is
then the embed-and-search cost, and ``miss_scored`` the same misses with every one of the
SEMANTIC_CACHE_PARAPHRASE_CANDIDATES neighbours scored (the minimum similarity set to -1),
the worst a miss can pay.

``--vectors clustered`` stores vectors drawn around topics instead (the distribution of
bench/semantic_cache_lookup.py: half from topics every scope shares, half from the scope's
own; an entry ~0.75 cosine from its topic), and with ``--paraphrase`` each fresh question,
after being embedded for real (its cost counted), is searched as a new question of its
scope's topics: nearer what a cache of real prompts holds than uniform random vectors, which
give an HNSW walk no neighbourhood to follow. Some misses then have neighbours alike enough
to be scored.

    .venv/bin/python bench/semantic_cache_signatures.py --paraphrase --vectors clustered

Writes bench/results/semantic_cache_signatures-<time>.json; drops the scratch database.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
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

sys.path.insert(0, str(ROOT / "bench"))
from semantic_cache_lookup import ENTRY_NOISE, Corpus, admin_dsn, log, percentiles  # noqa: E402  (shared helpers)

SCRATCH_DB = "semcache_sig_bench"
DIM = 384
TABLE = "serving_cacheentry"
COPY_COLUMNS = (
    "scope, organization_id, model, model_version, embedding, prompt, response, prompt_tokens,"
    " completion_tokens, created_at, expires_at, hit_count, strictness, signatures"
)
COPY_TYPES = ["varchar", "int8", "varchar", "varchar", "vector", "text", "jsonb", "int4", "int4",
              "timestamptz", "timestamptz", "int4", "int2", "int8[]"]  # fmt: skip
FRAMES = ["What is", "How do I", "Can you tell me", "Why does", "Is there", "Where can I find", "When should I",
          "Which", "How many", "Explain"]  # fmt: skip
SHARED_QUESTIONS = 20_000


class Questions:
    """Synthetic English questions (see the module's docstring)."""

    def __init__(self, seed: int) -> None:
        from spellchecker import SpellChecker

        frequencies = SpellChecker().word_frequency.dictionary
        common = sorted(((n, w) for w, n in frequencies.items() if w.isalpha() and len(w) > 2), reverse=True)[:8000]
        self.words = [w for _, w in common]
        weights = 1 / (np.arange(len(self.words)) + 20.0)
        self.weights = (weights / weights.sum()).tolist()
        self.rng = random.Random(seed)
        self.shared = [self.fresh() for _ in range(SHARED_QUESTIONS)]

    def fresh(self) -> str:
        words = self.rng.choices(self.words, weights=self.weights, k=self.rng.randint(4, 18))
        return f"{self.rng.choice(FRAMES)} {' '.join(words)}?"

    def entry(self) -> str:
        return self.rng.choice(self.shared) if self.rng.random() < 0.25 else self.fresh()

    def near(self, prompt: str) -> str:
        """A change the verifier accepts: casing and punctuation, "please", or a misspelt word."""
        how = self.rng.randrange(3)
        if how == 0:
            return prompt.lower().rstrip("?")
        if how == 1:
            return f"{prompt.rstrip('?')}, please?"
        words = prompt.rstrip("?").split()
        long = [i for i, w in enumerate(words) if len(w) >= 5 and w.isalpha()]
        if not long:
            return prompt.lower()
        i = self.rng.choice(long)
        j = self.rng.randrange(1, len(words[i]) - 1)
        words[i] = words[i][:j] + words[i][j + 1 :]  # a letter dropped
        return " ".join(words) + "?"


def load(args: argparse.Namespace, conn: psycopg.Connection[Any], questions: Questions,
         scopes: list[str], sizes: list[int], corpus: Corpus, result: dict[str, Any]) -> None:  # fmt: skip
    from serving.semcache import signature

    definitions = dict(conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s AND indexname <> %s",
        [TABLE, f"{TABLE}_pkey"],
    ).fetchall())  # fmt: skip
    for name in definitions:
        conn.execute(f"DROP INDEX {name}")
    order = [i for i, n in enumerate(sizes) for _ in range(n)]
    questions.rng.shuffle(order)
    rng = np.random.default_rng(args.seed)
    now = datetime.now(UTC)
    response = Jsonb({"message": {"role": "assistant", "content": "An answer."}, "finish_reason": "stop"})
    started = time.perf_counter()
    signing = 0.0
    for start in range(0, len(order), 20_000):
        chunk = order[start : start + 20_000]
        if args.vectors == "clustered":
            vectors = corpus.draw(np.array(chunk), ENTRY_NOISE)
        else:
            vectors = rng.standard_normal((len(chunk), DIM)).astype(np.float32)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        with conn.cursor() as cur, cur.copy(f"COPY {TABLE} ({COPY_COLUMNS}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(COPY_TYPES)
            for scope_id, vector in zip(chunk, vectors, strict=True):
                prompt = questions.entry()
                began = time.perf_counter()
                signed = signature.of_entry(scopes[scope_id], prompt)
                signing += time.perf_counter() - began
                expires = now + timedelta(hours=questions.rng.uniform(2, 24))
                copy.write_row((scopes[scope_id], None, f"bench-model-{scope_id % 10}", "1", vector, prompt,
                                response, 10, 3, now, expires, 0, 0, signed))  # fmt: skip
        done = start + len(chunk)
        if done % 100_000 == 0 or done == len(order):
            log(f"  {done:,} loaded ({time.perf_counter() - started:.0f} s, signing {signing:.0f} s)")
    result["load_seconds"] = round(time.perf_counter() - started, 1)
    result["signing_seconds"] = round(signing, 1)
    builds = {}
    for name, definition in definitions.items():
        if name.startswith("cache_embedding_hnsw") and not args.paraphrase:
            continue
        began = time.perf_counter()
        conn.execute(definition)
        builds[name] = round(time.perf_counter() - began, 1)
    result["index_build_seconds"] = builds
    conn.execute(f"VACUUM (ANALYZE) {TABLE}")
    row = conn.execute(
        f"SELECT pg_table_size('{TABLE}'), pg_relation_size('cache_signatures'), avg(cardinality(signatures))"
        f" FROM {TABLE}"
    ).fetchone()
    assert row is not None
    result["sizes"] = {"table_bytes": row[0], "signature_index_bytes": row[1],
                       "signatures_per_entry": round(float(row[2]), 1)}  # fmt: skip
    log(f"indexes: {builds}; sizes: {result['sizes']}")


def stored_prompts(conn: psycopg.Connection[Any], scopes: list[str]) -> dict[int, list[str]]:
    """Up to 40 stored prompts per scope, to ask again with a change (a sample of the table)."""
    index = {scope: i for i, scope in enumerate(scopes)}
    kept: dict[int, list[str]] = {i: [] for i in range(len(scopes))}
    for scope, prompt in conn.execute(f"SELECT scope, prompt FROM {TABLE} TABLESAMPLE SYSTEM (2) REPEATABLE (7)"):
        if len(kept[index[scope]]) < 40:
            kept[index[scope]].append(prompt)
    return kept


def plan_of(conn: psycopg.Connection[Any], scope: str, text: str) -> str:
    from serving.semcache import signature, store

    params = {"scope": scope, "prompt": text, "signatures": signature.of_query(scope, text),
              "bag": [signature.bag_of(scope, text)], "limit": 8}  # fmt: skip
    with conn.transaction():
        conn.execute("SET LOCAL enable_seqscan = off")
        rows = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS) {store.FIND_SQL}", params).fetchall()
    return "\n".join(r[0] for r in rows)


def measure(args: argparse.Namespace, questions: Questions, scopes: list[str], sizes: list[int],
            kept: dict[int, list[str]], corpus: Corpus, result: dict[str, Any]) -> None:  # fmt: skip
    from django.db import connection

    from serving.semcache import lookup, signature, store
    from serving.semcache.policy import CacheIntent
    from serving.semcache.verify import verify_words

    total = sum(sizes)
    weights = [s / total for s in sizes]
    from django.conf import settings

    samples: dict[str, list[float]] = {"miss": [], "near": [], "sql_miss": [], "sql_near": [], "sign": [],
                                       "miss_scored": []}  # fmt: skip
    served = 0
    candidates: dict[str, list[int]] = {"miss": [], "near": []}
    found_near = 0
    intent = CacheIntent(read=True, write=False)

    unavailable = 0
    plans: dict[str, int] = {"exact": 0, "hnsw": 0}  # the paraphrase tier's search plan, per miss

    if args.paraphrase:
        from serving.semcache import paraphrase

        assert paraphrase.local_models() is not None, (
            "build the cache's local models first: manage.py build_cache_verifier"
        )
        asking = [0]  # the scope of the question being looked up
        if args.vectors == "clustered":
            embed = lookup._embed_query

            async def embed_on_the_topics(text: str) -> list[float]:
                # The question is embedded for real (its cost is the lookup's), and then
                # searched as a new question of its scope's topics, like the stored vectors.
                await embed(text)
                vector: list[float] = corpus.draw(np.array([asking[0]]), ENTRY_NOISE)[0].tolist()
                return vector

            lookup._embed_query = embed_on_the_topics  # the bench's vectors

    async def run() -> None:
        nonlocal found_near, unavailable, served
        minimum = settings.SEMANTIC_CACHE_PARAPHRASE_MIN_SIMILARITY
        for i in range(args.queries):
            scope_id = questions.rng.choices(range(len(scopes)), weights=weights)[0]
            scope = scopes[scope_id]
            if args.paraphrase:
                asking[0] = scope_id
            if i % 2 == 0 or not kept[scope_id]:
                text = questions.fresh()
                # With --paraphrase, every other miss has each of its neighbours scored.
                scored = args.paraphrase and i % 4 == 2
                settings.SEMANTIC_CACHE_PARAPHRASE_MIN_SIMILARITY = -1.0 if scored else minimum
                probe = lookup.CacheProbe(intent=intent, scope=scope, query=text, model="bench",
                                          paraphrases=args.paraphrase)  # fmt: skip
                if args.paraphrase:
                    plans[store.plan_for(await store.scope_size(scope))] += 1
                began = time.perf_counter()
                hit = await lookup.lookup(probe)
                samples["miss_scored" if scored else "miss"].append((time.perf_counter() - began) * 1000)
                served += hit is not None  # a random neighbour the verifier took for a paraphrase
                if store.guard.closed_until:
                    unavailable += 1  # the lookup timed out (a miss all the same)
                    store.guard.reopen()
                kind = "miss"
            else:
                text = questions.near(questions.rng.choice(kept[scope_id]))
                began = time.perf_counter()
                signed, bag = signature.of_query(scope, text), signature.bag_of(scope, text)
                try:
                    found = await store.find(scope=scope, prompt=text, signatures=signed, bag=bag,
                                             limit=lookup.CANDIDATES)  # fmt: skip
                except store.CacheUnavailable:
                    unavailable += 1
                    store.guard.reopen()
                    found = []
                passed = any(verify_words(query=text, cached=f.prompt).ok for f in found)
                samples["near"].append((time.perf_counter() - began) * 1000)
                found_near += passed
                kind = "near"
            began = time.perf_counter()
            signed, bag = signature.of_query(scope, text), signature.bag_of(scope, text)
            samples["sign"].append((time.perf_counter() - began) * 1000)

            candidates[kind].append(await asyncio.to_thread(sql_round_trip, kind, scope, text, signed, bag))

    def sql_round_trip(kind: str, scope: str, text: str, signed: list[int], bag: int) -> int:
        with connection.cursor() as cursor:
            began = time.perf_counter()
            rows = store.find_rows(cursor, scope=scope, prompt=text, signatures=signed, bag=bag,
                                   limit=lookup.CANDIDATES, timeout_ms=5000)  # fmt: skip
            samples[f"sql_{kind}"].append((time.perf_counter() - began) * 1000)
            return len(rows)

    asyncio.run(run())
    result["latency_ms"] = {name: percentiles(values) for name, values in samples.items() if values}
    result["candidates"] = {
        kind: {"mean": round(statistics.fmean(v), 2), "max": max(v), "none": sum(1 for c in v if c == 0)}
        for kind, v in candidates.items()
        if v
    }
    result["near_verified"] = {"found": found_near, "of": len(samples["near"])}
    result["fresh_questions_served"] = served
    result["timed_out"] = unavailable
    result["search_plans"] = plans
    for name, figures in result["latency_ms"].items():
        log(f"{name}: {figures}")
    log(
        f"candidates: {result['candidates']}; near questions verified: {result['near_verified']}; "
        f"timed out: {unavailable}; search plans of the misses: {plans}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--scopes", type=int, default=100)
    parser.add_argument("--queries", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="keep the scratch database (then --reuse)")
    parser.add_argument("--reuse", action="store_true", help="reuse a kept scratch database (same arguments)")
    parser.add_argument("--paraphrase", action="store_true", help="build the HNSW indexes; misses try paraphrases")
    parser.add_argument("--vectors", choices=("random", "clustered"), default="random",
                        help="stored vectors: uniform random, or around topics (as semantic_cache_lookup)")  # fmt: skip
    args = parser.parse_args()

    os.environ["DATABASE_URL"] = admin_dsn(SCRATCH_DB)
    os.environ["REDIS_NAMESPACE"] = "semcache-sig-bench"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connections

    from serving.semcache import store

    assert settings.DATABASES["default"]["NAME"] == SCRATCH_DB, "refusing to run on any other database"
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_at_start": os.getloadavg(),
        },
        "arguments": vars(args),
    }
    if not args.reuse:
        with psycopg.connect(admin_dsn(), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {SCRATCH_DB} WITH (FORCE)")
            admin.execute(f"CREATE DATABASE {SCRATCH_DB}")
        call_command("migrate", verbosity=0)
    rng = np.random.default_rng(args.seed)
    raw = np.logspace(2, 5, args.scopes)
    sizes = np.maximum(1, np.round(raw * args.entries / raw.sum())).astype(int)
    sizes[-1] += args.entries - int(sizes.sum())
    scopes = [rng.bytes(32).hex() for _ in range(args.scopes)]
    questions = Questions(args.seed)
    corpus = Corpus.make(entries=args.entries, scopes=args.scopes, seed=args.seed)
    assert corpus.scopes == scopes, "the same scopes as the lookup bench"
    assert corpus.sizes == [int(s) for s in sizes], "the same scope sizes as the lookup bench"
    conn = psycopg.connect(admin_dsn(SCRATCH_DB), autocommit=True)
    register_vector(conn)
    set_json_dumps(lambda obj: orjson.dumps(obj).decode(), context=conn)
    try:
        if not args.reuse:
            log(f"loading {args.entries:,} entries over {args.scopes} scopes")
            load(args, conn, questions, scopes, [int(s) for s in sizes], corpus, result)
        kept = stored_prompts(conn, scopes)
        # The search plan follows the scope's size as Redis last counted it (a beat task in
        # production): counted now, or every scope would look new (0) and be searched exactly.
        result["scopes_counted"] = store.scope_sizes_refresh()
        # The first lookups after a load read the index from disk: the plan of one cold and
        # one warm lookup is kept, then every lookup is timed.
        largest = scopes[int(np.argmax(sizes))]
        result["plan_cold"] = plan_of(conn, largest, questions.fresh())
        result["plan_warm"] = plan_of(conn, largest, questions.fresh())
        log(f"a lookup's plan (warm):\n{result['plan_warm']}")
        measure(args, questions, scopes, [int(s) for s in sizes], kept, corpus, result)
    finally:
        conn.close()
        connections.close_all()
        result["machine"]["load_average_at_end"] = os.getloadavg()
        out = ROOT / "bench" / "results" / f"semantic_cache_signatures-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
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
