"""The batch worker (``serving.tasks.batch_work`` → ``work``): claims lines, runs each through the
interactive request scripts at a low priority and yielding to interactive traffic, stores the answer
before its usage event, gives lines back on failure, and keeps house."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from django.conf import settings
from django.utils import timezone
from redis.exceptions import RedisError

from accounts.grants import KeyGrant
from accounts.models import ApiKey
from billing import ledger
from billing.ledger import UsageEvent
from core import keys
from core.db import run_db
from core.redis import async_redis
from serving.batches.files import files_purge_expired
from serving.batches.lines import (
    Claimed,
    claim,
    expire_due,
    finalize_ready,
    give_back,
    mark_metered,
    reclaim_lost,
    renew_leases,
    runnable_models,
    stop_batch,
    store_answer,
    unmetered,
    validate_one,
)
from serving.batches.services import ENDPOINTS, PREDICT_URL
from serving.batches.webhooks import webhooks_deliver_due
from serving.gateway.admission import status_of
from serving.gateway.errors import APIError
from serving.gateway.routing import find_model, router
from serving.llm.call import InferenceCall
from serving.predict.call import PredictCall
from serving.predict.instances import predict_answer

logger = logging.getLogger(__name__)


# Failures an engine (or the platform) may not repeat: the line is given back and tried again.
RETRYABLE = frozenset({500, 502, 503, 504})


def _grant(api_key_id: int) -> KeyGrant | None:
    """The grant a batch's lines run under, None once its key is revoked or gone (an expired
    key's grant is returned: ``key_stop_reason`` judges it at each line, as time passes)."""
    api_key = ApiKey.objects.select_related("organization").filter(pk=api_key_id).first()
    if api_key is None or not api_key.is_active:
        return None
    return KeyGrant.of(api_key)


def key_stop_reason(grant: KeyGrant | None) -> str:
    """Why a batch's lines may no longer run under this grant ("" while they may): its key was
    revoked, or expired (a rotated key, past its grace period, too), as an interactive request
    with it would be refused."""
    if grant is None:
        return "key_revoked"
    if grant.expires_at is not None and grant.expires_at <= timezone.now():
        return "key_expired"
    return ""


async def _interactive_in_flight(model: str) -> int:
    """Interactive requests of the model in flight on every gateway (the ledger's model queue;
    batch lines never join it)."""
    try:
        return int(await async_redis().zcard(keys.model_queue(model)))
    except RedisError:
        return 0


async def batch_share(model: str) -> int:
    """How many lines of the model a worker may have in flight now: BATCH_SLOTS_PER_REPLICA
    for each routable replica not taken by an interactive request (each interactive request
    in flight on the model takes a replica's share back), and at least BATCH_MIN_SLOTS, so a
    batch under constant interactive load still moves, one line at a time."""
    try:
        route = await find_model(model)
        replicas = sum(len(router.routable(v)) for v in route.versions)
    except APIError:
        return settings.BATCH_MIN_SLOTS  # the lines fail on their own, each with its error
    interactive = _interactive_now[model] = await _interactive_in_flight(model)
    now = time.monotonic()
    if interactive:
        _interactive_seen[model] = now
    elif now - _interactive_seen.get(model, -math.inf) < settings.BATCH_YIELD_SECONDS:
        # Between one interactive request and the next: not a gap to fill with lines that
        # would still be running when the next arrives.
        return settings.BATCH_MIN_SLOTS
    idle = max(0, replicas - interactive)
    return max(settings.BATCH_MIN_SLOTS, settings.BATCH_SLOTS_PER_REPLICA * idle)


# When each model last had interactive requests in flight, and how many it had when last
# looked at, as this worker saw them.
_interactive_seen: dict[str, float] = {}
_interactive_now: dict[str, int] = {}


@dataclass
class Outcome:
    status: int
    response: Any = None
    error: APIError | None = None
    event: UsageEvent | None = None


async def _execute(line: Claimed, grant: KeyGrant) -> Outcome:
    """Run one line through the interactive request script, its settlement left to us."""
    body = {k: v for k, v in line.body.items() if k not in ("stream", "stream_options")}
    if line.endpoint == PREDICT_URL:
        call = PredictCall(grant, line.request_id, batch=True)
        try:
            answer = await predict_answer(call, body)
            return Outcome(200, answer, event=call.deferred_event)
        except BaseException as exc:
            await call.close(status_of(exc))
            if not isinstance(exc, APIError):
                raise
            return Outcome(exc.status, exc.body(), exc, call.deferred_event)
    inference = InferenceCall(ENDPOINTS[line.endpoint], grant, line.request_id, batch=True)
    try:
        data = await inference.run(orjson.dumps(body))
        assert data is not None  # never a stream
        return Outcome(200, data, event=inference.deferred_event)
    except BaseException as exc:
        await inference.close(status_of(exc))
        if not isinstance(exc, APIError):
            raise
        return Outcome(exc.status, exc.body(), exc, inference.deferred_event)


