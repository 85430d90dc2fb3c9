"""Usage records written straight to the database, and the ledger's counts for them, for the
rollup, usage and reconciliation tests."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from accounts.models import ApiKey
from billing.models import UsageRecord
from core import keys
from core.redis import sync_redis


def make_record(
    api_key: ApiKey,
    *,
    at: datetime,
    model: str = "m",
    version: str = "1",
    prompt: int = 10,
    completion: int = 5,
    cached: int = 0,
    latency: int = 100,
    ttft: int | None = 20,
    status: int = 200,
    cost: str | Decimal = "0.000001",
    count_in_ledger: bool = False,
    **more: Any,
) -> UsageRecord:
    """A stored request; ``count_in_ledger`` also adds it to the ledger's hourly count, as
    ``settle`` does when it writes the event."""
    record = UsageRecord.objects.create(
        request_id=more.pop("request_id", uuid.uuid4()),
        api_key=api_key,
        organization_id=api_key.organization_id,
        model=model,
        model_version=version,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        total_tokens=prompt + completion,
        latency_ms=latency,
        ttft_ms=ttft,
        status_code=status,
        created_at=at,
        cost=Decimal(cost),
        **more,
    )
    if count_in_ledger:
        count_event(at, api_key_id=api_key.pk)
    return record


def count_event(at: datetime, n: int = 1, *, api_key_id: int | None = None) -> None:
    """What the ledger's settle adds for an event of a request admitted at ``at`` (and, for
    the per-key count, its key)."""
    counts = keys.usage_counts(at.astimezone(UTC).strftime("%Y%m%d%H"))
    sync_redis().hincrby(counts, "events", n)
    if api_key_id is not None:
        sync_redis().hincrby(counts, f"key:{api_key_id}", n)


def forget_counts(*hours: datetime) -> None:
    sync_redis().delete(*(keys.usage_counts(h.astimezone(UTC).strftime("%Y%m%d%H")) for h in hours))
