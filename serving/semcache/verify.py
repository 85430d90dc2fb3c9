"""The verification stage after similarity: reject near-misses that would change the answer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str  # why it was rejected (for debug logs and metrics), or "" when accepted
    category: str = ""  # negation | swap | number | date | amount | unit | scope | low_similarity | ...


def verify(*, query: str, cached: str, similarity: float) -> Verdict:
    """May ``cached``'s answer be served for ``query`` (the two last user turns, and the
    cosine similarity of their embeddings)? Pure and fast (well under a millisecond)."""
    raise NotImplementedError
