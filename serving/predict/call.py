"""One predict request from tensors to usage event: route → check → cache → admit → run → settle.

The small-model twin of ``serving.llm.call.InferenceCall``, with the same guarantees
through the same parts: the key's grant, the router (A/B weights, canaries, pinned
versions, fallback to the base version), the ledger (RPM, concurrency, spend caps and
budgets; settled exactly once by ``close``, whatever ends the request), replica leases and
circuits, and one usage event per admitted request, metered in inferences (the rows of its
batch dimension) and priced per thousand of them.

Every front end drives it the same way: the Open Inference Protocol over REST
(``serving.predict.views``) and gRPC (``serving.predict.grpc_server``), and the seeds'
``/api/v1/predict`` shapes. A tensor that does not fit the version's signature is refused
(400, naming it) before admission: the model never sees it and nothing is metered, but it
counts as a request against the key's per-minute limit (as a refused prompt does), and a
large body pays that before it is decoded, off the event loop (``take_inputs``). A
deterministic version's answers are kept in the exact result cache (per organisation, by
version and inputs, ``PREDICT_RESULT_CACHE_TTL_SECONDS``); a hit is billed as cached, and an
answer that came from a fallback is never kept under the version that failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any, TypeVar

import numpy as np
from django.conf import settings
from redis.exceptions import RedisError

from accounts.grants import KeyGrant
from billing.ledger import Headroom, UsageEvent
from core import keys
from core.lifecycle import Background, LazyThreadPool
from core.redis import async_redis
from registry.signatures import Signature
from serving.gateway import engine, metrics
from serving.gateway.admission import error_code_of
from serving.gateway.call import Call
from serving.gateway.engine import RawBody
from serving.gateway.errors import (
    APIError,
    EngineFailed,
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
    RateLimited,
)
from serving.gateway.inference_protocol import (
    HEADER_LENGTH,
    BadRequest,
    BadTensor,
    decode_inputs,
    decode_outputs,
    encode_request,
    read_body,
)
from serving.gateway.model_access import find_model_for
from serving.gateway.routing import ModelRoute, VersionRoute, router
from serving.predict.result_cache import result_key
from serving.shadow.traffic import predicted_labels, shadows

logger = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray[Any, Any]]
HIT, MISS = "hit", "miss"
T = TypeVar("T")
# A front end's reading of its body: the protocol's tensors for ``decode_inputs``, and
# whatever else that front end needs from the body (e.g. the outputs it asks for).
Parse = Callable[[Signature], tuple[object, T]]


def is_predict_model(model: ModelRoute) -> bool:
    return any(v.predict for v in model.versions)


# --- what every front end asks of a model (HTTP and gRPC alike) ----------------------------


async def predict_model(grant: KeyGrant, name: str) -> ModelRoute:
    """The small model ``name`` as ``grant`` may see it (one outside its scope does not exist)."""
    model = await find_model_for(grant, name)
    if not is_predict_model(model):
        raise InvalidRequest(f"The model `{name}` is not served over the Open Inference Protocol (it is an LLM).")
    return model


def served_versions(model: ModelRoute, version: str | None) -> list[VersionRoute]:
    """The versions being served (only ``version``, when given); a 404 when none is."""
    versions = [v for v in model.versions if v.signature is not None and version in (None, v.version)]
    if not versions:
        raise APIError(f"The model `{model.name}` has no version `{version}` being served.", status=404)
    return versions


def model_metadata(model: ModelRoute, versions: list[VersionRoute]) -> dict[str, Any]:
    """The protocol's model metadata: its name, the versions served, and the signature."""
    signature = versions[0].signature
    assert signature is not None
    return {
        "name": model.name,
        "versions": [v.version for v in versions],
        "platform": "onnxruntime_onnx",
        "inputs": [spec.as_json() for spec in signature.inputs],
        "outputs": [spec.as_json() for spec in signature.outputs],
    }


def is_ready(versions: list[VersionRoute]) -> bool:
    """A replica of one of ``versions`` can take a request now."""
    return any(router.routable(v) for v in versions)


