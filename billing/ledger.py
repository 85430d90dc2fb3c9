"""The ledger: admit, settle and sweep one request, and the usage event they write, in one place.

Every admitted request is charged against its key's and organisation's limits and budgets
and produces exactly one usage event, however it ends:

1. ``admit`` (one Lua step, ``ledger.lua``, on Redis server time) checks and charges
   requests per minute, tokens per minute (reserved up front), concurrency, the month's
   token quota and spend cap, and the model's queue for the key's tier, and records the
   request in the in-flight hash. It is idempotent: a retried call for the same request
   id (its first reply was lost) charges nothing twice.
2. ``settle`` (one Lua step) removes the request from the hash, returns the unused part
   of its reservation, releases its places, and appends its ``UsageEvent`` to the usage
   stream, atomically; whoever removes the entry writes the event, so it is written once.
   A gateway that cannot reach Redis hands the settlement to ``Settlements``, which keeps
   retrying until Redis is back: nothing is lost and nothing is settled twice.
3. ``sweep_lost_requests`` (Celery) settles, through the same Lua code, the entries of
   gateways that are gone: a gateway is alive while its heartbeat key exists (refreshed by
   a thread, so a busy event loop cannot miss a beat), and is judged dead only after the
   sweeper has seen it missing for GATEWAY_LOST_AFTER on Redis's own clock.

Concurrent admissions (and settlements) of one process travel to Redis together
(``Coalesced``): one script run carries each request's step, exactly as it would run alone.

``billing.usage`` moves the stream into ``UsageRecord`` rows (request id unique). The keys
are named in ``core.keys``; docs/architecture.md, "The ledger", has the whole contract.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson
from django.conf import settings
from redis.asyncio.client import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from accounts.grants import KeyGrant, ScopeLimits
from billing.pricing import micros_up, to_micros
from core import keys
from core.lifecycle import OncePerProcess, PerLoop, Worker, fail_all
from core.redis import async_redis, is_transient, sync_redis

logger = logging.getLogger(__name__)

# This process's identity in the in-flight entries it owns, and its heartbeat key.
GATEWAY_ID = uuid.uuid4().hex

# Status recorded by the sweeper for a request whose gateway died before settling it.
GATEWAY_LOST = 500


# --- The usage event ---------------------------------------------------------------------


@dataclass(frozen=True)
class UsageEvent:
    """What one admitted request consumed: the one record the stream carries per request id.

    On the stream every field is a string (``to_fields``); ``ttft_ms`` is empty when no
    token was produced. ``from_fields`` is the persister's strict reader; fields added
    later (``cache``, ``finish_reason``, ``error_code``, ``revision``, ``inferences``) read as their defaults
    from older entries.
    """

    request_id: uuid.UUID
    api_key_id: int
    organization_id: int
    model: str
    model_version: str
    endpoint: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    latency_ms: int
    ttft_ms: int | None
    status_code: int
    created_at: datetime
    price_id: int | None = None  # the price it was charged at (None: the model had none)
    cost: Decimal = Decimal(0)  # exact, in the billing currency
    cache: str = "miss"  # "hit" or "semantic-hit" when answered from the cache
    # Why generation stopped ("stop", "length", "tool_calls", ...); "" when unknown or not
    # applicable (embeddings, a request that failed or was cut before its answer finished).
    # With several choices: "length" when any was cut by its token limit, else the first's.
    finish_reason: str = ""
    # Why it failed, when it did: the error code its client got (``engine_unavailable``,
    # ``engine_timeout``, the engine's own code for a request it refused, ``client_closed``
    # …); "" for a success. A request no engine ran records 0 tokens and costs nothing.
    error_code: str = ""
    # 0 as first settled; 1 for a settlement that corrects one the sweeper made from the
    # admission draft (the gateway was judged lost, then finished the request after all).
    revision: int = 0
    # The items a predict request carried (rows of its batch dimension): what a small model
    # is metered and priced by. 0 for a token model's request.
    inferences: int = 0
    # A line of a batch job (``serving.batches``): priced at its price's batch percent,
    # billed on lines of its own, never charged to the interactive per-minute limits.
    batch: bool = False
    # A cache hit's tier (exact, same, typo, reordered, paraphrase) and the entry it came from.
    cache_tier: str = ""
    cache_entry: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def hour(self) -> str:
        """The UTC hour it was admitted in, as the ledger's per-hour counters name it."""
        return self.created_at.astimezone(UTC).strftime("%Y%m%d%H")

    def to_fields(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                out[f.name] = ""
            elif isinstance(value, datetime):
                out[f.name] = value.isoformat()
            else:
                out[f.name] = str(value)
        return out

    @classmethod
    def from_fields(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> UsageEvent:
        """Parse a stream entry; ValueError (or KeyError for a missing field) when it is not one."""
        text = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in raw.items()}  # fmt: skip

        def count(name: str) -> int:
            value = int(text[name])
            if value < 0:
                raise ValueError(f"{name} is negative")
            return value

        created_at = datetime.fromisoformat(text["created_at"])
        if created_at.tzinfo is None:
            raise ValueError("created_at has no time zone")
        try:
            cost = Decimal(text.get("cost") or "0")
        except InvalidOperation:
            raise ValueError("cost is not a decimal") from None
        if not cost.is_finite() or cost < 0:
            raise ValueError("cost is not a finite amount of at least 0")
        return cls(
            request_id=uuid.UUID(text["request_id"]),
            api_key_id=count("api_key_id"),
            organization_id=count("organization_id"),
            model=text["model"],
            model_version=text["model_version"],
            endpoint=text.get("endpoint", ""),
            prompt_tokens=count("prompt_tokens"),
            completion_tokens=count("completion_tokens"),
            cached_tokens=count("cached_tokens"),
            latency_ms=count("latency_ms"),
            ttft_ms=count("ttft_ms") if text.get("ttft_ms") else None,
            status_code=count("status_code"),
            created_at=created_at,
            price_id=count("price_id") if text.get("price_id") else None,
            cost=cost,
            cache=_cache_outcome(text.get("cache") or "miss"),
            finish_reason=_finish_reason(text.get("finish_reason") or ""),
            error_code=_error_code(text.get("error_code") or ""),
            revision=count("revision") if text.get("revision") else 0,
            inferences=count("inferences") if text.get("inferences") else 0,
            batch=text.get("batch") == "True",
            cache_tier=_cache_tier(text.get("cache_tier") or ""),
            cache_entry=count("cache_entry") if text.get("cache_entry") else None,
        )


# --- Admission -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    """One limit as a request sees it: its size, what is left, seconds until it is full again."""

    limit: int
    left: int
    reset_seconds: float


@dataclass(frozen=True)
class Headroom:
    """The tightest of the key's and the organisation's per-minute buckets, by dimension
    (None: no such limit). The data plane turns it into its protocol's headers."""

    requests: Bucket | None = None
    tokens: Bucket | None = None
    inferences: Bucket | None = None

    @classmethod
    def from_report(cls, report: list[dict[str, Any]]) -> Headroom:
        found: dict[str, Bucket] = {}
        for dimension, name in (("rpm", "requests"), ("tpm", "tokens"), ("ipm", "inferences")):
            tightest = min((r for r in report if dimension in r), key=lambda r: r[f"{dimension}_left"], default=None)
            if tightest is not None:
                found[name] = Bucket(
                    limit=int(tightest[dimension]),
                    left=max(0, math.floor(tightest[f"{dimension}_left"])),
                    reset_seconds=max(0.0, float(tightest[f"{dimension}_reset"])),
                )
        return cls(**found)


@dataclass(frozen=True)
class Refusal:
    """Why admission said no: ``code`` is OpenAI's (rate_limit_exceeded, request_too_large,
    insufficient_quota) or ``model_overloaded``; ``retry_after`` in whole seconds."""

    code: str
    message: str
    retry_after: int
    headroom: Headroom


class Refused(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class LedgerUnavailable(Exception):
    """Redis could not be reached: nothing may be admitted that cannot be metered."""


_REFUSALS = {
    "request_too_large": "Request too large for the {scope}'s {limit} per minute limit: it needs {requested} "
    "({need}) and the limit is {value}. {advice}",
    "insufficient_quota": "You exceeded the {scope}'s {limit} budget ({value}) for this month. "
    "It resets at the start of next month (UTC).",
    "model_overloaded": "The model is at capacity; {tier}-tier requests are refused first while it is busy. "
    "Retry shortly.",
}


def _cache_outcome(value: str) -> str:
    if value not in ("miss", "hit", "semantic-hit"):
        raise ValueError(f"cache is not miss, hit or semantic-hit: {value!r}")
    return value


# The longest cache tier a usage record keeps (UsageRecord.cache_tier's max_length).
CACHE_TIER_MAX_LENGTH = 12


def _cache_tier(value: str) -> str:
    if value and (len(value) > CACHE_TIER_MAX_LENGTH or not value.replace("-", "").isalpha()):
        raise ValueError(f"cache_tier is not a tier name: {value!r}")
    return value


# The longest finish reason a usage record keeps (UsageRecord.finish_reason's max_length).
FINISH_REASON_MAX_LENGTH = 16


# The longest error code a usage record keeps (UsageRecord.error_code's max_length).
ERROR_CODE_MAX_LENGTH = 40


def _error_code(value: str) -> str:
    if len(value) > ERROR_CODE_MAX_LENGTH:
        raise ValueError(f"error_code is longer than {ERROR_CODE_MAX_LENGTH} characters: {value!r}")
    return value


def _finish_reason(value: str) -> str:
    if len(value) > FINISH_REASON_MAX_LENGTH:
        raise ValueError(f"finish_reason is longer than {FINISH_REASON_MAX_LENGTH} characters: {value!r}")
    return value


def _refusal(result: dict[str, Any], grant: KeyGrant, headroom: Headroom) -> Refusal:
    code = result["code"]
    retry = max(1, math.ceil(result.get("retry", 1)))
    if code == "rate_limit_exceeded":
        what = {
            "requests": "requests per minute", "tokens": "tokens per minute", "inferences": "inferences per minute",
            "concurrency": "concurrent requests",
        }  # fmt: skip
        message = (
            f"Rate limit reached for the {result['scope']}'s {what[result['limit']]} (limit {result['value']})"
            + (f"; this request needs {result['requested']} {result['limit']}" if "requested" in result else "")
            + f". Retry in {retry} s."
        )
    elif code == "request_too_large" and result.get("limit") == "inferences":
        message = _REFUSALS[code].format(need="items in the request", advice="Send fewer items per request.", **result)
    elif code == "request_too_large":
        message = _REFUSALS[code].format(
            need="prompt + max_tokens", advice="Lower max_tokens or shorten the prompt.", **result
        )
    else:
        message = _REFUSALS[code].format(tier=grant.tier, **result)
    return Refusal(code=code, message=message, retry_after=retry, headroom=headroom)


@lru_cache(maxsize=1)
def lua_source() -> str:
    return Path(__file__).with_name("ledger.lua").read_text()


_scripts: dict[int, AsyncScript] = {}


def _script(client: Redis) -> AsyncScript:
    script = _scripts.get(id(client))
    if script is None:
        script = client.register_script(lua_source())
        _scripts[id(client)] = script
    return script


_Item = tuple[list[str], list[str | bytes | int], "asyncio.Future[Any]"]  # a call's keys, arguments, reply


class Coalesced:
    """Concurrent calls of one ledger step (``admit`` or ``settle``), sent to Redis together.

    A call goes at once while fewer than ``IN_FLIGHT`` script runs are on their way; those
    that arrive meanwhile wait and go together as the next script run (``MANY`` in
    ledger.lua, at most ``MAX_ITEMS``), which runs each request's step exactly as it would
    run alone, in order. No timer: a call on
    its own costs what it did, and under load one round trip carries many requests. (The
    two ledger calls per request were measured at about half of a one-process gateway's
    CPU per prediction: bench/predict_suite.py, docs/performance.md.) Each request keeps
    its own reply; a Redis error fails every call of its run, which each caller retries or
    defers as before (both steps are idempotent).
    """

    MAX_ITEMS = 64
    IN_FLIGHT = 2

    def __init__(self, op: str, keys_per_item: int) -> None:
        self.op = op
        self.keys_per_item = keys_per_item
        self._waiting: deque[_Item] = deque()
        self._workers = [Worker(self._drain, name=f"ledger {op}") for _ in range(self.IN_FLIGHT)]

    async def call(self, keys: list[str], args: list[str | bytes | int]) -> Any:
        assert len(keys) == self.keys_per_item
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((keys, args, future))
        for worker in self._workers:
            worker.ensure()
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            batch = [self._waiting.popleft() for _ in range(min(self.MAX_ITEMS, len(self._waiting)))]
            batch_keys: list[str] = []
            argv: list[str | bytes | int] = [self.op, len(batch), self.keys_per_item]
            for item_keys, item_args, _ in batch:
                batch_keys += item_keys
                argv += [len(item_args), *item_args]
            try:
                replies = await _script(async_redis())(keys=batch_keys, args=argv)
            except RedisError as exc:  # each caller judges it as it would its own call's error
                fail_all((future for *_, future in batch), exc)
                continue
            except BaseException as exc:  # a bug, or the loop going away: no caller waits forever
                fail_all((future for *_, future in batch), exc)
                raise
            for (*_, future), reply in zip(batch, replies, strict=True):
                if future.done():
                    continue  # its caller went away; the step ran all the same
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)


_admissions = PerLoop(lambda: Coalesced("admit_many", 2))
_settlements = PerLoop(lambda: Coalesced("settle_many", 4))


def _clock() -> str:
    """Tests move the limiter's clock through a Redis key; production always uses TIME."""
    return keys.limiter_test_clock() if settings.LIMITS_TEST_CLOCK else ""


def _scope_spec(name: str, ident: int, limits: ScopeLimits) -> dict[str, Any]:
    return {
        "name": name,
        "id": ident,
        "p": keys.limit_scope(name, ident),
        "rpm": limits.rpm or 0,
        "tpm": limits.tpm or 0,
        "ipm": limits.ipm or 0,
        "conc": limits.concurrent or 0,
        "quota": limits.token_quota or 0,
        "spend": to_micros(limits.spend_cap),
        "alerts": sorted({*ALERT_THRESHOLDS, limits.alert_percent}),
    }


def _scopes(grant: KeyGrant, *, batch: bool = False) -> list[dict[str, Any]]:
    scopes = [
        _scope_spec("key", grant.key_id, grant.key_limits),
        _scope_spec("org", grant.organization_id, grant.org_limits),
    ]
    if batch:  # a batch line meets the month's budgets only, none of the per-minute limits
        for scope in scopes:
            scope.update(rpm=0, tpm=0, ipm=0, conc=0)
    return scopes


def inflight_entry(draft: UsageEvent) -> dict[str, str]:
    """What the sweeper needs to settle a request whose gateway died: the event so far."""
    return draft.to_fields() | {"gateway": GATEWAY_ID}


# A lost reply is retried this many times; admission is idempotent, so it charges once.
ADMIT_ATTEMPTS = 3
# Budget alerts go out when used + reserved crosses each of these (and the scope's own
# budget_alert_percent), once per scope, budget, month and threshold.
ALERT_THRESHOLDS = (50, 80, 100)


async def admit(
    *,
    grant: KeyGrant,
    draft: UsageEvent,
    tokens: int,
    spend: Decimal,
    model_limit: int,
    rpm_paid: bool = False,
    inferences: int = 0,
) -> Headroom:
    """Check and charge everything for one request and record it in flight, atomically.

    ``draft`` is the usage event as known at admission (status 0); ``tokens`` and
    ``spend`` the reservation (the prompt plus the most it may generate, in tokens and at
    the request's price). Raises ``Refused`` (nothing charged) or ``LedgerUnavailable``;
    in the latter case the admission may have landed, so the caller settles the request
    anyway (a no-op when it did not). ``rpm_paid``: its request was already taken from the
    per-minute buckets (``take_request``), so it is not charged again. ``inferences``: a
    small model's items, charged to the inferences-per-minute buckets (exact at admission,
    never refunded). A batch line's draft (``draft.batch``) is charged to the month's token
    quota and spend cap only, not to any per-minute limit or the model's queue; the sweeper
    leaves its entry to the batch, which gives it back (``release``) or settles it.
    """
    presence.ensure_started()
    batch = draft.batch
    spec = {
        "scopes": _scopes(grant, batch=batch),
        "tokens": tokens,
        "inferences": inferences,
        "spend": micros_up(spend),
        "ttl": int(settings.ENGINE_REQUEST_TIMEOUT) + 60,
        "org": grant.organization_id,
        "model_key": "" if batch else keys.model_queue(draft.model),
        "model": draft.model,
        "arrivals": keys.model_arrivals_channel(),
        "model_limit": model_limit,
        "rpm_paid": rpm_paid,
    }
    argv: list[str | bytes | int] = [
        str(draft.request_id),
        orjson.dumps(spec),
        orjson.dumps(inflight_entry(draft)),
        _clock(),
    ]
    for attempt in range(ADMIT_ATTEMPTS):
        try:
            raw = await _admissions.get().call([keys.inflight_requests(), keys.budget_alerts()], argv)
            break
        except RedisError as exc:
            if attempt == ADMIT_ATTEMPTS - 1:
                raise LedgerUnavailable(str(exc)) from exc
            await asyncio.sleep(0.05 * 2**attempt)
    result = orjson.loads(raw)
    if not result["ok"]:
        raise Refused(_refusal(result, grant, await peek(grant)))
    return Headroom.from_report(result["scopes"])


async def note_failed_attempt(event: UsageEvent) -> None:
    """Record an engine attempt that failed before the request's first byte and was retried
    elsewhere: never billed or limited (the request is, once, as the attempt that answered),
    but the version that failed is judged by it (``rollout.served_requests``). Best effort:
    with Redis away the request still goes on."""
    try:
        await async_redis().xadd(keys.failed_attempts(), event.to_fields())  # type: ignore[arg-type]
    except RedisError as exc:
        logger.warning("failed attempt of %s on %s not recorded: %s", event.request_id, event.model_version, exc)


async def take_request(grant: KeyGrant, *, force: bool = False) -> None:
    """Take one request from the key's and organisation's per-minute request buckets, outside
    admission: before a costly step (counting a large prompt), or for a request refused after
    it (``force``: charge whatever is left and never refuse). Raises ``Refused`` when a
    bucket is empty (not with ``force``), ``LedgerUnavailable`` when Redis cannot be reached."""
    spec = orjson.dumps({"scopes": _scopes(grant)})
    try:
        raw = await _script(async_redis())(keys=[], args=["take", spec, _clock(), "1" if force else ""])
    except RedisError as exc:
        raise LedgerUnavailable(str(exc)) from exc
    result = orjson.loads(raw)
    if not result["ok"]:
        raise Refused(_refusal(result, grant, await peek(grant)))


async def peek(grant: KeyGrant) -> Headroom:
    """The key's buckets as they stand, without charging anything."""
    client = async_redis()
    raw = await _script(client)(keys=[], args=["peek", orjson.dumps({"scopes": _scopes(grant)}), _clock()])
    return Headroom.from_report(orjson.loads(raw)["scopes"])


# --- Settlement ----------------------------------------------------------------------------


def _settle_keys(event: UsageEvent) -> list[str]:
    return [
        keys.inflight_requests(),
        keys.usage_stream(),
        keys.usage_counts(event.hour),
        keys.swept_request(str(event.request_id)),
    ]


def _settle_args(event: UsageEvent, *, sweep: bool = False) -> list[str | bytes | int]:
    argv: list[str | bytes | int] = [
        str(event.request_id), event.total_tokens, micros_up(event.cost), _clock(), "sweep" if sweep else ""
    ]  # fmt: skip
    for name, value in event.to_fields().items():
        argv += [name, value]
    return argv


async def release(request_id: uuid.UUID) -> bool:
    """Give an admitted request back unrun: its reservation returned, its places freed, and no
    usage event (a batch line's attempt that is tried again later under another id). False
    when it is not in flight. Raises RedisError."""
    rid = str(request_id)
    keys_ = [keys.inflight_requests(), keys.usage_stream(), keys.usage_counts("released"), keys.swept_request(rid)]
    return bool(await _script(async_redis())(keys=keys_, args=["settle", rid, 0, 0, _clock(), "release"]))


async def settle(event: UsageEvent) -> bool:
    """Refund, release and write the usage event; False if the request was already settled
    (or never admitted). Raises RedisError: callers that must not lose it use ``Settlements``.

    A request the sweeper settled from its admission draft (its gateway was judged lost, then
    finished it after all) is corrected instead: its budgets take the difference and the event
    is written again as revision 1, which replaces the first record (``billing.usage``)."""
    return bool(await _settlements.get().call(_settle_keys(event), _settle_args(event)))


class Settlements:
    """Settlements this process could not write yet, retried until Redis takes them.

    Settling is idempotent (the in-flight entry is removed once), so a retry after an
    unknown outcome cannot count twice. Memory: every request that was admitted is kept
    until written (admission needs Redis, so no new one joins while it is down). A request
    whose admission's outcome is unknown (the call failed: while Redis is down, every
    request that tries) is kept too, but at most ``UNKNOWN_KEPT`` of them: nearly all of
    them never reached Redis, and one that did is still settled, by the sweeper, when it is
    overdue (``sweep_lost_requests``).
    """

    UNKNOWN_KEPT = 10_000

    def __init__(self) -> None:
        self._pending: deque[UsageEvent] = deque()
        self._unknown: set[uuid.UUID] = set()
        self._worker = Worker(self._drain, name="settlements")
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, event: UsageEvent, *, admitted: bool = True) -> None:
        if not admitted:
            if len(self._unknown) >= self.UNKNOWN_KEPT:
                self.dropped += 1
                logger.warning("settlement of %s (admission unknown) not kept: %d such wait already",
                               event.request_id, len(self._unknown))  # fmt: skip
                return
            self._unknown.add(event.request_id)
        self._pending.append(event)
        self._worker.ensure()

    async def _drain(self) -> None:
        delay = 0.2
        while self._pending:
            event = self._pending[0]
            try:
                await settle(event)
            except Exception as exc:  # the worker never stops while events wait
                if isinstance(exc, RedisError) and not is_transient(exc) and await _park(event, exc):
                    self._unknown.discard(self._pending.popleft().request_id)  # kept where people look
                    continue
                if isinstance(exc, RedisError):
                    logger.warning("settlement of %s still waiting for Redis (%d pending): %s",
                                   event.request_id, len(self._pending), exc)  # fmt: skip
                else:
                    logger.exception("settlement of %s failed unexpectedly; retrying", event.request_id)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            self._unknown.discard(self._pending.popleft().request_id)
            delay = 0.2


