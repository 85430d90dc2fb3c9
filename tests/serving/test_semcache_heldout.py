"""The semantic cache's decision on sources it was never tuned on (issue 22's targets).

bench/data/semcache_corpus/hand_support.jsonl and hand_knowledge.jsonl were written by
author passes that saw neither the cache's code nor the other sources, and nobody reads
their pairs one by one: the verifier was built on bench_v1 and templated only. Each pair is
embedded with the bundled all-MiniLM-L6-v2 (as the embedding replica embeds), then
``verify`` decides at the configured settings, as the lookup does after its vector search.
The targets: at most 1 % of traps served (the upper end of the 95 % interval at most 2 %),
at least half the should-hit pairs served. This can fail: the verifier of 2026-11-25 served
10.7 % of these traps.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def figures():
    sys.path.insert(0, str(BENCH))
    try:
        sources = importlib.import_module("semantic_cache_sources")
    finally:
        sys.path.remove(str(BENCH))
    pairs = [p for p in sources.load() if p.source in sources.HELD_OUT]
    assert {p.source for p in pairs} == set(sources.HELD_OUT)
    assert not set(sources.HELD_OUT) & set(sources.TUNED)
    return sources.evaluate(pairs, tune=set())["figures"]["held_out"]


def test_the_held_out_sources_are_large_and_cover_every_kind(figures):
    assert figures["trap"]["all"]["n"] >= 700
    assert figures["hit"]["all"]["n"] >= 700
    assert set(figures["trap"]) - {"all"} == {
        "antonym", "negation", "direction", "scope", "entity", "number", "role_swap", "specificity",
    }  # fmt: skip
    assert set(figures["hit"]) - {"all"} == {
        "paraphrase", "spelling", "numeral", "politeness", "typo", "reorder", "request_form", "casing_punctuation",
    }  # fmt: skip


def test_wrong_hits_stay_within_one_percent(figures):
    traps = figures["trap"]["all"]
    assert traps["share"] <= 0.01, traps
    assert traps["high"] <= 0.02, traps
    for kind, entry in figures["trap"].items():
        assert entry["served"] <= max(2, entry["n"] // 50), (kind, entry)  # no kind gets through wholesale


def test_at_least_half_the_same_questions_are_served(figures):
    hits = figures["hit"]["all"]
    assert hits["share"] >= 0.5, hits


@pytest.fixture(scope="module")
def with_paraphrases(cache_verifier):
    """Both tiers on the held-out sources, the two hand_paraphrase ones (paraphrases with other
    words and lookalike traps, 75 % of them reworded) included, at a 1 % bound: each pair decided as
    bench/semantic_cache_paraphrase.py decides it."""
    sys.path.insert(0, str(BENCH))
    try:
        bench = importlib.import_module("semantic_cache_paraphrase")
    finally:
        sys.path.remove(str(BENCH))
    pairs = [p for p in bench.load() if p.source in bench.HELD_OUT]
    assert {p.source for p in pairs} == set(bench.HELD_OUT)
    decided = bench.decide(pairs, (0.01,))
    served = [w or p for w, p in zip(decided["words"], decided["paraphrase"][0.01], strict=True)]
    return bench.figures(pairs, served, bench.styles())


def test_with_the_paraphrase_tier_wrong_hits_stay_within_one_percent(with_paraphrases):
    """The paraphrase tier's bound holds on sources nothing was built or tuned on. (Its target
    of serving half the paraphrases is not met: docs/performance.md.)"""
    held_out = with_paraphrases["held_out"]
    traps = held_out["trap"]["all"]
    assert traps["n"] >= 1000
    assert traps["share"] <= 0.01, traps
    assert traps["high"] <= 0.02, traps
    for kind, entry in held_out["trap"].items():
        assert entry["served"] <= max(2, entry["n"] // 50), (kind, entry)
    # The sources of everyday repeats keep more than half their should-hit pairs served.
    for source in ("hand_support", "hand_knowledge"):
        assert with_paraphrases[source]["hit"]["all"]["share"] >= 0.5, source
