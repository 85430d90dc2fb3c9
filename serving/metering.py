"""Exactly-once usage metering: every admitted request yields one usage event.

The hand-off is durable and idempotent:

1. On admission (``serving.limits.admit``, the same Lua call that checks and charges
   the limits) the request is written to the in-flight hash (``<ns>:usage:inflight``)
   with this gateway's id. If Redis cannot be reached the request is refused: we do not
   serve what we cannot meter.
2. When it ends (completed, cancelled, disconnected, timed out or failed) one Lua call
   (``serving.limits.settle``) removes it from the hash, returns what it reserved beyond
   what it used, *and* appends the event to the stream (``<ns>:usage``), atomically;
   whoever removes the entry first writes the event, so it is written once. This happens
   before the last bytes go to the client.
3. ``billing.tasks.usage_persist`` reads the stream in a consumer group and inserts
   with ``ON CONFLICT (request_id) DO NOTHING`` before acknowledging, so a replayed
   event is never counted twice and an unacknowledged one is never lost.
4. ``serving.tasks.usage_sweep_lost`` closes in-flight entries whose gateway stopped
   heart-beating (killed mid-request) with the tokens known at admission.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from django.conf import settings

from core import keys
from core.redis import async_redis, sync_redis
from serving import limits, metrics

logger = logging.getLogger(__name__)

GATEWAY_ID = uuid.uuid4().hex


def gateway_key(gateway_id: str) -> str:
    return keys.gateway_heartbeat(gateway_id)


_heartbeats: set[asyncio.AbstractEventLoop] = set()
_pending_writes: set[asyncio.Task[None]] = set()


async def _heartbeat_forever() -> None:
    while True:
        try:
            await async_redis().set(gateway_key(GATEWAY_ID), "1", ex=int(settings.GATEWAY_LOST_AFTER))
        except Exception:
            logger.warning("gateway heartbeat to Redis failed", exc_info=True)
        await asyncio.sleep(settings.GATEWAY_HEARTBEAT_SECONDS)


def ensure_heartbeat() -> None:
    loop = asyncio.get_running_loop()
    if loop not in _heartbeats:
        _heartbeats.add(loop)
        task = loop.create_task(_heartbeat_forever())
        task.add_done_callback(lambda _t: _heartbeats.discard(loop))


@dataclass
class MeteredRequest:
    """One admitted request, from admission to its single usage event."""

    api_key_id: int
    organization_id: int
    model: str
    version: str
    endpoint: str
    prompt_tokens: int
    request_id: uuid.UUID = field(default_factory=uuid.uuid4)
    admitted_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: int | None = None
    finished: bool = False
    _started: float = field(default_factory=time.perf_counter)

    @property
    def id_hex(self) -> str:
        return self.request_id.hex

    def record_usage(self, usage: dict[str, Any] | None) -> None:
        """Take the engine's (cumulative) usage as the truth."""
        if not usage:
            return
        self.prompt_tokens = int(usage.get("prompt_tokens") or self.prompt_tokens)
        self.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0

    def mark_first_token(self) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = int((time.perf_counter() - self._started) * 1000)

    def _fields(self, status_code: int) -> dict[str, str]:
        return {
            "request_id": str(self.request_id),
            "api_key_id": str(self.api_key_id),
            "organization_id": str(self.organization_id),
            "model": self.model,
            "model_version": self.version,
            "endpoint": self.endpoint,
            "prompt_tokens": str(self.prompt_tokens),
            "completion_tokens": str(self.completion_tokens),
            "cached_tokens": str(self.cached_tokens),
            "latency_ms": str(int((time.perf_counter() - self._started) * 1000)),
            "ttft_ms": "" if self.ttft_ms is None else str(self.ttft_ms),
            "status_code": str(status_code),
            "created_at": self.admitted_at.isoformat(),
        }

    def inflight_entry(self) -> dict[str, str]:
        """What the sweeper needs to close this request if this gateway dies."""
        return self._fields(0) | {"gateway": GATEWAY_ID}

    async def finish(self, status_code: int) -> None:
        """Settle the request and write its one usage event (idempotent within the process).

        The write runs as its own task and is shielded, so a client that disconnects
        (cancelling the request's task) while the event is being written cannot stop it.
        """
        if self.finished:
            return
        self.finished = True
        task = asyncio.get_running_loop().create_task(self._write(status_code))
        _pending_writes.add(task)
        task.add_done_callback(_pending_writes.discard)
        await asyncio.shield(task)

    async def _write(self, status_code: int) -> None:
        metrics.IN_FLIGHT.labels(self.model).dec()
        fields = self._fields(status_code)
        used = self.prompt_tokens + self.completion_tokens
        for attempt in range(5):
            try:
                await limits.settle(request_id=fields["request_id"], tokens_used=used, event=fields)
                metrics.USAGE_EVENTS.labels("written").inc()
                break
            except Exception:
                logger.warning("usage settlement failed (attempt %d)", attempt + 1, exc_info=True)
                await asyncio.sleep(0.2 * 2**attempt)
        else:
            metrics.USAGE_EVENTS.labels("deferred_to_sweeper").inc()
        latency = time.perf_counter() - self._started
        labels = (self.model, self.version)
        metrics.REQUESTS.labels(*labels, self.endpoint, str(status_code)).inc()
        metrics.LATENCY.labels(*labels).observe(latency)
        if self.ttft_ms is not None:
            metrics.TTFT.labels(*labels).observe(self.ttft_ms / 1000)
        metrics.TOKENS.labels(*labels, "prompt").inc(self.prompt_tokens)
        metrics.TOKENS.labels(*labels, "completion").inc(self.completion_tokens)


# Recorded for a request whose gateway died before it could finish it.
GATEWAY_LOST = 500


def sweep_lost_requests() -> int:
    """Close in-flight entries whose gateway is gone (or that outlived any request).

    Runs in Celery (sync). Uses the same atomic finish as the gateways, so an entry that a
    gateway finishes at the same moment is still written exactly once.
    """
    client = sync_redis()
    settle = client.register_script(limits.lua_source())
    now = datetime.now(UTC)
    closed = 0
    alive: dict[str, bool] = {}
    for request_id, raw in client.hscan_iter(limits.inflight_key(), count=500):
        try:
            entry = orjson.loads(raw)
            admitted = datetime.fromisoformat(entry["created_at"])
        except (orjson.JSONDecodeError, KeyError, ValueError):
            logger.error("unreadable in-flight entry %r", request_id)
            continue
        age = (now - admitted).total_seconds()
        gateway = str(entry.get("gateway", ""))
        if gateway not in alive:
            alive[gateway] = bool(client.exists(gateway_key(gateway)))
        overdue = age > settings.ENGINE_REQUEST_TIMEOUT + 60
        if not overdue and (alive[gateway] or age < settings.GATEWAY_LOST_AFTER):
            continue
        entry.pop("gateway", None)
        entry.pop("settle", None)
        entry["status_code"] = str(GATEWAY_LOST)
        entry["latency_ms"] = str(int(age * 1000))
        used = int(entry.get("prompt_tokens", 0))
        argv: list[str | int] = ["settle", entry["request_id"], used, limits.spend_micros(used), limits.clock_key()]
        for name, value in entry.items():
            argv += [name, str(value)]
        if settle(keys=[limits.inflight_key(), limits.usage_stream_key()], args=argv):
            closed += 1
            logger.warning("closed request %s left in flight by gateway %s", entry["request_id"], gateway)
    return closed
