"""Usage persistence: the metering stream (Redis) → UsageRecord rows (PostgreSQL), exactly once.

A consumer group reads the stream; a batch is inserted with ON CONFLICT (request_id) DO
NOTHING and only then acknowledged and deleted. A crash between insert and acknowledge
replays the batch, which the unique request id turns into a no-op. Entries left pending
by a dead consumer are claimed after CLAIM_IDLE_MS. An event that cannot be parsed goes
to a dead-letter stream with the reason, never silently away.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

import redis
from django.db import transaction

from billing.models import ApiKey, BudgetAlert, UsageRecord
from billing.pricing import from_micros
from core import keys
from core.redis import sync_redis

logger = logging.getLogger(__name__)

GROUP = "persisters"
CLAIM_IDLE_MS = 60_000


def stream_key() -> str:
    return keys.usage_stream()


def dead_letter_key() -> str:
    return keys.usage_dead_letters()


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _ensure_group(client: redis.Redis) -> None:
    try:
        client.xgroup_create(stream_key(), GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _text(fields: dict[bytes, bytes], name: str) -> str:
    return fields[name.encode()].decode()


def _int(fields: dict[bytes, bytes], name: str) -> int:
    value = int(fields[name.encode()])
    if value < 0:
        raise ValueError(f"{name} is negative")
    return value


def _optional_int(fields: dict[bytes, bytes], name: str) -> int | None:
    return _int(fields, name) if fields.get(name.encode(), b"") != b"" else None


def parse_event(fields: dict[bytes, bytes]) -> UsageRecord:
    prompt = _int(fields, "prompt_tokens")
    completion = _int(fields, "completion_tokens")
    created_at = datetime.fromisoformat(_text(fields, "created_at"))
    if created_at.tzinfo is None:
        raise ValueError("created_at has no time zone")
    return UsageRecord(
        request_id=uuid.UUID(_text(fields, "request_id")),
        api_key_id=_int(fields, "api_key_id"),
        organization_id=_int(fields, "organization_id"),
        model=_text(fields, "model"),
        model_version=_text(fields, "model_version"),
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=_int(fields, "cached_tokens"),
        total_tokens=prompt + completion,
        latency_ms=_int(fields, "latency_ms"),
        ttft_ms=_optional_int(fields, "ttft_ms"),
        status_code=_int(fields, "status_code"),
        created_at=created_at,
    )


def _dead_letter(client: redis.Redis, entry_id: bytes, fields: dict[bytes, bytes], reason: str) -> None:
    entry: dict[Any, Any] = {**fields, b"reason": reason.encode(), b"source_id": entry_id}
    client.xadd(dead_letter_key(), entry)
    logger.error("usage event %s sent to the dead-letter stream: %s", entry_id, reason)


def _persist_batch(client: redis.Redis, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> int:
    parsed: list[tuple[bytes, dict[bytes, bytes], UsageRecord]] = []
    rejected: list[tuple[bytes, dict[bytes, bytes], str]] = []
    for entry_id, fields in entries:
        try:
            parsed.append((entry_id, fields, parse_event(fields)))
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            rejected.append((entry_id, fields, f"unparseable: {exc!r}"))
    key_ids = {record.api_key_id for _, _, record in parsed}
    known_keys = set(ApiKey.objects.filter(pk__in=key_ids).values_list("pk", flat=True))
    valid: list[UsageRecord] = []
    for entry_id, fields, record in parsed:
        if record.api_key_id in known_keys:
            valid.append(record)
        else:
            rejected.append((entry_id, fields, f"unknown api key {record.api_key_id}"))
    with transaction.atomic():
        UsageRecord.objects.bulk_create(valid, ignore_conflicts=True, batch_size=500)
    for entry_id, fields, reason in rejected:
        _dead_letter(client, entry_id, fields, reason)
    # Acknowledge only after the insert committed: a crash before this line replays the
    # batch, and the unique request id makes the replay a no-op.
    ids = [entry_id for entry_id, _ in entries]
    pipe = client.pipeline(transaction=False)
    pipe.xack(stream_key(), GROUP, *ids)
    pipe.xdel(stream_key(), *ids)
    pipe.execute()
    return len(valid)


def persist_usage_stream(*, batch_size: int = 500, max_batches: int = 50) -> int:
    """Move what is in the stream into UsageRecord rows; returns the events handled."""
    client = sync_redis()
    _ensure_group(client)
    me = consumer_name()
    handled = 0
    # First what dead consumers left pending, then new entries.
    claimed: Any = client.xautoclaim(
        stream_key(), GROUP, me, min_idle_time=CLAIM_IDLE_MS, start_id="0-0", count=batch_size
    )
    stale = [(eid, fields) for eid, fields in claimed[1] if fields]
    if stale:
        handled += _persist_batch(client, stale)
    for _ in range(max_batches):
        response: Any = client.xreadgroup(GROUP, me, {stream_key(): ">"}, count=batch_size)
        if not response:
            break
        entries = [(eid, fields) for eid, fields in response[0][1] if fields]
        if not entries:
            break
        handled += _persist_batch(client, entries)
    return handled


def alerts_stream_key() -> str:
    return keys.budget_alerts()


def persist_budget_alerts(*, batch_size: int = 200) -> int:
    """Budget alerts raised by the limiter (soft thresholds) → BudgetAlert rows, once each."""
    client = sync_redis()
    try:
        client.xgroup_create(alerts_stream_key(), GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    me = consumer_name()
    handled = 0
    for start in ("0", ">"):  # first anything this consumer left pending, then new alerts
        response: Any = client.xreadgroup(GROUP, me, {alerts_stream_key(): start}, count=batch_size)
        entries = [(eid, fields) for eid, fields in (response[0][1] if response else []) if fields]
        for entry_id, fields in entries:
            text = {k.decode(): v.decode() for k, v in fields.items()}
            is_key = text["scope"] == "key"
            limit, used = Decimal(text["limit"]), Decimal(text["used"])
            if text["budget"] == "spend":  # the limiter counts spend in micro-units
                limit, used = from_micros(limit), from_micros(used)
            BudgetAlert.objects.get_or_create(
                organization_id=int(text["org"]),
                api_key_id=int(text["id"]) if is_key else None,
                budget=text["budget"],
                month=text["month"],
                defaults={"threshold_percent": int(text["threshold"]), "limit": limit, "used": used},
            )
            logger.warning("budget alert: %s %s %s %s at %s%%", text["scope"], text["id"], text["budget"],
                           text["month"], text["threshold"])  # fmt: skip
            client.xack(alerts_stream_key(), GROUP, entry_id)
            client.xdel(alerts_stream_key(), entry_id)
            handled += 1
    return handled