settlements = Settlements()


async def settle_or_defer(event: UsageEvent, *, admitted: bool = True) -> bool:
    """Settle now if Redis takes it; otherwise leave it to ``settlements``, which retries until
    it does. True if written now.

    A Redis that is down, or answers with an error that passes (READONLY after a failover,
    MISCONF, OOM, BUSY, NOREPLICAS …: ``core.redis.is_transient``), is waited for. Only a
    refusal that can never succeed (a script error) is parked in the dead-letter stream.
    ``admitted=False``: the admission's outcome is unknown (see ``Settlements``).
    """
    try:
        await settle(event)
        return True
    except RedisError as exc:
        if not is_transient(exc) and await _park(event, exc):
            return False
        logger.warning("usage settlement deferred until Redis takes it: %s", exc)
        settlements.add(event, admitted=admitted)
        return False


async def _park(event: UsageEvent, error: RedisError) -> bool:
    """A settlement Redis refuses for good (a bug, not an outage): keep the event where people
    look. False when it could not be parked either: the caller keeps retrying it."""
    reason = f"settlement refused by Redis: {error}"
    logger.error("%s: %s", reason, event)
    entry: dict[Any, Any] = {**event.to_fields(), "reason": reason}
    try:
        await async_redis().xadd(keys.usage_dead_letters(), entry)
    except RedisError:
        logger.error("could not park usage event %s; it stays pending: %s", event.request_id, event.to_fields())
        return False
    return True


