"""One inference request end to end: validate → route → admit → dispatch → relay → meter.

Shared by the REST/SSE views and the WebSocket consumer, which authenticate the key
first (``serving.auth``). ``prepare`` does everything that can refuse a request before it
is admitted (nothing is dispatched or metered for a refused request); ``admit`` charges
the limits (``serving.limits``). Once it succeeds the request is metered exactly once,
whatever happens next.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings
from redis.exceptions import RedisError

from serving import engine, limits, metrics
from serving.auth import KeyGrant
from serving.errors import (
    APIError,
    EngineFailed,
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
)
from serving.limits import RateLimitHeaders
from serving.metering import MeteredRequest, ensure_heartbeat
from serving.routing import ModelRoute, VersionRoute, router
from serving.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, parse_body
from serving.tokens import PromptCounter, prompt_counter

logger = logging.getLogger(__name__)

# Status recorded for a request whose client went away before it finished (nginx's convention).
CLIENT_CLOSED = 499


@dataclass(frozen=True)
class Endpoint:
    name: str
    path: str  # on the engine
    schema: type[ChatCompletionRequest | CompletionRequest | EmbeddingRequest]
    tasks: frozenset[str]
    id_prefix: str


CHAT = Endpoint("chat", "/v1/chat/completions", ChatCompletionRequest, frozenset({"chat"}), "chatcmpl-")
COMPLETIONS = Endpoint("completions", "/v1/completions", CompletionRequest, frozenset({"chat", "completion"}), "cmpl-")
EMBEDDINGS = Endpoint("embeddings", "/v1/embeddings", EmbeddingRequest, frozenset({"embedding"}), "embd-")


@dataclass
class Prepared:
    """A validated, routed request that has not been admitted yet."""

    endpoint: Endpoint
    grant: KeyGrant
    body: ChatCompletionRequest | CompletionRequest | EmbeddingRequest
    payload: dict[str, Any]
    model: ModelRoute
    version: VersionRoute
    metered: MeteredRequest
    reserved_tokens: int
    rate_limits: RateLimitHeaders | None = None

    @property
    def stream(self) -> bool:
        return bool(getattr(self.body, "stream", False))

    @property
    def wants_usage(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest | CompletionRequest) and self.body.wants_usage

    @property
    def public_id(self) -> str:
        return self.endpoint.id_prefix + self.metered.id_hex


_loaded_counters: set[str | None] = set()


async def _counter(version: VersionRoute) -> PromptCounter:
    directory = version.tokenizer_dir
    if directory in _loaded_counters:
        return prompt_counter(directory)
    # First use in this process: loading a tokenizer takes ~100 ms, keep it off the loop.
    counter = await sync_to_async(prompt_counter, thread_sensitive=False)(directory)
    _loaded_counters.add(directory)
    return counter


def _check_context(body: Any, prompt_tokens: int, max_len: int) -> None:
    limit = getattr(body, "completion_limit", None)
    if limit is not None and limit > max_len:
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise InvalidRequest(
            f"'{param}' is too large: {limit}. This model's maximum context length is {max_len} tokens.",
            param=param,
            code="context_length_exceeded",
        )
    requested = prompt_tokens + (limit or 0)
    if prompt_tokens >= max_len or requested > max_len:
        where = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise InvalidRequest(
            f"This model's maximum context length is {max_len} tokens. However, you requested {requested} "
            f"tokens ({prompt_tokens} in the {where}, {limit or 0} in the completion). "
            "Please reduce the length of the prompt or the completion.",
            param=where if isinstance(body, ChatCompletionRequest | CompletionRequest) else "input",
            code="context_length_exceeded",
        )


async def prepare(endpoint: Endpoint, raw_body: bytes, grant: KeyGrant, *, request_id: uuid.UUID) -> Prepared:
    body, data = parse_body(raw_body, endpoint.schema)
    table = await router.snapshot()
    model = table.models.get(body.model)
    if model is None:
        model = (await router.fresh_snapshot()).models.get(body.model)
    if model is None:
        raise ModelNotFound(body.model)
    if not grant.may_use(body.model):
        raise ModelNotAllowed(body.model)
    if model.task not in endpoint.tasks:
        raise InvalidRequest(
            f"The model `{model.name}` is a {model.task} model and does not support /v1/{endpoint.name}.",
            param="model",
            code="model_not_supported",
        )
    sticky = getattr(body, "user", None) or f"key:{grant.key_id}"
    version = router.choose_version(model, sticky)
    if version is None:
        raise EngineUnavailable(f"No replica of `{model.name}` is ready. Try again shortly.")
    counter = await _counter(version)
    if isinstance(body, ChatCompletionRequest):
        prompt_tokens = counter.count_chat([m.model_dump(exclude_none=True) for m in body.messages])
    elif isinstance(body, CompletionRequest):
        prompt_tokens = counter.count_prompt(body.prompt)
    else:
        prompt_tokens = counter.count_prompt(body.input)
    if isinstance(body, ChatCompletionRequest | CompletionRequest):
        _check_context(body, prompt_tokens, version.max_model_len)
        # Tokens reserved against TPM and budgets: the prompt plus the most it may generate.
        reserved = prompt_tokens + (body.completion_limit or version.max_model_len - prompt_tokens)
    else:
        if isinstance(body.input, str) and prompt_tokens > version.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {version.max_model_len} tokens, "
                f"but the input has {prompt_tokens} tokens.",
                param="input",
                code="context_length_exceeded",
            )
        reserved = prompt_tokens

    payload = dict(data)
    payload["model"] = model.name
    if isinstance(body, ChatCompletionRequest | CompletionRequest) and body.stream:
        # Always ask for usage, cumulative on every chunk: a stream cut short is still
        # metered with the tokens actually produced.
        payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    metered = MeteredRequest(
        api_key_id=grant.key_id,
        organization_id=grant.organization_id,
        model=model.name,
        version=version.version,
        endpoint=endpoint.name,
        prompt_tokens=prompt_tokens,
        request_id=request_id,
    )
    return Prepared(endpoint, grant, body, payload, model, version, metered, reserved)


async def admit(prepared: Prepared) -> RateLimitHeaders:
    """Charge the limits and register the request in flight, in one atomic step.

    Raises RateLimited (429) when a limit, budget or the model's queue refuses it. From
    here on the request is metered exactly once.
    """
    metered = prepared.metered
    ensure_heartbeat()
    replicas = sum(len(router.routable(v)) for v in prepared.model.versions)
    if prepared.grant.tier == "paid":
        per_replica = settings.BACKPRESSURE_PAID_PER_REPLICA
    else:
        per_replica = settings.BACKPRESSURE_FREE_PER_REPLICA
    try:
        headers = await limits.admit(
            grant=prepared.grant,
            request_id=str(metered.request_id),
            tokens=prepared.reserved_tokens,
            entry=metered.inflight_entry(),
            model_key=limits.model_queue_key(prepared.model.name),
            model_limit=max(1, replicas) * per_replica,
        )
    except RedisError as exc:
        logger.error("limiter unavailable: %s", exc)
        raise EngineUnavailable(
            "Rate limits and metering are unavailable, so the request was not run. Try again shortly.",
            code="limiter_unavailable",
        ) from exc
    metrics.IN_FLIGHT.labels(metered.model).inc()
    prepared.rate_limits = headers
    return headers


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, APIError):
        return exc.status
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return CLIENT_CLOSED
    return 500


async def run_json(prepared: Prepared) -> dict[str, Any]:
    """A non-streaming request: the engine's JSON answer, with our id and model name."""
    metered = prepared.metered
    status = 200
    replica_id: int | None = None
    try:
        replicas = router.replica_order(prepared.version)
        try:
            async with asyncio.timeout(settings.ENGINE_REQUEST_TIMEOUT):
                if replicas:
                    replica_id = replicas[0].id
                    router.in_flight[replica_id] += 1
                _, data = await engine.post_json(router, replicas, prepared.endpoint.path, prepared.payload)
        except TimeoutError:
            raise EngineTimeout("The engine did not answer in time.") from None
        metered.record_usage(data.get("usage"))
        if prepared.endpoint is not EMBEDDINGS:
            data["id"] = prepared.public_id
        data["model"] = prepared.model.name
        return data
    except BaseException as exc:
        status = _status_of(exc)
        raise
    finally:
        if replica_id is not None:
            router.in_flight[replica_id] -= 1
        await metered.finish(status)


