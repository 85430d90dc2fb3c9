"""Usage persistence: the metering stream (Redis) → UsageRecord rows (PostgreSQL), exactly
once; and the limiter's budget alerts → BudgetAlert rows.

A consumer group reads the stream; a batch is inserted with ON CONFLICT (request_id) DO
NOTHING and only then acknowledged and deleted. A crash between insert and acknowledge
replays the batch, which the unique request id turns into a no-op. Entries left pending
(by a dead consumer, or after a failure) are claimed again after
PERSIST_RETRY_AFTER_SECONDS; a batch a run read and could not store because PostgreSQL or
Redis failed under it is read again by the next run of the same process, at once.

Poison entries never block the others. An event that cannot be parsed goes to the
dead-letter stream at once, with the reason. An entry that parses but fails on its own
(the database refuses the row, its key does not exist) stays pending and is retried; when
the stream has delivered it PERSIST_MAX_DELIVERIES times (its pending entry's delivery
count, raised by every XREADGROUP and XAUTOCLAIM), it is parked in the dead-letter stream
with the reason and acknowledged. When the database or Redis itself fails, nothing is
parked: the run stops and every entry is retried later.

Usage and budget alerts are separate consumers run by separate tasks (billing/tasks.py),
so a bad alert can never hold up the usage that invoices are made from. Both run on the
metering queue; new alerts are emailed by a task of the slow queue, so that a mail server
that hangs never holds up either.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any, TypeVar

import redis
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction

from accounts.models import ApiKey, Organization
from billing.invoicing import CLOSED_STATUSES
from billing.ledger import UsageEvent
from billing.models import BudgetAlert, FailedAttempt, Invoice, UsageRecord
from billing.pricing import from_micros
from billing.signals import budget_alerts_stored
from core import keys
from core.redis import sync_redis

logger = logging.getLogger(__name__)

GROUP = "persisters"
# Failures of the services themselves: retry everything later, park nothing.
_OUTAGES = (OperationalError, InterfaceError, redis.RedisError)

Entry = tuple[bytes, dict[bytes, bytes]]
# An entry that failed, and why.
Failure = tuple[bytes, dict[bytes, bytes], str]
_T = TypeVar("_T")


def stream_key() -> str:
    return keys.usage_stream()


def dead_letter_key() -> str:
    return keys.usage_dead_letters()


def alerts_stream_key() -> str:
    return keys.budget_alerts()


def alerts_dead_letter_key() -> str:
    return keys.budget_alert_dead_letters()


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def max_deliveries() -> int:
    """Deliveries after which an entry that keeps failing is parked (PERSIST_MAX_DELIVERIES)."""
    return max(1, int(settings.PERSIST_MAX_DELIVERIES))


def retry_after_ms() -> int:
    """How long an entry stays pending before it is claimed and tried again."""
    return max(0, int(float(settings.PERSIST_RETRY_AFTER_SECONDS) * 1000))


def _ensure_group(client: redis.Redis, stream: str) -> None:
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


# Streams whose last run in this process stopped half-way (PostgreSQL or Redis failed under
# it): what that run read and did not store is still pending for this consumer.
_unfinished: set[str] = set()


def _own_pending(client: redis.Redis, stream: str, me: str, batch_size: int) -> Iterator[list[Entry]]:
    """This consumer's pending entries, oldest first (XREADGROUP from id 0 re-delivers them)."""
    after: bytes | str = "0"
    while True:
        response: Any = client.xreadgroup(GROUP, me, {stream: after}, count=batch_size)
        entries = response[0][1] if response else []
        if not entries:
            return
        after = entries[-1][0]
        kept = [(eid, fields) for eid, fields in entries if fields]  # deleted while pending: nothing to store
        if kept:
            yield kept


