"""What the predict workers' batchers did, read from their ``/stats`` (the console's version
page): the batcher's settings, the batch sizes formed and why each went, queue depth,
refusals. A replica that does not answer within ``timeout`` is left out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from registry.models import Replica
from registry.replica_keys import replica_api_key


def _stats(replica: Replica, timeout: float) -> dict[str, Any] | None:
    try:
        response = httpx.get(
            f"{replica.endpoint.rstrip('/')}/stats",
            headers={"Authorization": f"Bearer {replica_api_key(replica.pk)}"},
            timeout=timeout,
        )
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    data = response.json()
    return data if isinstance(data, dict) else None


def replica_stats(replicas: list[Replica], *, timeout: float = 1.0) -> dict[int, dict[str, Any]]:
    """Each ready replica's batcher statistics, by replica id (fetched in parallel)."""
    ready = [r for r in replicas if r.state == Replica.State.READY and r.endpoint]
    if not ready:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(ready))) as pool:
        found = list(pool.map(lambda r: _stats(r, timeout), ready))
    return {replica.pk: stats for replica, stats in zip(ready, found, strict=True) if stats is not None}


def batch_histogram(stats: dict[str, Any]) -> list[tuple[int, int, float]]:
    """(batch size, batches, share of the largest count) in size order, for a bar chart."""
    sizes = sorted((int(size), int(count)) for size, count in (stats.get("batch_sizes") or {}).items())
    top = max((count for _, count in sizes), default=0)
    return [(size, count, count / top if top else 0.0) for size, count in sizes]