class PredictCall(Call):
    """A small model's prediction (``serving.gateway.call.Call``). Drive it as ``prepare`` →
    ``take_inputs`` → ``run``; always ``close(status)`` in a ``finally``."""

    def __init__(
        self, grant: KeyGrant, request_id: uuid.UUID, *, endpoint: str = "predict", batch: bool = False
    ) -> None:
        super().__init__(grant, request_id, endpoint_name=endpoint, batch=batch)
        self.endpoint = endpoint
        self.cache = MISS
        self.rows = 0
        self.arrays: Arrays = {}
        self._body: RawBody | None = None  # the inputs as sent to a worker (a shadow copy resends them)

    # --- before admission ---------------------------------------------------------------

    async def prepare(self, model_name: str, *, version: str | None = None, pin_param: str = "version") -> None:
        """Find the model and choose the version that answers (``version`` pins it)."""
        model = await find_model_for(self.grant, model_name)
        if not is_predict_model(model):
            raise InvalidRequest(
                f"The model `{model.name}` is a {model.task} model served by an LLM engine; predict serves "
                "small models (ONNX). Use /v1/chat/completions, /v1/completions or /v1/embeddings.",
                param="model",
                code="model_not_supported",
            )
        chosen = self._choose_version(model, sticky=f"key:{self.grant.key_id}", version=version, pin_param=pin_param)
        if chosen.signature is None:
            raise EngineUnavailable(f"`{model.name}` version `{chosen.version}` has no usable signature.")
        self.model = model
        self.version = chosen
        self.price = self._price_of(chosen)

    @property
    def signature(self) -> Any:
        assert self.version.signature is not None
        return self.version.signature

    async def take_inputs(self, parse: Parse[T], *, size: int) -> T:
        """Read the request's tensors, checked against the chosen version's signature: ``parse``
        turns the front end's body (``size`` bytes) into the protocol's tensors, and returns
        with them what else that front end needs of it (returned here). A 400 naming the
        tensor when one does not fit (``BadTensor``), or saying what is wrong with the body.

        Refused tensors cost the key a request, as the LLM path's refused prompts do
        (``InferenceCall.prepare``): a body over ``PREDICT_DECODE_INLINE_BYTES`` pays its place
        in the per-minute request buckets before it is read (a 429 when they are empty), and is
        read in a worker thread, off the event loop; a request refused after reading is charged
        then. A batch line pays no per-minute limit."""
        signature = self.signature

        def read() -> tuple[Arrays, int, T]:
            inputs, extra = parse(signature)
            arrays, rows = decode_inputs(signature, inputs)
            return arrays, rows, extra

        large = size > settings.PREDICT_DECODE_INLINE_BYTES
        await self._pay_before_reading(large=large)
        async with self._refusals_charged():
            try:
                if large:
                    arrays, rows, extra = await asyncio.get_running_loop().run_in_executor(_decoding_pool.get(), read)
                else:
                    arrays, rows, extra = read()
            except BadTensor as exc:
                raise InvalidRequest(str(exc), param=f"inputs.{exc.tensor}", code="invalid_tensor") from None
            except BadRequest as exc:
                raise InvalidRequest(str(exc), code="invalid_request") from None
        self.arrays, self.rows = arrays, rows
        return extra

    def take_arrays(self, arrays: Arrays, rows: int) -> None:
        """Inputs already decoded (and checked by ``decode_inputs``) by another front end."""
        self.arrays, self.rows = arrays, rows

    # --- the script ------------------------------------------------------------------------

    async def run(self) -> Arrays:
        """Cache, admit, run on a replica (or answer from the cache), settle; the outputs."""
        started = time.perf_counter()
        chosen = self.version
        key = self._cache_key()
        cached = await self._cached(key) if key is not None else None
        looked_up = time.perf_counter()
        await self.admit()
        admitted = time.perf_counter()
        self.stage_ms.update(cache=(looked_up - started) * 1000, admit=(admitted - looked_up) * 1000)
        try:
            if cached is not None:
                self.cache = HIT
                outputs = cached
            else:
                content, header = await self._dispatch()
                outputs = self._outputs(content, header)
                if key is not None and self.version is chosen:  # a fallback's answer is another version's
                    self._remember(key, content, header)
                if self.model.shadow is not None and self._body is not None:
                    shadows.mirror_predict(
                        model=self.model, primary=self.version, request_id=self.request_id,
                        endpoint=self.endpoint[:16], body=self._body, primary_labels=predicted_labels(outputs),
                    )  # fmt: skip
        except BaseException as exc:
            await self.close(self._failed(exc))
            raise
        finally:
            self.stage_ms["engine"] = (time.perf_counter() - admitted) * 1000
        await self.close(200)
        return outputs

    # --- the exact result cache ---------------------------------------------------------

    def _cache_key(self) -> str | None:
        if settings.PREDICT_RESULT_CACHE_TTL_SECONDS <= 0 or not self.model.cache_rules.enabled:
            return None
        return keys.predict_result(
            self.grant.organization_id, result_key(version_id=self.version.id, inputs=self.arrays)
        )

    async def _cached(self, key: str) -> Arrays | None:
        try:
            stored = await async_redis().get(key)
        except RedisError as exc:  # the cache is an optimisation: a miss
            logger.warning("result cache unavailable: %s", exc)
            return None
        if not stored:
            return None
        raw = stored if isinstance(stored, bytes) else str(stored).encode("latin1")
        length, _, content = raw.partition(b":")
        try:
            return self._outputs(content, length.decode() or None)
        except (BadRequest, BadTensor, ValueError):
            return None

    def _remember(self, key: str, content: bytes, header: str | None) -> None:
        value = (header or "").encode() + b":" + content
        _writes.spawn(
            async_redis().set(key, value, ex=settings.PREDICT_RESULT_CACHE_TTL_SECONDS), what="store a predict result"
        )

    # --- admission ------------------------------------------------------------------------

    async def admit(self) -> Headroom:
        """Charge the limits (the inferences it carries) and register the request in flight."""
        spend = self.price.reservation(prompt_tokens=0, output_tokens=0, inferences=self.rows) if self.price else 0
        return await self._admit(tokens=0, spend=Decimal(spend), inferences=self.rows)

    # --- running ---------------------------------------------------------------------------

    async def _dispatch(self) -> tuple[bytes, str | None]:
        body, length = encode_request(self.arrays, self.signature)
        payload = self._body = RawBody(body, {"content-type": "application/octet-stream", HEADER_LENGTH: str(length)})
        replicas = router.replica_order(self.version)
        deadline = asyncio.get_running_loop().time() + settings.PREDICT_REQUEST_TIMEOUT
        for attempt in (1, 2):
            started = time.perf_counter()
            try:
                async with asyncio.timeout_at(deadline + 1.0):
                    self._lease, answer = await engine.dispatch(
                        router, replicas, self._path(), payload, stream=False, first_byte_by=deadline, together=True
                    )
                self._ran = True
                return answer.content, answer.inference_header
            except TimeoutError:
                raise EngineTimeout("The model did not answer in time.") from None
            except RateLimited:
                raise
            except APIError as exc:
                if exc.status == 429:  # the worker's queue is full: back-pressure, not a fault
                    raise RateLimited(exc.message, code="model_queue_full") from None
                if not isinstance(exc, EngineFailed | EngineUnavailable):
                    raise
                fallback = await self._fall_back(exc, started, attempt)
                if fallback is None:
                    raise
                replicas = fallback
        raise AssertionError("unreachable")

    def _path(self) -> str:
        return f"/v2/models/{self.model.name}/versions/{self.version.version}/infer"

    def _may_fall_back_to(self, version: VersionRoute) -> bool:
        return version.signature == self.version.signature  # another's tensors cannot answer these

    def _attempt_event(self, exc: APIError, started: float) -> UsageEvent:
        return self._predict_event(exc.status, error=exc)

    def _outputs(self, content: bytes, header: str | None) -> Arrays:
        try:
            return decode_outputs(self.signature, read_body(content, header))
        except (BadRequest, BadTensor) as exc:
            if self._lease is not None:
                router.record_failure(self._lease.replica.id)
            raise EngineFailed(f"The model's answer could not be read: {exc}") from None

    # --- the end ---------------------------------------------------------------------------

    def _event(self, status: int, *, draft: bool = False) -> UsageEvent:
        return self._predict_event(status, draft=draft)

    def _predict_event(self, status: int, *, draft: bool = False, error: APIError | None = None) -> UsageEvent:
        # A request no worker ran (refused, failed before an answer) is not charged.
        inferences = self.rows if (draft or self._ran or self.cache == HIT) and error is None else 0
        cost = Decimal(0)
        if self.price is not None and inferences:
            cost = self.price.charge(
                prompt=0, completion=0, cached=0, cache_hit=self.cache == HIT, inferences=inferences
            )
        return self._usage_event(
            status,
            cost=cost,
            cache=self.cache,
            error_code=self._error_code(status, draft=draft, error=error),
            inferences=inferences,
        )

    def _error_code(self, status: int, *, draft: bool, error: APIError | None) -> str:
        if error is not None:
            return error_code_of(status, error)
        return "" if draft else (self.error_code or error_code_of(status))

    def _settled(self, event: UsageEvent, status: int) -> None:
        metrics.INFERENCES.labels(event.model, event.model_version, self.cache).inc(event.inferences)


_writes = Background()
# The threads that read large request bodies (``PREDICT_DECODE_THREADS``).
_decoding_pool = LazyThreadPool("predict-decode", lambda: int(settings.PREDICT_DECODE_THREADS))