def _batches(client: redis.Redis, stream: str, *, batch_size: int, max_batches: int) -> Iterator[list[Entry]]:
    """What the last run of this process read and left unstored because an outage stopped it
    (at once: never PERSIST_RETRY_AFTER_SECONDS after the outage), what was left pending long
    enough (claimed by this consumer), then new entries."""
    me = consumer_name()
    if stream in _unfinished:
        yield from _own_pending(client, stream, me, batch_size)
    _unfinished.add(stream)  # until this run gets to the end
    claimed: Any = client.xautoclaim(
        stream, GROUP, me, min_idle_time=retry_after_ms(), start_id="0-0", count=batch_size
    )
    # Redis 6.2 answers an entry deleted while pending as (None, None): nothing to store.
    stale = [(eid, fields) for eid, fields in claimed[1] if eid is not None and fields]
    if stale:
        yield stale
    for _ in range(max_batches):
        response: Any = client.xreadgroup(GROUP, me, {stream: ">"}, count=batch_size)
        entries = [(eid, fields) for eid, fields in (response[0][1] if response else []) if fields]
        if not entries:
            break
        yield entries
    _unfinished.discard(stream)


def _acknowledge(client: redis.Redis, stream: str, ids: list[bytes]) -> None:
    if not ids:
        return
    pipe = client.pipeline(transaction=False)
    pipe.xack(stream, GROUP, *ids)
    pipe.xdel(stream, *ids)
    pipe.execute()


def _deliveries(client: redis.Redis, stream: str, entry_id: bytes) -> int:
    """How many times the stream has delivered this pending entry (0 if it is no longer pending)."""
    pending: Any = client.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
    return int(pending[0]["times_delivered"]) if pending else 0


def _park(client: redis.Redis, stream: str, dead_letters: str, failure: Failure, deliveries: int) -> None:
    """Move an entry to its dead-letter stream, with the reason, and take it off the stream."""
    entry_id, fields, reason = failure
    entry: dict[Any, Any] = {
        **fields,
        b"reason": reason.encode(),
        b"source_id": entry_id,
        b"deliveries": str(deliveries).encode(),
    }
    client.xadd(dead_letters, entry)
    _acknowledge(client, stream, [entry_id])
    logger.error("%s entry %s parked in %s after %d deliveries: %s", stream, entry_id, dead_letters, deliveries,
                 reason)  # fmt: skip


def _retry_or_park(client: redis.Redis, stream: str, dead_letters: str, failures: list[Failure]) -> int:
    """Leave failed entries pending for a retry, or park those delivered too often; returns parked."""
    parked = 0
    limit = max_deliveries()
    for failure in failures:
        deliveries = _deliveries(client, stream, failure[0])
        if deliveries >= limit:
            _park(client, stream, dead_letters, failure, deliveries)
            parked += 1
        else:
            logger.warning("%s entry %s failed (delivery %d of %d), retried later: %s", stream, failure[0],
                           deliveries, limit, failure[2])  # fmt: skip
    return parked


def _check_foreign_keys() -> None:
    """PostgreSQL checks foreign keys at commit; check them now, inside the caller's block,
    so that a bad row fails its own savepoint and not the caller's transaction."""
    connection.check_constraints()


def parse_event(fields: dict[bytes, bytes]) -> UsageRecord:
    """A stream entry as a record; the schema is the ledger's ``UsageEvent`` (ValueError/KeyError if not one)."""
    event = UsageEvent.from_fields(fields)
    return UsageRecord(
        request_id=event.request_id,
        api_key_id=event.api_key_id,
        organization_id=event.organization_id,
        model=event.model,
        model_version=event.model_version,
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        cached_tokens=event.cached_tokens,
        total_tokens=event.total_tokens,
        latency_ms=event.latency_ms,
        ttft_ms=event.ttft_ms,
        status_code=event.status_code,
        created_at=event.created_at,
        price_id=event.price_id,
        cost=event.cost,
        cache=event.cache,
        cache_tier=event.cache_tier,
        cache_entry=event.cache_entry,
        finish_reason=event.finish_reason,
        error_code=event.error_code,
        revision=event.revision,
        inferences=event.inferences,
        batch=event.batch,
    )


def _store_each(
    entries: list[tuple[bytes, dict[bytes, bytes], _T]], store: Callable[[_T], object]
) -> tuple[list[bytes], list[Failure]]:
    """Store entries one at a time: (ids stored, failures to retry or park). An outage of
    PostgreSQL or Redis stops the run instead: nothing is parked for it."""
    stored: list[bytes] = []
    failures: list[Failure] = []
    for entry_id, fields, item in entries:
        try:
            store(item)
        except _OUTAGES:
            raise
        except Exception as exc:  # noqa: BLE001 - this entry's own failure: retried, then parked
            failures.append((entry_id, fields, f"not stored: {exc!r}"))
        else:
            stored.append(entry_id)
    return stored, failures