class StreamRelay:
    """A streaming request: ``start()`` dispatches and waits for the first event (errors
    before it become a normal HTTP error); iterating then relays chunks, ending with the
    usage chunk (when asked for) after the usage event is written.
    """

    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared
        self.upstream: engine.EngineStream | None = None
        self.first: Any = None
        self.final_usage_chunk: dict[str, Any] | None = None
        self.failed = False
        self._deadline: float = 0.0

    async def start(self) -> None:
        metered = self.prepared.metered
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + settings.ENGINE_REQUEST_TIMEOUT
        try:
            replicas = router.replica_order(self.prepared.version)
            self.upstream = await engine.open_stream(
                router, replicas, self.prepared.endpoint.path, self.prepared.payload
            )
            router.in_flight[self.upstream.replica.id] += 1
            try:
                async with asyncio.timeout(settings.ENGINE_FIRST_TOKEN_TIMEOUT):
                    self.first = await anext(self.upstream)
            except TimeoutError:
                router.circuits.record_failure(self.upstream.replica.id)
                raise EngineTimeout(
                    f"The engine sent no token within {settings.ENGINE_FIRST_TOKEN_TIMEOUT:g} s."
                ) from None
            except StopAsyncIteration:
                raise EngineFailed("The engine closed the stream without answering.") from None
        except BaseException as exc:
            await self._close()
            await metered.finish(_status_of(exc))
            raise

    async def _close(self) -> None:
        if self.upstream is not None:
            router.in_flight[self.upstream.replica.id] -= 1
            upstream, self.upstream = self.upstream, None
            await upstream.aclose()  # closing the connection makes vLLM abort the sequence

    def _rewrite(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """Our id and model name; usage taken for metering, shown only as the client asked."""
        metered = self.prepared.metered
        usage = event.get("usage")
        if usage:
            metered.record_usage(usage)
            if metered.ttft_ms is None and metered.completion_tokens > 0:
                metered.mark_first_token()
        event["id"] = self.prepared.public_id
        event["model"] = self.prepared.model.name
        if not event.get("choices") and usage is not None:
            # The engine's final usage-only chunk: held back until the event is written.
            self.final_usage_chunk = event
            return None
        if self.prepared.wants_usage:
            event["usage"] = None
        else:
            event.pop("usage", None)
        return event

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Chunks for the client; an ``{"error": ...}`` chunk last if the engine fails."""
        metered = self.prepared.metered
        assert self.upstream is not None, "start() first"
        status = 200
        loop = asyncio.get_running_loop()
        try:
            event = self.first
            while event is not engine.DONE:
                if isinstance(event, dict) and "error" in event:
                    raise engine.engine_error(500, orjson.dumps(event))
                chunk = self._rewrite(event)
                if chunk is not None:
                    yield chunk
                remaining = self._deadline - loop.time()
                if remaining <= 0:
                    raise EngineTimeout("The request took longer than the time limit.")
                try:
                    async with asyncio.timeout(remaining):
                        event = await anext(self.upstream)
                except TimeoutError:
                    raise EngineTimeout("The request took longer than the time limit.") from None
                except StopAsyncIteration:
                    raise EngineFailed("The engine closed the stream before it finished.") from None
        except APIError as exc:
            status = exc.status
            self.failed = True
            await self._close()
            await metered.finish(status)
            yield exc.body()
            return
        except BaseException as exc:
            status = _status_of(exc)
            raise
        finally:
            await self._close()
            await metered.finish(status)
        if self.prepared.wants_usage and self.final_usage_chunk is not None:
            yield self.final_usage_chunk