# --- Gateway presence and the sweeper -------------------------------------------------------


class Presence:
    """A gateway's heartbeat key, refreshed by a thread of its own.

    A busy event loop (or one blocked by a slow call) cannot stop the beat, so the sweeper
    never mistakes a live gateway for a dead one because its loop was late.
    """

    def __init__(self, gateway_id: str, *, interval: float | None = None, ttl: float | None = None) -> None:
        self.gateway_id = gateway_id
        self._interval = interval
        self._ttl = ttl
        self._stop = threading.Event()
        self._started = OncePerProcess(
            lambda: threading.Thread(target=self._run, name="gateway-heartbeat", daemon=True).start()
        )

    @property
    def interval(self) -> float:
        return self._interval if self._interval is not None else settings.GATEWAY_HEARTBEAT_SECONDS

    @property
    def ttl(self) -> float:
        return self._ttl if self._ttl is not None else settings.GATEWAY_LOST_AFTER

    def ensure_started(self) -> None:
        self._started.ensure()

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        sync_redis().set(keys.gateway_heartbeat(self.gateway_id), "1", px=max(1000, int(self.ttl * 1000)))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception:  # a heartbeat failure must never end the thread
                logger.warning("gateway heartbeat to Redis failed", exc_info=True)
            self._stop.wait(self.interval)


