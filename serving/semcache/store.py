"""Cache entries in PostgreSQL + pgvector: search inside one scope, insert, expire, purge."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Candidate:
    """An unexpired entry of the scope, with its cosine similarity to the query (1 = same)."""

    entry_id: int
    similarity: float
    prompt: str
    response: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int


async def search(*, scope: str, embedding: list[float], limit: int = 4) -> list[Candidate]:
    """The ``limit`` nearest unexpired entries of ``scope``, most similar first."""
    raise NotImplementedError


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
) -> int:
    """Store an answer; returns the entry id."""
    raise NotImplementedError


async def record_hit(*, entry_id: int) -> None:
    """Count a hit on an entry (hit_count, last_hit_at); best effort."""
    raise NotImplementedError


def purge_expired(*, batch_size: int = 5000, max_batches: int = 100) -> int:
    """Delete expired entries in batches; returns how many."""
    raise NotImplementedError