def _insert(records: list[UsageRecord]) -> None:
    """Store first settlements (a replayed one is a no-op) and then corrections, in one transaction."""
    with transaction.atomic():
        UsageRecord.objects.bulk_create([r for r in records if r.revision == 0], ignore_conflicts=True, batch_size=500)
        for correction in (r for r in records if r.revision > 0):
            _correct(correction)
        _check_foreign_keys()


def _correct(record: UsageRecord) -> None:
    """Put a corrected settlement (revision 1: the gateway's own, after the sweeper settled the
    request from its admission draft) in place of the record, on the same invoice. The row is
    replaced, not updated, so its new id makes the rollups rebuild its hour and day. A record
    already on a closed invoice is never changed: the correction fails (and is parked after
    its retries, for a person to bill it). Call inside transaction.atomic."""
    existing = UsageRecord.objects.select_for_update().filter(request_id=record.request_id).first()
    if existing is not None:
        if existing.revision >= record.revision:
            return  # replayed
        invoice = existing.invoice if existing.invoice_id is not None else None
        if invoice is not None and Invoice.Status(invoice.status) in CLOSED_STATUSES:
            raise ValueError(f"request {record.request_id} is already billed on a closed invoice")
        record.invoice_id = existing.invoice_id
        existing.delete()
    record.save(force_insert=True)


def _persist_batch(client: redis.Redis, entries: list[Entry]) -> int:
    """Store a batch, isolating entries that fail; returns the events stored (or already stored)."""
    parsed: list[tuple[bytes, dict[bytes, bytes], UsageRecord]] = []
    failures: list[Failure] = []
    for entry_id, fields in entries:
        try:
            parsed.append((entry_id, fields, parse_event(fields)))
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            # Parsing gives the same answer every time: no point in retrying.
            _park(client, stream_key(), dead_letter_key(), (entry_id, fields, f"unparseable: {exc!r}"), 1)
    key_ids = {record.api_key_id for _, _, record in parsed}
    org_ids = {record.organization_id for _, _, record in parsed}
    known_keys = set(ApiKey.objects.filter(pk__in=key_ids).values_list("pk", flat=True))
    known_orgs = set(Organization.objects.filter(pk__in=org_ids).values_list("pk", flat=True))
    candidates: list[tuple[bytes, dict[bytes, bytes], UsageRecord]] = []
    for entry_id, fields, record in parsed:
        if record.api_key_id not in known_keys:
            failures.append((entry_id, fields, f"unknown api key {record.api_key_id}"))
        elif record.organization_id not in known_orgs:
            failures.append((entry_id, fields, f"unknown organization {record.organization_id}"))
        else:
            candidates.append((entry_id, fields, record))
    stored: list[bytes] = []
    try:
        _insert([record for _, _, record in candidates])
        stored = [entry_id for entry_id, _, _ in candidates]
    except _OUTAGES:
        raise
    except Exception:
        # One bad row fails the whole insert: store the rows one by one to find it.
        logger.warning("a usage batch failed; storing its %d events one by one", len(candidates), exc_info=True)
        stored, one_by_one = _store_each(candidates, lambda record: _insert([record]))
        failures += one_by_one
    # Acknowledge only after the insert committed: a crash before this line replays the
    # batch, and the unique request id makes the replay a no-op.
    _acknowledge(client, stream_key(), stored)
    _retry_or_park(client, stream_key(), dead_letter_key(), failures)
    return len(stored)


def persist_usage_stream(*, batch_size: int = 500, max_batches: int = 50) -> int:
    """Move what is in the usage stream into UsageRecord rows; returns the events stored."""
    client = sync_redis()
    _ensure_group(client, stream_key())
    handled = 0
    for entries in _batches(client, stream_key(), batch_size=batch_size, max_batches=max_batches):
        handled += _persist_batch(client, entries)
    return handled