presence = Presence(GATEWAY_ID)


def sweep_lost_requests() -> int:
    """Settle in-flight entries whose gateway is gone, or that outlived any request.

    Runs in Celery (sync). Ages and absences are measured on Redis's clock, never this
    host's. A gateway whose heartbeat is missing is only *suspected* at first; it is
    judged dead once the sweeper has seen it missing for GATEWAY_LOST_AFTER (a Redis
    restart or a slow beat does not close live requests). Settles with the same Lua code
    as gateways, so a request a gateway settles at the same moment is still written once.
    """
    client = sync_redis()
    script = client.register_script(lua_source())
    now = float(script(keys=[], args=["now"]))
    stored: dict[bytes, bytes] = client.hgetall(keys.gateway_suspects())  # type: ignore[assignment]
    suspects = {k.decode(): float(v) for k, v in stored.items()}
    verdicts: dict[str, bool] = {}  # gateway id → dead
    seen: set[str] = set()
    closed = 0

    def dead(gateway: str) -> bool:
        if gateway in verdicts:
            return verdicts[gateway]
        if client.exists(keys.gateway_heartbeat(gateway)):
            if gateway in suspects:
                client.hdel(keys.gateway_suspects(), gateway)
            verdicts[gateway] = False
        elif gateway not in suspects:
            client.hset(keys.gateway_suspects(), gateway, f"{now:.6f}")
            verdicts[gateway] = False
        else:
            verdicts[gateway] = now - suspects[gateway] >= settings.GATEWAY_LOST_AFTER
        return verdicts[gateway]

    for request_id, raw in client.hscan_iter(keys.inflight_requests(), count=500):
        try:
            entry = orjson.loads(raw)
            draft = UsageEvent.from_fields({k: str(v) for k, v in entry.items() if k not in ("gateway", "settle", "t")})
            admitted = float(entry["t"])
        except (orjson.JSONDecodeError, KeyError, ValueError, TypeError):
            logger.error("unreadable in-flight entry %r", request_id)
            continue
        gateway = str(entry.get("gateway", ""))
        seen.add(gateway)
        if entry.get("batch") == "True":
            continue  # a batch line's: its batch gives it back or settles it (serving.batches)
        age = now - admitted
        overdue = age > settings.ENGINE_REQUEST_TIMEOUT + 60
        if not overdue and not dead(gateway):
            continue
        event = replace(draft, status_code=GATEWAY_LOST, latency_ms=max(0, int(age * 1000)), error_code="gateway_lost")
        if script(keys=_settle_keys(event), args=["settle", *_settle_args(event, sweep=True)]):
            closed += 1
            logger.warning("closed request %s left in flight by gateway %s (age %.0f s)", draft.request_id,
                           gateway, age)  # fmt: skip
    forgotten = [g for g in suspects if g not in seen]
    if forgotten:
        client.hdel(keys.gateway_suspects(), *forgotten)
    return closed
