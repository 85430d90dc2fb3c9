"""The request script every kind of call shares: resolve the version, admit, dispatch with a
fallback, settle, record the metrics.

``serving.llm.call.InferenceCall`` (OpenAI's chat, completions and embeddings, streamed or
not, with the semantic cache) and ``serving.predict.call.PredictCall`` (small models' tensors
through the dynamic batcher, with the exact result cache) extend it with what is theirs.
Both are driven as prepare → admit → run, and always ``close(status)`` in a ``finally``
(idempotent; a no-op once settled). A batch job's line runs a call directly
(``serving.batches.worker``): the batch price, no per-minute limits, its settlement left to
its batch (``serving.gateway.admission``).

Once admitted (``billing.ledger``), a request is settled exactly once, by ``close``, whatever
ends it:

- the answer is complete: settled before its last bytes (a stream's usage chunk, ``[DONE]``);
- the engine fails or times out: settled with what it produced and the error status;
- the client goes away or cancels, at any point, even while the admission call is still
  in flight: the owner (``serving.gateway.asgi``, a consumer) calls ``close`` in a ``finally``;
  ``close`` waits for an admission in flight, then settles it as 499 with what was used;
- Redis is unreachable when settling: the ledger keeps retrying until it is back.

The router's in-flight counts change only through a replica's lease (``routing.Lease``: the
engine client takes it; ``close`` releases it, once), so no path leaves a replica counted busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.conf import settings

from accounts.grants import KeyGrant
from billing import ledger
from billing.ledger import Headroom, UsageEvent
from billing.pricing import PriceQuote
from serving.gateway import metrics
from serving.gateway.admission import Admission, charge_refused, error_code_of, status_of, take_request
from serving.gateway.errors import APIError, EngineUnavailable, InvalidRequest
from serving.gateway.routing import Lease, ModelRoute, ReplicaRoute, VersionRoute, router


class Call:
    """One request's life in the ledger and on the replicas, whatever it asks for."""

    model: ModelRoute
    version: VersionRoute

    def __init__(self, grant: KeyGrant, request_id: uuid.UUID, *, endpoint_name: str, batch: bool = False) -> None:
        self.grant = grant
        self.request_id = request_id
        self.endpoint_name = endpoint_name  # what the usage record and the metrics call it
        self.batch = batch
        self.status: int | None = None  # set when settled
        self.error_code = ""  # set when it fails: what the record says of why
        self.price: PriceQuote | None = None
        self.stage_ms: dict[str, float] = {}
        self._pinned = False  # a version pinned by the request: a fallback never changes it
        self._rpm_paid = False  # its request was taken from the per-minute buckets before admission
        self._admission: Admission | None = None  # its place in the ledger, from admit()
        self._ran = False  # a replica accepted the request (answered 2xx)
        self._lease: Lease | None = None  # the replica answering it, held until it ends
        self._closing: asyncio.Task[None] | None = None
        self._started = time.perf_counter()
        self._admitted_at = datetime.now(UTC)

    # --- what a kind of call says of itself ------------------------------------------------

    def _event(self, status: int, *, draft: bool = False) -> UsageEvent:
        """The usage event: as settled, or (``draft``) as the sweeper would settle it if this
        gateway died after admission."""
        raise NotImplementedError

    def _usage_event(
        self,
        status: int,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
        ttft_ms: int | None = None,
        cost: Decimal = Decimal(0),
        **fields: Any,
    ) -> UsageEvent:
        """The request's usage event: who, which version, how long, at which price; ``fields``
        are what the kind of call adds (cache, finish reason, error code, inferences)."""
        return UsageEvent(
            request_id=self.request_id,
            api_key_id=self.grant.key_id,
            organization_id=self.grant.organization_id,
            model=self.model.name,
            model_version=self.version.version,
            endpoint=self.endpoint_name,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
            latency_ms=int((time.perf_counter() - self._started) * 1000),
            ttft_ms=ttft_ms,
            status_code=status,
            created_at=self._admitted_at,
            price_id=self.price.price_id if self.price is not None else None,
            cost=cost,
            batch=self.batch,
            **fields,
        )

    def _attempt_event(self, exc: APIError, started: float) -> UsageEvent:
        """A failed attempt's record (``ledger.note_failed_attempt``): never billed, but its
        version is judged by it."""
        raise NotImplementedError

    def _may_fall_back_to(self, version: VersionRoute) -> bool:
        """Whether another version of the model can answer this request."""
        return True

    def _version_changed(self) -> None:
        """A fallback moved the request to another version (metered as it, at its price)."""

    async def _let_go(self) -> None:
        """Release what a failed attempt held: the next attempt starts clean."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self._ran = False

    async def _release(self) -> None:
        """At the end: release the replica (and whatever else the call holds open)."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _settled(self, event: UsageEvent, status: int) -> None:
        """What a kind of call records once its request is settled, beside the shared metrics."""

    # --- before admission ------------------------------------------------------------------

    def _choose_version(self, model: ModelRoute, *, sticky: str, version: str | None, pin_param: str) -> VersionRoute:
        """The version that answers: ``version`` when the request pins one (a 400 when the
        model does not serve it), else the model's split, sticky by ``sticky``; a 503 when no
        replica of it is ready."""
        if version is not None and not any(v.version == version for v in model.versions):
            raise InvalidRequest(
                f"The model `{model.name}` has no version `{version}` being served.",
                param=pin_param,
                code="model_version_not_found",
            )
        self._pinned = version is not None
        chosen = router.choose_version(model, sticky, version=version)
        if chosen is None:
            which = f"`{model.name}` version `{version}`" if version is not None else f"`{model.name}`"
            raise EngineUnavailable(f"No replica of {which} is ready. Try again shortly.")
        return chosen

    def _price_of(self, version: VersionRoute) -> PriceQuote | None:
        """Charged at the price in effect when the request arrived (its record's created_at)."""
        price = version.price_at(self._admitted_at.timestamp())
        return price.for_batch() if price is not None and self.batch else price

    async def _take_request(self) -> None:
        """Pay this request's place in the key's per-minute request buckets now (429 when they
        are empty); admission then does not charge it again."""
        await take_request(self.grant)
        self._rpm_paid = True

    async def _pay_before_reading(self, *, large: bool) -> None:
        """A large body pays its place in the per-minute request buckets before it is read or
        counted (a second of CPU cannot be repeated for free); a batch line pays no such limit."""
        if large and not self.batch:
            await self._take_request()

    @contextlib.asynccontextmanager
    async def _refusals_charged(self) -> AsyncIterator[None]:
        """A request refused (400) after its body was read or counted still counts as a request."""
        try:
            yield
        except InvalidRequest:
            if not self._rpm_paid and not self.batch:
                await charge_refused(self.grant)
            raise

    # --- admission ---------------------------------------------------------------------------

    async def _admit(self, *, tokens: int, spend: Decimal, inferences: int = 0) -> Headroom:
        """Charge the limits and register the request in flight, in one atomic step
        (``serving.gateway.admission``: a caller cancelled meanwhile leaves it to finish, and
        ``close`` settles it). Raises RateLimited (429) when a limit, budget or the model's
        queue refuses it."""
        self._admission = Admission(self.grant, self.model, batch=self.batch)
        return await self._admission.admit(
            self._event(0, draft=True), tokens=tokens, spend=spend, inferences=inferences, rpm_paid=self._rpm_paid
        )

    @property
    def admitted(self) -> bool:
        """Charged and metered (known for sure once ``close`` has returned)."""
        return self._admission is not None and self._admission.admitted

    @property
    def rate_limits(self) -> Headroom | None:
        """The key's limits once admitted (a cache hit too), for the answer's headers."""
        return self._admission.rate_limits if self._admission is not None else None

    @property
    def deferred_event(self) -> UsageEvent | None:
        """A batch line's usage event, once closed (its batch writes it: ``serving.batches``)."""
        return self._admission.deferred if self._admission is not None else None

    # --- fallback ----------------------------------------------------------------------------

    async def _fall_back(self, exc: APIError, started: float, attempt: int) -> list[ReplicaRoute] | None:
        """After an attempt failed before the client got a byte: let go of what it held, and
        say where the request goes next (once): another routable replica of its version, else,
        unless the request pins its version, the model's base version (when it can answer it).
        None: nowhere, the failure is the answer.

        The failed attempt is recorded against its version (``ledger.note_failed_attempt``),
        never billed, so the canaries and circuits see it while the client sees one answer.
        """
        failed = set(exc.replicas_tried)
        if self._lease is not None:
            failed.add(self._lease.replica.id)
        await self._let_go()
        if attempt > 1 or not settings.ENGINE_FALLBACK:
            return None
        version: VersionRoute | None = self.version
        replicas = [r for r in router.replica_order(self.version) if r.id not in failed]
        if not replicas:
            version = None if self._pinned else router.fallback_version(self.model, self.version)
            if version is not None and not self._may_fall_back_to(version):
                version = None
            replicas = [r for r in router.replica_order(version) if r.id not in failed] if version else []
        if version is None or not replicas:
            return None
        await ledger.note_failed_attempt(self._attempt_event(exc, started))
        metrics.FALLBACKS.labels(self.model.name, self.version.version, version.version, exc.code or "").inc()
        if version is not self.version:
            self.version = version
            self.price = self._price_of(version)
            self._version_changed()
        return replicas

    # --- the end -----------------------------------------------------------------------------

    def _failed(self, exc: BaseException) -> int:
        """Note why the request failed (the first reason counts); returns its status."""
        status = status_of(exc)
        if not self.error_code:
            self.error_code = error_code_of(status, exc)
        return status

    async def close(self, status: int) -> None:
        """Release the replica and settle the request, once.

        Runs as a task of its own and is shielded: an owner cancelled again while closing
        cannot interrupt the settlement. Later calls wait for the first and change nothing.
        """
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._finish(status))
        await asyncio.shield(self._closing)

    async def _finish(self, status: int) -> None:
        admission = self._admission
        if admission is not None:
            await admission.in_flight_done()
        await self._release()
        if admission is None or not admission.maybe_admitted:
            return
        event = self._event(status)
        self.status = status
        if not await admission.settle(event):
            return  # admission outcome unknown: the ledger settles it if it landed
        labels = (event.model, event.model_version)
        metrics.REQUESTS.labels(*labels, self.endpoint_name, str(status)).inc()
        metrics.LATENCY.labels(*labels).observe(event.latency_ms / 1000)
        self._settled(event, status)