async def _settle(event: UsageEvent) -> None:
    await ledger.settle_or_defer(event)


async def run_line(line: Claimed, grant: KeyGrant | None, *, owner: str) -> None:
    """One attempt of one line, start to end (see the module for the order of writes)."""
    if line.previous_request_id is not None:  # its last attempt's admission, if never given back
        with contextlib.suppress(RedisError):
            await ledger.release(line.previous_request_id)
    if stop := key_stop_reason(grant):
        await run_db(stop_batch, line.batch_id, stop)
        await run_db(give_back, line, owner=owner, failure=False)
        return
    assert grant is not None
    try:
        outcome = await _execute(line, grant)
    except asyncio.CancelledError:  # it yields (interactive requests came) or the worker stops
        await asyncio.shield(_put_back(line, owner=owner))
        raise
    except Exception as exc:  # a defect here must not stop the batch: the line is given back
        logger.exception("batch line %s/%s failed unexpectedly", line.batch_public_id, line.index)
        outcome = Outcome(500, error=APIError(f"The platform failed running this request: {exc}"))
    if outcome.status == 429 and outcome.error is not None and outcome.error.code == "insufficient_quota":
        await run_db(stop_batch, line.batch_id, "insufficient_quota")
        await _put_back(line, owner=owner)
        return
    if outcome.status in RETRYABLE or outcome.status == 429:
        await _release(line)
        error = outcome.error.detail() if outcome.error is not None else None
        await run_db(give_back, line, owner=owner, exhausted_error=error, status_code=outcome.status)
        return
    event = outcome.event
    stored = await run_db(
        store_answer, line, owner=owner, succeeded=outcome.status < 400, status_code=outcome.status,
        response=outcome.response, error=outcome.error.detail() if outcome.error is not None else None, event=event,
    )  # fmt: skip
    if not stored:  # given back meanwhile (our lease ran out): another attempt answers it
        await _release(line)
        return
    if event is not None:
        await _settle(event)
        await run_db(mark_metered, line.line_id)


async def _put_back(line: Claimed, *, owner: str) -> None:
    """Give a line back unrun and uncounted: its attempt's admission released, pending again
    under the same attempt number (the request id of an attempt never admitted twice: the
    ledger's entry is gone, so the next admission is a new one)."""
    await _release(line)
    await run_db(give_back, line, owner=owner, failure=False)


async def _release(line: Claimed) -> None:
    try:
        await ledger.release(line.request_id)
    except RedisError:
        logger.warning("could not release %s; its next attempt will", line.request_id)


async def meter_leftovers() -> int:
    """Write the usage events of answers stored by a worker that died before writing them."""
    rows = await run_db(unmetered)
    for line_id, fields in rows:
        if fields:
            try:
                event = UsageEvent.from_fields(fields)
            except (KeyError, TypeError, ValueError, ArithmeticError):
                # Never written by this code; kept as it is would stop every line behind it.
                logger.error("batch line %s keeps an unreadable usage event %r; not metered", line_id, fields)
            else:
                await _settle(event)
        await run_db(mark_metered, line_id)
    return len(rows)


async def housekeeping() -> None:
    """What any worker does first: give back lost lines, meter leftovers, validate, expire,
    finalize, and delete files past their retention."""

    async def give_back_lost() -> None:
        for request_id in await run_db(reclaim_lost):
            with contextlib.suppress(RedisError):
                await ledger.release(request_id)

    async def validate_all() -> None:
        while await run_db(validate_one):
            pass

    # Each step on its own: one that fails (an outage, a defect) is logged and the others run,
    # and the lines of every batch still run; the next turn tries it again.
    steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        ("give back lost lines", give_back_lost),
        ("meter leftovers", meter_leftovers),
        ("validate", validate_all),
        ("expire", functools.partial(run_db, expire_due)),
        ("finalize", functools.partial(run_db, finalize_ready)),
        ("purge expired files", functools.partial(run_db, files_purge_expired)),
    ]
    for name, step in steps:
        try:
            await step()
        except Exception:
            logger.exception("batch housekeeping: %s failed; the next turn tries again", name)


def deliver_webhooks() -> int:
    """The webhooks due (the batch queue's worker is busy with ``work`` while there are
    batches, so it sends them alongside, in a thread of their own)."""
    try:
        return webhooks_deliver_due(limit=20, budget_seconds=20)
    except Exception:  # a defect or an outage must not stop batch work: the next tick retries
        logger.warning("could not deliver webhooks", exc_info=True)
        return 0


# A run with nothing to do for this long ends (the beat starts one every BATCH_TICK_SECONDS).
IDLE_EXIT_SECONDS = 5.0


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


