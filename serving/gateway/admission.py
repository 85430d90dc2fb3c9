"""A request's place in the ledger: admitted once, settled once, whatever ends it.

The one admission contract of the data plane, shared by the LLM requests
(``serving.llm.call.InferenceCall``) and the predictions (``serving.predict.call.PredictCall``):

- ``admit`` charges the limits and registers the request in flight in one atomic ledger step
  (``billing.ledger.admit``). It runs as a task of its own: a caller cancelled while it is in
  flight (a client that disconnects, a WebSocket cancel) leaves it to finish, and ``settle``
  settles it. A refusal is a ``RateLimited`` (429) with the key's limits; a ledger that cannot
  be reached is a 503 ``limiter_unavailable`` (the admission may have landed: ``settle``
  settles it, a no-op in the ledger when it did not).
- ``settle`` writes the request's usage event exactly once (``ledger.settle_or_defer``:
  retried until Redis is back) after waiting for an admission still in flight.

A batch job's line (``batch=True``) is admitted against the month's budgets only, and its
settlement is left to its batch (``serving.batches``): ``settle`` keeps the event
(``deferred``), which the batch writes once the line's answer is stored, or gives the line
back (``ledger.release``) to run it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from decimal import Decimal

from django.conf import settings

from accounts.grants import KeyGrant
from billing import ledger
from billing.ledger import Headroom, UsageEvent
from billing.outcomes import CLIENT_CLOSED, CLIENT_CLOSED_CODE
from serving.gateway import metrics
from serving.gateway.errors import APIError, EngineUnavailable, RateLimited
from serving.gateway.openai_wire import rate_limit_headers
from serving.gateway.routing import ModelRoute, router

logger = logging.getLogger(__name__)


def rate_limited(refusal: ledger.Refusal) -> RateLimited:
    return RateLimited(
        refusal.message,
        code=refusal.code,
        type="insufficient_quota" if refusal.code == "insufficient_quota" else "rate_limit_exceeded",
        headers={**rate_limit_headers(refusal.headroom), "Retry-After": str(refusal.retry_after)},
    )


def limiter_unavailable(exc: Exception) -> EngineUnavailable:
    logger.error("ledger unavailable: %s", exc)
    return EngineUnavailable(
        "Rate limits and metering are unavailable, so the request was not run. Try again shortly.",
        code="limiter_unavailable",
    )


async def take_request(grant: KeyGrant) -> None:
    """Charge one request to the key's per-minute request buckets outside admission: before a
    costly step (counting a large prompt, reading an upload) or for work that is no inference
    (an upload, a batch's creation). ``RateLimited`` (429) when they are empty, 503 when the
    ledger cannot be reached."""
    try:
        await ledger.take_request(grant)
    except ledger.Refused as refused:
        raise rate_limited(refused.refusal) from None
    except ledger.LedgerUnavailable as exc:
        raise limiter_unavailable(exc) from exc


async def charge_refused(grant: KeyGrant) -> None:
    """Count a request refused after a costly step (its prompt counted, its tensors read) as a
    request, whatever the buckets hold: it cannot be repeated for free. A ledger that cannot be
    reached charges nothing (the refusal stands)."""
    with contextlib.suppress(ledger.LedgerUnavailable):
        await ledger.take_request(grant, force=True)


def model_limit(model: ModelRoute, grant: KeyGrant) -> int:
    """How many requests of the model may be in flight at once (its queue, for back-pressure):
    a share per routable replica, larger for paid keys."""
    replicas = sum(len(router.routable(v)) for v in model.versions)
    paid = grant.tier == "paid"
    per_replica = settings.BACKPRESSURE_PAID_PER_REPLICA if paid else settings.BACKPRESSURE_FREE_PER_REPLICA
    return max(1, replicas) * per_replica


class Admission:
    """One request's admission and settlement (see the module)."""

    __slots__ = ("_task", "admitted", "batch", "deferred", "grant", "maybe_admitted", "model", "rate_limits")

    def __init__(self, grant: KeyGrant, model: ModelRoute, *, batch: bool = False) -> None:
        self.grant = grant
        self.model = model
        self.batch = batch
        self.deferred: UsageEvent | None = None  # a batch line's event, for its batch to write
        self.rate_limits: Headroom | None = None  # the key's limits once admitted
        self.maybe_admitted = False  # the ledger may hold the request (admitted, or outcome unknown)
        self.admitted = False
        self._task: asyncio.Task[Headroom] | None = None

    async def admit(
        self, draft: UsageEvent, *, tokens: int, spend: Decimal, inferences: int = 0, rpm_paid: bool = False
    ) -> Headroom:
        self._task = asyncio.ensure_future(self._admit(draft, tokens, spend, inferences, rpm_paid))
        return await asyncio.shield(self._task)

    async def _admit(self, draft: UsageEvent, tokens: int, spend: Decimal, inferences: int, rpm_paid: bool) -> Headroom:
        self.maybe_admitted = True
        try:
            headroom = await ledger.admit(
                grant=self.grant,
                draft=draft,
                tokens=tokens,
                spend=spend,
                model_limit=model_limit(self.model, self.grant),
                rpm_paid=rpm_paid,
                inferences=inferences,
            )
        except ledger.Refused as refused:
            self.maybe_admitted = False
            raise rate_limited(refused.refusal) from None
        except ledger.LedgerUnavailable as exc:
            raise limiter_unavailable(exc) from exc
        self.admitted = True
        metrics.IN_FLIGHT.labels(self.model.name).inc()
        self.rate_limits = headroom
        return headroom

    async def in_flight_done(self) -> None:
        """Wait for an admission still in flight (refused or failed: its owner handled that)."""
        if self._task is not None and not self._task.done():
            with contextlib.suppress(Exception):
                await self._task

    async def settle(self, event: UsageEvent) -> bool:
        """Write the usage event, once; True when the request was admitted (its metrics are
        the caller's to record), False when the ledger never held it or its admission's
        outcome is unknown (the ledger settles it if it landed)."""
        if not self.maybe_admitted:
            return False
        if self.batch:
            self.deferred = event
            if self.admitted:
                metrics.IN_FLIGHT.labels(event.model).dec()
            return self.admitted
        written = await ledger.settle_or_defer(event, admitted=self.admitted)
        metrics.USAGE_EVENTS.labels("written" if written else "deferred").inc()
        if not self.admitted:
            return False
        metrics.IN_FLIGHT.labels(event.model).dec()
        return True


def status_of(exc: BaseException) -> int:
    if isinstance(exc, APIError):
        return exc.status
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return CLIENT_CLOSED
    return 500


def error_code_of(status: int, exc: BaseException | None = None) -> str:
    """The error code a usage record keeps for a request that ended with ``status``."""
    if status < 400:
        return ""
    if isinstance(exc, APIError) and exc.code:
        return str(exc.code)[: ledger.ERROR_CODE_MAX_LENGTH]
    if status == CLIENT_CLOSED:
        return CLIENT_CLOSED_CODE
    return "server_error" if status >= 500 else "invalid_request"
