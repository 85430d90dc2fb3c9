"""Embeddings for the cache, from an embedding replica through the platform's own engine client.

The platform's own call: routed like any request (healthy replica, fewest in flight,
circuit breaker, the replica's key) but not admitted or metered, since no tenant asked
for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from django.conf import settings

from serving.gateway import engine
from serving.gateway.errors import EngineUnavailable
from serving.gateway.routing import find_model, router


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two embeddings (1 = the same direction; 0 for a zero vector)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return dot / norm if norm else 0.0


async def embed_texts(texts: list[str]) -> list[list[float]]:
    """Unit vectors of ``texts`` from SEMANTIC_CACHE_EMBEDDING_MODEL, in order."""
    model = await find_model(settings.SEMANTIC_CACHE_EMBEDDING_MODEL)
    version = router.choose_version(model, "semantic-cache")
    if version is None:
        raise EngineUnavailable(f"No replica of `{model.name}` is ready to embed for the cache.")
    payload = {"model": model.name, "input": texts, "encoding_format": "float"}
    lease, response = await engine.dispatch(
        router, router.replica_order(version), "/v1/embeddings", payload, stream=False
    )
    async with lease:
        data = engine.parse_json(router, lease.replica, response.content)
    rows = sorted(data.get("data") or [], key=lambda row: int(row.get("index", 0)))
    if len(rows) != len(texts):
        raise ValueError(f"asked for {len(texts)} embeddings, got {len(rows)}")
    return [[float(x) for x in row["embedding"]] for row in rows]
