"""Signatures (serving.semcache.signature): every pair the verifier accepts shares one, so
looking up by signature loses no hit; other questions and other scopes share none."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from serving.semcache import signature
from serving.semcache.verify import verify_words

SCOPE, OTHER_SCOPE = "a" * 64, "b" * 64


def shares(cached: str, query: str, *, scope: str = SCOPE, query_scope: str = SCOPE) -> bool:
    return bool(set(signature.of_entry(scope, cached)) & set(signature.of_query(query_scope, query)))


@pytest.mark.parametrize(
    ("cached", "query"),
    [
        ("What colour is the sky?", "what color is the sky"),  # casing, spelling, punctuation
        ("Can you tell me what the capital of France is, please?", "What is the capital of France?"),  # frame
        ("At sea level, what is the boiling point of water?", "What is the boiling point of water at sea level?"),
        ("How do I reset my password?", "How do I reset my pasword?"),  # the query misspelt
        ("How do I reset my pasword?", "How do I reset my password?"),  # the stored prompt misspelt
        ("Tell me whether I should see a doctor.", "Tell me wehther I should see a doctor."),  # a frame word misspelt
        ("How do I change my e mail address?", "How do I change my email address?"),  # joined words
        ("How do I change my email address?", "How do I change my e mail address?"),
        ("Give me five tips for sleeping better", "give me 5 tips for sleeping better"),
    ],
)
def test_what_the_verifier_accepts_shares_a_signature(cached, query):
    assert verify_words(query=query, cached=cached).ok
    assert shares(cached, query)


@pytest.mark.parametrize(
    ("cached", "query"),
    [
        ("Is the gym open on holidays?", "Is the gym closed on holidays?"),  # two real words: not a typo
        ("How do I reset my password?", "How do I reset my account password?"),
        ("Transfer 50 dollars from savings to current", "Transfer 60 dollars from savings to current"),
    ],
)
def test_another_question_shares_none(cached, query):
    assert not shares(cached, query)


def test_another_scope_shares_none():
    assert shares("What colour is the sky?", "What colour is the sky?")
    assert not shares("What colour is the sky?", "What colour is the sky?", query_scope=OTHER_SCOPE)


def test_the_bag_is_one_of_an_entrys_signatures_and_long_prompts_have_only_it():
    short = "How do I reset my password?"
    assert signature.bag_of(SCOPE, short) in signature.of_entry(SCOPE, short)
    assert signature.bag_of(SCOPE, short) == signature.bag_of(SCOPE, "how do i reset my password")
    long = " ".join(f"word{i} and more" for i in range(40))  # 120 words
    assert signature.of_entry(SCOPE, long) == [signature.bag_of(SCOPE, long)]
    assert signature.of_query(SCOPE, long) == [signature.bag_of(SCOPE, long)]


def test_every_pair_the_verifier_accepts_in_the_corpus_is_found():
    """On every source (only counts, so held-out pairs are not read one by one): an accepted
    pair without a shared signature is a hit the lookup would lose."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import semantic_cache_sources as sources

    accepted = lost = 0
    for pair in sources.load():
        if verify_words(query=pair.b, cached=pair.a).ok:
            accepted += 1
            lost += not shares(pair.a, pair.b)
    assert accepted > 1000
    assert lost == 0, f"{lost} of {accepted} accepted pairs share no signature"