def _store_attempt(fields: dict[bytes, bytes]) -> None:
    event = UsageEvent.from_fields(fields)
    with transaction.atomic():
        FailedAttempt.objects.bulk_create(
            [
                FailedAttempt(
                    request_id=event.request_id,
                    organization_id=event.organization_id,
                    model=event.model,
                    model_version=event.model_version,
                    endpoint=event.endpoint,
                    status_code=event.status_code,
                    error_code=event.error_code,
                    latency_ms=event.latency_ms,
                    created_at=event.created_at,
                )
            ],
            ignore_conflicts=True,  # a replayed entry
        )
        _check_foreign_keys()


def persist_failed_attempts(*, batch_size: int = 500, max_batches: int = 20) -> int:
    """Engine attempts that failed and were retried elsewhere → FailedAttempt rows (the
    canaries judge versions by them too); each stored on its own, retried, then parked."""
    client = sync_redis()
    stream, dead_letters = keys.failed_attempts(), keys.failed_attempt_dead_letters()
    _ensure_group(client, stream)
    handled = 0
    for entries in _batches(client, stream, batch_size=batch_size, max_batches=max_batches):
        stored, failures = _store_each([(entry_id, fields, fields) for entry_id, fields in entries], _store_attempt)
        _acknowledge(client, stream, stored)
        _retry_or_park(client, stream, dead_letters, failures)
        handled += len(stored)
    return handled


def _store_alert(fields: dict[bytes, bytes]) -> BudgetAlert | None:
    """Store one alert; returns it if it is new (None: this threshold was stored already)."""
    text = {k.decode(): v.decode() for k, v in fields.items()}
    is_key = text["scope"] == "key"
    organization_id = int(text["org"])
    api_key_id = int(text["id"]) if is_key else None
    limit, used = Decimal(text["limit"]), Decimal(text["used"])
    if text["budget"] == "spend":  # the limiter counts spend in micro-units
        limit, used = from_micros(limit), from_micros(used)
    if api_key_id is not None and not ApiKey.objects.filter(pk=api_key_id).exists():
        raise ValueError(f"unknown api key {api_key_id}")
    with transaction.atomic():
        # One row per threshold (50, 80, 100 % and the scope's own): each is its own alert.
        alert, created = BudgetAlert.objects.get_or_create(
            organization_id=organization_id,
            api_key_id=api_key_id,
            budget=text["budget"],
            month=text["month"],
            threshold_percent=int(text["threshold"]),
            defaults={"limit": limit, "used": used},
        )
        _check_foreign_keys()
    logger.warning("budget alert: %s %s %s %s at %s%%", text["scope"], text["id"], text["budget"], text["month"],
                   text["threshold"])  # fmt: skip
    return alert if created else None


def persist_budget_alerts(*, batch_size: int = 200, max_batches: int = 50) -> int:
    """Budget alerts raised by the limiter (soft thresholds) → BudgetAlert rows, one per
    scope, budget, month and threshold, each then emailed once to the organisation.

    Each alert is stored on its own: one that fails is retried, then parked
    (see the module docstring), and never stops the rest of its batch. Emailing is queued
    after the rows are stored, committed and acknowledged: ``billing.signals.budget_alerts_stored``
    announces the run's new alerts, and its receiver in billing.tasks queues one
    ``budget_alerts_email`` for them, on the slow queue (this module never imports the tasks
    that call it). A failing mail server, or a message that never reaches a worker, leaves
    alerts unsent (``notified_at`` empty) for ``billing.tasks.budget_alerts_notify_pending``
    to retry.
    """
    client = sync_redis()
    stream, dead_letters = alerts_stream_key(), alerts_dead_letter_key()
    _ensure_group(client, stream)
    handled = 0
    new_alerts: list[int] = []

    def store(fields: dict[bytes, bytes]) -> None:
        alert = _store_alert(fields)
        if alert is not None:
            new_alerts.append(alert.pk)

    for entries in _batches(client, stream, batch_size=batch_size, max_batches=max_batches):
        stored, failures = _store_each([(entry_id, fields, fields) for entry_id, fields in entries], store)
        _acknowledge(client, stream, stored)
        _retry_or_park(client, stream, dead_letters, failures)
        handled += len(stored)
    if new_alerts:

        def announce() -> None:  # a named function: a robust callback that fails is logged by name
            budget_alerts_stored.send(sender=BudgetAlert, alert_ids=new_alerts)

        # Robust: a broker that refuses the message loses no alert (the retry finds it).
        transaction.on_commit(announce, robust=True)
    return handled