async def work(*, seconds: float, owner: str | None = None) -> int:
    """Run batch lines for about ``seconds`` (then finish those in flight): the share each
    model gives batch work (``batch_share``), oldest batch first. Returns lines run."""
    owner = owner or worker_id()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    running: dict[str, dict[asyncio.Task[None], float]] = defaultdict(dict)  # by model: task → started
    grants: dict[int, tuple[float, KeyGrant | None]] = {}
    ran = 0
    next_housekeeping = next_renewal = 0.0
    webhooks: asyncio.Future[int] | None = None
    idle_since: float | None = None

    async def grant_of(api_key_id: int) -> KeyGrant | None:
        cached = grants.get(api_key_id)
        if cached is None or loop.time() - cached[0] > settings.API_KEY_CACHE_SECONDS:
            cached = grants[api_key_id] = (loop.time(), await run_db(_grant, api_key_id))
        return cached[1]

    async def watch() -> None:
        # Between the loop's turns (each reads the database): interactive requests arriving on
        # a model with lines in flight are seen within BATCH_YIELD_POLL_SECONDS.
        while True:
            await asyncio.sleep(settings.BATCH_YIELD_POLL_SECONDS)
            for model, tasks in list(running.items()):
                if tasks:
                    _yield_to_interactive(model, tasks, await batch_share(model))

    watcher = asyncio.ensure_future(watch())
    listener = asyncio.ensure_future(listen_for_arrivals(running))
    try:
        while loop.time() < deadline:
            now = loop.time()
            if now >= next_housekeeping:
                await housekeeping()
                next_housekeeping = now + 2.0
                if webhooks is None or webhooks.done():
                    webhooks = asyncio.ensure_future(run_db(deliver_webhooks))
            if now >= next_renewal:
                await run_db(renew_leases, owner=owner)
                next_renewal = now + settings.BATCH_LEASE_SECONDS / 3
            started = 0
            runnable = await run_db(runnable_models)
            for model in {*runnable, *(m for m, tasks in running.items() if tasks)}:
                share = await batch_share(model)
                tasks = running[model]
                _yield_to_interactive(model, tasks, share)
                free = share - len(tasks)
                if model not in runnable or free <= 0:
                    continue
                try:
                    lines = await run_db(claim, batches=runnable[model], owner=owner, limit=free)
                except Exception:  # an outage or a defect: the other models' lines go on
                    logger.exception("could not claim lines of %s; trying again next turn", model)
                    continue
                for line in lines:
                    task = asyncio.ensure_future(run_line(line, await grant_of(line.api_key_id), owner=owner))
                    tasks[task] = loop.time()
                    task.add_done_callback(functools.partial(_forget, tasks))
                    started += 1
            ran += started
            busy = [t for tasks in running.values() for t in tasks]
            if busy:
                idle_since = None
                await asyncio.wait(busy, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
            elif not started:
                if runnable:
                    idle_since = None  # lines waiting for their share (interactive load)
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since > IDLE_EXIT_SECONDS:
                    break  # nothing to run: the next tick (or a new batch) starts another run
                await asyncio.sleep(0.5)
        while busy := [t for tasks in running.values() for t in tasks]:
            await asyncio.wait(busy, timeout=settings.BATCH_LEASE_SECONDS / 3)
            await run_db(renew_leases, owner=owner)
        await housekeeping()
        if webhooks is not None:
            await webhooks
        await run_db(deliver_webhooks)
    finally:
        watcher.cancel()
        listener.cancel()
        left = [task for tasks in running.values() for task in tasks]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)  # each puts its line back
    return ran


def _yield_to_interactive(
    model: str, tasks: dict[asyncio.Task[None], float], share: int, *, arrived: bool = False
) -> None:
    """Interactive requests came (``arrived``: one was just admitted) and the model's lines in
    flight exceed its share: the newest (the least work lost) stop at once, their engine
    requests cancelled, to run again later (``_put_back``: not counted as a failure)."""
    if not settings.BATCH_PREEMPT or not (arrived or _interactive_now.get(model)):
        return
    live = [task for task in tasks if not task.cancelling() and not task.done()]
    for task in sorted(live, key=tasks.__getitem__, reverse=True)[: max(0, len(live) - share)]:
        task.cancel()


async def listen_for_arrivals(running: dict[str, dict[asyncio.Task[None], float]]) -> None:
    """The ledger publishes a model's first interactive request in flight at its admission
    (``keys.model_arrivals_channel``): the model's lines in flight beyond its share stop then,
    before that request reaches an engine, not at the watcher's next look (which is what is
    left while this subscription is down)."""
    while True:
        pubsub = async_redis().pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(keys.model_arrivals_channel())
            async for message in pubsub.listen():
                if message["type"] == "message":
                    model = message["data"].decode()
                    # An interactive request was in flight, whatever the count says by the time
                    # we look (a short one may have ended): the gap after it is not idle either.
                    _interactive_seen[model] = time.monotonic()
                    if tasks := running.get(model):
                        _yield_to_interactive(model, tasks, await batch_share(model), arrived=True)
        except Exception:
            logger.warning("interactive arrivals subscription lost; reconnecting", exc_info=True)
            await asyncio.sleep(1)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]


def _forget(tasks: dict[asyncio.Task[None], float], done: asyncio.Task[None]) -> None:
    tasks.pop(done, None)
