"""One inference request from body to usage event: prepare → cache → admit → run → settle.

The REST/SSE views and the WebSocket consumer drive the same ``InferenceCall`` through the
same script (``run``), so a fix to the request's life lands once. ``prepare`` does everything that can refuse a request
before it is admitted (nothing is dispatched or metered for a refused request); ``admit``
charges the limits through the ledger (``billing.ledger``). From then on the request is
settled exactly once, by ``close``, whatever ends it:

- the answer is complete: settled before the last bytes (the usage chunk, ``[DONE]``);
- the engine fails or times out: settled with the tokens produced and the error status;
- the client goes away or cancels, at any point, even while the admission call is still
  in flight: the owner (``serving.gateway.asgi``, the consumer) calls ``close`` in a ``finally``;
  ``close`` waits for an admission in flight, then settles it as 499 with what was used;
- Redis is unreachable when settling: the ledger keeps retrying until it is back.

The router's in-flight counts change only through a replica's lease (``routing.Lease``: the
engine client takes it; ``close`` releases it, once), so no path leaves a replica counted busy.

A model with a shadow policy has a share of its requests copied to a candidate version as
they are dispatched (``serving.shadow.traffic``): the copy is never admitted, settled or metered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, cast

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings

from accounts.grants import KeyGrant
from billing import ledger
from billing.ledger import Headroom, UsageEvent
from billing.pricing import PriceQuote
from core.lifecycle import LazyThreadPool
from serving.gateway import engine, metrics
from serving.gateway.admission import Admission, charge_refused, error_code_of, status_of, take_request
from serving.gateway.errors import (
    APIError,
    EngineFailed,
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
)
from serving.gateway.model_access import find_model_for
from serving.gateway.openai_wire import finish_reason_of, note_finish_reasons
from serving.gateway.routing import Lease, ReplicaRoute, VersionRoute, router
from serving.llm.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, engine_payload, parse_body
from serving.llm.tokens import PromptCount, PromptCounter, prompt_counter
from serving.semcache.lookup import (
    MISS,
    CacheHit,
    CacheProbe,
    audit_answer,
    embeddings_get,
    embeddings_key,
    embeddings_put,
    lookup,
    note_served,
    remember,
)
from serving.semcache.policy import intent_of, last_user_text, scope_of
from serving.shadow.traffic import shadows

logger = logging.getLogger(__name__)


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


_loaded_counters: set[str | None] = set()


async def _counter(version: VersionRoute) -> PromptCounter:
    directory = version.tokenizer_dir
    if directory in _loaded_counters:
        return prompt_counter(directory)
    # First use in this process: loading a tokenizer takes ~100 ms, keep it off the loop.
    counter = await sync_to_async(prompt_counter, thread_sensitive=False)(directory)
    _loaded_counters.add(directory)
    return counter


class InferenceCall:
    """One request's life. Drive it as prepare → admit → complete() or start_stream()/chunks(),
    and always ``close(status)`` in a ``finally`` (idempotent; a no-op once settled)."""

    def __init__(self, endpoint: Endpoint, grant: KeyGrant, request_id: uuid.UUID, *, batch: bool = False) -> None:
        self.endpoint = endpoint
        self.grant = grant
        self.request_id = request_id
        # A batch job's line (serving.batches): the batch price, no per-minute limits, and its
        # settlement left to the batch (``serving.gateway.admission``).
        self.batch = batch
        self.status: int | None = None  # set when settled
        self.failed = False  # a stream ended with an error event
        self.prompt_tokens = 0
        self.prompt_exact = True
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.ttft_ms: int | None = None
        self._reported_prompt: int | None = None
        self._reserved = 0
        self._reserved_spend = Decimal(0)
        self.price: PriceQuote | None = None
        self._admission: Admission | None = None  # its place in the ledger, from admit()
        self._pinned = False  # X-Model-Version: a fallback never changes the version
        self._rpm_paid = False  # its request was taken from the per-minute buckets before admission
        self._ran = False  # an engine accepted the request (answered 2xx): its prompt was processed
        self.error_code = ""  # set when it fails: what the record says of why
        self._closing: asyncio.Task[None] | None = None
        self._lease: Lease | None = None  # the replica answering it, held until it ends
        self._upstream: engine.EngineStream | ReplayStream | None = None
        self._first: Any = None
        self.cache_probe: CacheProbe | None = None
        self.cache_hit: CacheHit | None = None
        self._embeddings_key: str | None = None
        self._may_store = False
        self._answer_parts: list[str] = []
        self._finish_reasons: dict[int, str] = {}  # by choice index, as the engine said
        self._final_usage_chunk: dict[str, Any] | None = None
        self._started = time.perf_counter()
        self._admitted_at = datetime.now(UTC)
        self.stage_ms: dict[str, float] = {}

    # --- the script ------------------------------------------------------------------------

    async def run(
        self,
        raw_body: bytes,
        *,
        pinned_version: str | None = None,
        pin_param: str = "x-model-version",
        cache_control: str | None = None,
    ) -> dict[str, Any] | None:
        """The request's script, the same for every transport (REST, SSE, WebSocket): prepare,
        consult the cache, admit, then open the answer. Returns a JSON answer (complete and
        settled), or None for a stream, whose chunks follow (``chunks``). ``stage_ms``: how
        long each stage took before the answer began (a response's Server-Timing)."""
        started = time.perf_counter()
        await self.prepare(raw_body, pinned_version=pinned_version, pin_param=pin_param)
        prepared = time.perf_counter()
        await self.consult_cache(cache_control=cache_control)
        looked_up = time.perf_counter()
        await self.admit()
        admitted = time.perf_counter()
        self.stage_ms.update(
            prepare=(prepared - started) * 1000,
            cache=(looked_up - prepared) * 1000,
            admit=(admitted - looked_up) * 1000,
        )
        try:
            if self.stream:
                await self.start_stream()
                return None
            return await self.complete()
        finally:
            self.stage_ms["engine"] = (time.perf_counter() - admitted) * 1000

    # --- before admission ---------------------------------------------------------------

    async def prepare(
        self, raw_body: bytes, *, pinned_version: str | None = None, pin_param: str = "x-model-version"
    ) -> None:
        """Validate, route and count; raises an APIError (4xx/503) and nothing is charged.

        ``pinned_version`` (the ``X-Model-Version`` header; ``pin_param`` names where it came
        from in errors) serves the request from that version of the model, whatever its
        weight: a version the model does not serve is a 400, one with no routable replica a 503.
        """
        body, data = parse_body(raw_body, self.endpoint.schema)
        model = await find_model_for(self.grant, body.model)  # one outside the key's scope does not exist
        if model.task not in self.endpoint.tasks:
            raise InvalidRequest(
                f"The model `{model.name}` is a {model.task} model and does not support /v1/{self.endpoint.name}.",
                param="model",
                code="model_not_supported",
            )
        if pinned_version is not None and not any(v.version == pinned_version for v in model.versions):
            raise InvalidRequest(
                f"The model `{model.name}` has no version `{pinned_version}` being served.",
                param=pin_param,
                code="model_version_not_found",
            )
        self._pinned = pinned_version is not None
        sticky = getattr(body, "user", None) or f"key:{self.grant.key_id}"
        version = router.choose_version(model, sticky, version=pinned_version)
        if version is None:
            which = f"`{model.name}` version `{pinned_version}`" if pinned_version is not None else f"`{model.name}`"
            raise EngineUnavailable(f"No replica of {which} is ready. Try again shortly.")
        max_len = version.max_model_len
        # Whatever the prompt, and whether or not it can be counted: no model generates past its
        # context (and a reservation of 16 choices of 2**64 tokens cannot even be written down).
        _check_completion_limit(body, max_len)
        counter = await _counter(version)
        # A large body pays its place in the per-minute request bucket before its prompt is
        # counted (a 4 MB prompt is about a second of CPU), so it cannot be repeated for free.
        large = len(raw_body) > settings.PROMPT_COUNT_INLINE_BYTES
        if large and not self.batch:
            await self._take_request()
        try:
            _refuse_by_lower_bound(body, data, counter, max_len)
            if large:  # off the event loop: every other request on this process goes on meanwhile
                loop = asyncio.get_running_loop()
                per_prompt = await loop.run_in_executor(_counting_pool.get(), _count, counter, body, data)
            else:
                per_prompt = _count(counter, body, data)
            prompts = len(per_prompt)
            # An engine-side truncation makes our count an upper bound, not the truth.
            exact = all(c.exact for c in per_prompt) and getattr(body, "truncate_prompt_tokens", None) is None
            prompt_tokens = sum(c.tokens for c in per_prompt)
            if isinstance(body, EmbeddingRequest):
                if exact and isinstance(body.input, str) and prompt_tokens > max_len:
                    raise InvalidRequest(
                        f"This model's maximum context length is {max_len} tokens, "
                        f"but the input has {prompt_tokens} tokens.",
                        param="input",
                        code="context_length_exceeded",
                    )
                prompt_bound = reserved = prompt_tokens
            else:
                limit = body.completion_limit
                if exact:
                    _check_context(body, max(c.tokens for c in per_prompt), limit, max_len)
                # Reserved against TPM and budgets: every prompt plus the most every choice may
                # generate. An estimated prompt is capped by the context the engine allows.
                prompt_bound = prompt_tokens if exact else min(prompt_tokens, max_len * prompts)
                longest = max(c.tokens for c in per_prompt) if exact else 0
                per_choice = limit if limit is not None else max(1, max_len - longest)
                reserved = prompt_bound + prompts * body.n * per_choice
        except InvalidRequest:
            if not self._rpm_paid and not self.batch:  # refused after it was counted: it still counts as a request
                await charge_refused(self.grant)
            raise

        # Charged at the price in effect when the request arrived (its record's created_at),
        # for the whole request, whatever happens later.
        price = self._price_of(version)
        if price is not None:
            self._reserved_spend = price.reservation(prompt_tokens=prompt_bound, output_tokens=reserved - prompt_bound)

        payload = engine_payload(data)
        payload["model"] = model.name
        if self.batch and settings.ENGINE_SCHEDULING_POLICY == "priority":
            payload["priority"] = settings.BATCH_ENGINE_PRIORITY  # after interactive requests
        if isinstance(body, ChatCompletionRequest | CompletionRequest) and body.stream:
            # Always ask for usage, cumulative on every chunk: a stream cut short is still
            # metered with the tokens actually produced.
            payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        self.body = body
        self.payload = payload
        self.model = model
        self.version = version
        self.prompt_tokens = prompt_tokens
        self.prompt_exact = exact
        self._reserved = reserved
        self.price = price

    def _price_of(self, version: VersionRoute) -> PriceQuote | None:
        price = version.price_at(self._admitted_at.timestamp())
        return price.for_batch() if price is not None and self.batch else price

    @property
    def stream(self) -> bool:
        return bool(getattr(self.body, "stream", False))

    @property
    def wants_usage(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest | CompletionRequest) and self.body.wants_usage

    @property
    def public_id(self) -> str:
        return self.endpoint.id_prefix + self.request_id.hex

    @property
    def admitted(self) -> bool:
        """Charged and metered (known for sure once ``close`` has returned)."""
        return self._admission is not None and self._admission.admitted

    @property
    def rate_limits(self) -> Headroom | None:
        """The key's limits once admitted (a cache hit too), for the answer's headers."""
        return self._admission.rate_limits if self._admission is not None else None

    @property
    def cache_outcome(self) -> str:
        """How it was answered: ``hit``, ``semantic-hit`` or ``miss`` (the x-cache header)."""
        return self.cache_hit.outcome if self.cache_hit is not None else MISS

    async def _take_request(self) -> None:
        """Pay this request's place in the key's per-minute request buckets now (429 when they
        are empty); admission then does not charge it again."""
        await take_request(self.grant)
        self._rpm_paid = True

    # --- the cache ------------------------------------------------------------------------

    async def consult_cache(self, *, cache_control: str | None) -> None:
        """Look for this request's answer in the cache (between prepare and admit).

        A hit is admitted and charged like any request, but for the tokens it replays, all at
        the cached input price. The lookup never fails the request (any trouble is a miss).
        """
        rules = self.model.cache_rules
        if self.endpoint is CHAT:
            assert isinstance(self.body, ChatCompletionRequest)
            intent = intent_of(
                body=self.body,
                payload=self.payload,
                rules=rules,
                default_temperature=self.version.default_temperature,
                prompt_tokens=self.prompt_tokens,
                prompt_exact=self.prompt_exact,
                cache_control=cache_control,
            )
            query = last_user_text(self.payload["messages"])
            if query is None or not (intent.read or intent.write):
                return
            scope = scope_of(
                payload=self.payload,
                version_id=self.version.id,
                organization_id=self.grant.organization_id,
                rules=rules,
                default_temperature=self.version.default_temperature,
            )
            self.cache_probe = CacheProbe(
                intent=intent, scope=scope, query=query, model=self.model.name,
                wrong_hit_budget=(
                    rules.wrong_hit_budget
                    if self.grant.cache_wrong_hit_budget is None
                    else min(rules.wrong_hit_budget, self.grant.cache_wrong_hit_budget)
                ),
            )  # fmt: skip
            self._may_store = intent.write
            if intent.read:
                self.cache_hit = await lookup(self.cache_probe)
        elif self.endpoint is EMBEDDINGS:
            directives = {d.strip().lower() for d in (cache_control or "").split(",")}
            if not settings.SEMANTIC_CACHE_ENABLED or not rules.enabled or getattr(self.body, "cache", None) is False:
                return
            tenant = "shared" if rules.shared_scope else f"org:{self.grant.organization_id}"
            self._embeddings_key = embeddings_key(payload=self.payload, version_id=self.version.id, tenant=tenant)
            self._may_store = "no-store" not in directives
            if "no-cache" not in directives and "no-store" not in directives:
                self.cache_hit = await embeddings_get(self._embeddings_key, model=self.model.name)
        if self.cache_hit is not None:
            tokens = self._hit_prompt_tokens + self.cache_hit.completion_tokens
            self._reserved = tokens
            self._reserved_spend = self.price.charge(
                prompt=self._hit_prompt_tokens, completion=self.cache_hit.completion_tokens,
                cached=self._hit_prompt_tokens, cache_hit=True,
            ) if self.price is not None else Decimal(0)  # fmt: skip

    @property
    def _hit_prompt_tokens(self) -> int:
        """A chat hit's prompt is this request's own (counted exactly); an embeddings hit's is
        the stored answer's (the same input)."""
        assert self.cache_hit is not None
        return self.prompt_tokens if self.endpoint is CHAT else self.cache_hit.prompt_tokens

    def _hit_usage(self) -> dict[str, Any]:
        """The usage a hit reports and is metered with: every prompt token marked cached."""
        assert self.cache_hit is not None
        prompt, completion = self._hit_prompt_tokens, self.cache_hit.completion_tokens
        self._reported_prompt, self.completion_tokens, self.cached_tokens = prompt, completion, prompt
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion}
        if self.endpoint is not EMBEDDINGS:
            usage["completion_tokens"] = completion
        usage["prompt_tokens_details"] = {"cached_tokens": prompt}
        return usage

    def _remember(self, answer: dict[str, Any]) -> None:
        """Keep a completed engine answer for later requests (off the request path); when it
        answered a would-be hit (an audit), compare the two."""
        if self.cache_probe is not None and self.cache_probe.audit is not None and self.cache_hit is None:
            message = answer.get("message")
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                audit_answer(self.cache_probe, message["content"])
        if not self._may_store or self.cache_hit is not None:
            return
        if self.endpoint is EMBEDDINGS and self._embeddings_key is not None:
            embeddings_put(self._embeddings_key, answer, ttl_seconds=settings.EMBEDDINGS_CACHE_TTL_SECONDS)
            return
        message, finish_reason = answer.get("message"), answer.get("finish_reason")
        if self.cache_probe is None or not isinstance(message, dict) or finish_reason not in ("stop", "length"):
            return
        if not isinstance(message.get("content"), str) or not message["content"] or message.get("tool_calls"):
            return  # only plain text answers are replayed
        kept = {"role": "assistant", "content": message["content"]}
        remember(
            self.cache_probe,
            organization_id=self.grant.organization_id,
            model_version=self.version.version,
            answer={"message": kept, "finish_reason": finish_reason},
            prompt_tokens=self.prompt_tokens_metered,
            completion_tokens=self.completion_tokens,
            ttl_seconds=self.model.cache_rules.ttl_seconds,
        )

    # --- admission ------------------------------------------------------------------------

    async def admit(self) -> Headroom:
        """Charge the limits and register the request in flight, in one atomic step
        (``serving.gateway.admission``: a caller cancelled meanwhile leaves it to finish, and ``close``
        settles it). Raises RateLimited (429) when a limit, budget or the model's queue refuses it."""
        self._admission = Admission(self.grant, self.model, batch=self.batch)
        return await self._admission.admit(
            self._event(0, draft=True), tokens=self._reserved, spend=self._reserved_spend, rpm_paid=self._rpm_paid
        )

    @property
    def deferred_event(self) -> UsageEvent | None:
        """A batch line's usage event, once closed (its batch writes it: ``serving.batches``)."""
        return self._admission.deferred if self._admission is not None else None

    # --- running ---------------------------------------------------------------------------

    async def complete(self) -> dict[str, Any]:
        """A non-streaming request: the engine's JSON answer, with our id and model name; settled."""
        if self.cache_hit is not None:
            data = self._replayed_json()
            await self.close(200)
            return data
        try:
            self._mirror()
            replicas = router.replica_order(self.version)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + settings.ENGINE_REQUEST_TIMEOUT
            for attempt in (1, 2):
                started = time.perf_counter()
                try:
                    # The engine's answer (headers and body come together) is due by the deadline:
                    # past it the engine is judged (504 and a failure on its circuit, so a slow
                    # replica stops being chosen); the second after it covers reading the body.
                    async with asyncio.timeout_at(deadline + 1.0):
                        self._lease, response = await engine.dispatch(
                            router, replicas, self.endpoint.path, self.payload, stream=False, first_byte_by=deadline
                        )
                    self._ran = True
                    data = engine.parse_json(router, self._lease.replica, response.content)
                    break
                except TimeoutError:
                    raise EngineTimeout("The engine did not answer in time.") from None
                except (EngineFailed, EngineUnavailable) as exc:  # a timeout left no time to retry
                    fallback = await self._fall_back(exc, started, attempt)
                    if fallback is None:
                        raise
                    replicas = fallback
            self._record_usage(data.get("usage"))
            note_finish_reasons(self._finish_reasons, data.get("choices"))
            if self.endpoint is not EMBEDDINGS:
                data["id"] = self.public_id
            data["model"] = self.model.name
        except BaseException as exc:
            await self.close(self._failed(exc))
            raise
        await self.close(200)
        if self.endpoint is EMBEDDINGS:
            self._remember(data)
        elif data.get("choices"):
            self._remember(data["choices"][0])
        return data

    # --- fallback ---------------------------------------------------------------------------

    async def _fall_back(self, exc: APIError, started: float, attempt: int) -> list[ReplicaRoute] | None:
        """After an attempt failed before the client got a byte: let go of what it held, and
        say where the request goes next (once): another routable replica of its version, else,
        unless the request pins its version, the model's base version. None: nowhere, the
        failure is the answer.

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
            replicas = [r for r in router.replica_order(version) if r.id not in failed] if version else []
        if version is None or not replicas:
            return None
        await ledger.note_failed_attempt(
            UsageEvent(
                request_id=self.request_id, api_key_id=self.grant.key_id, organization_id=self.grant.organization_id,
                model=self.model.name, model_version=self.version.version, endpoint=self.endpoint.name,
                prompt_tokens=0, completion_tokens=0, cached_tokens=0,
                latency_ms=int((time.perf_counter() - started) * 1000), ttft_ms=None, status_code=exc.status,
                created_at=self._admitted_at, error_code=error_code_of(exc.status, exc),
            )
        )  # fmt: skip
        metrics.FALLBACKS.labels(self.model.name, self.version.version, version.version, exc.code or "").inc()
        logger.warning("request %s: %s failed on %s (%s); retrying on %s", self.request_id, self.model.name,
                       self.version.version, exc.code, version.version)  # fmt: skip
        if version is not self.version:
            # Metered as the version that answers, at its price; its answer is not cached
            # under the scope (and version) the request was looked up in.
            self.version = version
            self.price = self._price_of(version)
            self._may_store = False
        return replicas

    async def _let_go(self) -> None:
        """Close a failed attempt's stream and release its replica: the next attempt starts clean."""
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            with contextlib.suppress(Exception):
                await upstream.aclose()
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self._ran = False
        self._first = None

    def _mirror(self) -> None:
        """Copy the request to its model's shadow candidate, if it has one and this request is
        among the share copied (``serving.shadow.traffic``): a task of its own, started as the request
        itself goes out, so it never delays it; never metered. Cache hits are not copied."""
        shadows.mirror(
            model=self.model,
            primary=self.version,
            request_id=self.request_id,
            endpoint=self.endpoint.name,
            path=self.endpoint.path,
            payload=self.payload,
            stream=self.stream,
        )

    def _replayed_json(self) -> dict[str, Any]:
        """A hit's answer, shaped exactly like the engine's, with this request's id and usage."""
        assert self.cache_hit is not None
        answer = self.cache_hit.answer
        usage = self._hit_usage()
        if self.endpoint is EMBEDDINGS:
            return {**answer, "model": self.model.name, "usage": usage}
        self._finish_reasons[0] = str(answer["finish_reason"])  # metered as the stored answer ended
        return {
            "id": self.public_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model.name,
            "choices": [
                {"index": 0, "message": answer["message"], "logprobs": None, "finish_reason": answer["finish_reason"]}
            ],
            "usage": usage,
            "system_fingerprint": None,
        }

    async def start_stream(self) -> None:
        """Dispatch and wait for the first event; errors before it are ordinary HTTP errors
        (after one fallback: ``_fall_back``)."""
        if self.cache_hit is not None:
            self._upstream = ReplayStream(self._replay_events())
            self._first = await anext(self._upstream)
            return
        try:
            self._mirror()
            replicas = router.replica_order(self.version)
            for attempt in (1, 2):
                started = time.perf_counter()
                try:
                    await self._open_stream(replicas)
                    return
                except (EngineFailed, EngineTimeout, EngineUnavailable) as exc:
                    fallback = await self._fall_back(exc, started, attempt)
                    if fallback is None:
                        raise
                    replicas = fallback
        except BaseException as exc:
            await self.close(self._failed(exc))
            raise

    async def _open_stream(self, replicas: list[ReplicaRoute]) -> None:
        """One attempt: open the stream and take its first event (an error event fails it), both
        within ENGINE_FIRST_TOKEN_TIMEOUT: an engine that never even sends its headers is a
        first-token timeout too, not a wait for the whole request's limit."""
        first_by = asyncio.get_running_loop().time() + settings.ENGINE_FIRST_TOKEN_TIMEOUT
        upstream = await engine.open_stream(router, replicas, self.endpoint.path, self.payload, first_byte_by=first_by)
        self._upstream, self._lease, self._ran = upstream, upstream.lease, True
        try:
            async with asyncio.timeout_at(first_by):
                self._first = await anext(upstream)
        except TimeoutError:
            router.record_failure(upstream.replica.id)
            raise EngineTimeout(f"The engine sent no token within {settings.ENGINE_FIRST_TOKEN_TIMEOUT:g} s.") from None
        except StopAsyncIteration:
            raise EngineFailed("The engine closed the stream without answering.") from None
        if isinstance(self._first, dict) and "error" in self._first:
            router.record_failure(upstream.replica.id)
            raise engine.engine_error(500, orjson.dumps(self._first))

    @property
    def more_ready(self) -> bool:
        """Whether the next chunk is already received from the engine (a writer may hold this
        one back and send both in one write: never delays a byte, saves a write per chunk)."""
        upstream = self._upstream
        return upstream is not None and upstream.ready

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Chunks for the client; an ``{"error": ...}`` chunk last if the engine fails, else the
        usage chunk (when asked for) after the request is settled."""
        assert self._upstream is not None, "start_stream() first"
        upstream = self._upstream
        status = 200
        loop = asyncio.get_running_loop()
        deadline = self._started + settings.ENGINE_REQUEST_TIMEOUT
        try:
            event = self._first
            while event is not engine.DONE:
                if isinstance(event, dict) and "error" in event:
                    raise engine.engine_error(500, orjson.dumps(event))
                chunk = self._rewrite(event)
                if chunk is not None:
                    yield chunk
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    raise EngineTimeout("The request took longer than the time limit.")
                try:
                    if upstream.ready:  # already received: no timer to arm
                        event = await anext(upstream)
                    else:
                        async with asyncio.timeout_at(loop.time() + remaining):
                            event = await anext(upstream)
                except TimeoutError:
                    raise EngineTimeout("The request took longer than the time limit.") from None
                except StopAsyncIteration:
                    raise EngineFailed("The engine closed the stream before it finished.") from None
        except (APIError, Exception) as exc:
            if not isinstance(exc, APIError):  # a bug, or an engine answer we cannot read
                logger.exception("stream of request %s failed", self.request_id)
                exc = APIError("The server had an error while streaming the answer.")
            status = self._failed(exc)
            self.failed = True
            await self.close(status)
            yield exc.body()
            return
        except BaseException as exc:  # cancelled, or the client closed the stream
            status = self._failed(exc)
            raise
        finally:
            await self.close(status)
        if self._may_store and 0 in self._finish_reasons:
            message = {"role": "assistant", "content": "".join(self._answer_parts)}
            self._remember({"message": message, "finish_reason": self._finish_reasons[0]})
        if self.wants_usage and self._final_usage_chunk is not None:
            yield self._final_usage_chunk

    def _replay_events(self) -> list[Any]:
        """A hit's answer as the engine would stream it: the role, the text in pieces (with
        cumulative usage, as continuous_usage_stats gives), the finish, the usage, [DONE]."""
        assert self.cache_hit is not None
        usage = self._hit_usage()
        prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
        text = str(self.cache_hit.answer["message"].get("content") or "")
        pieces = _pieces(text)
        base = {"object": "chat.completion.chunk", "created": int(time.time())}

        def chunk(delta: dict[str, Any], finish: str | None, generated: int) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            tokens = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                      "prompt_tokens_details": {"cached_tokens": prompt}}  # fmt: skip
            return {**base, "choices": [choice], "usage": tokens}

        events: list[Any] = [chunk({"role": "assistant", "content": ""}, None, 0)]
        for i, piece in enumerate(pieces, start=1):
            events.append(chunk({"content": piece}, None, round(completion * i / len(pieces))))
        events.append(chunk({}, self.cache_hit.answer.get("finish_reason") or "stop", completion))
        events.append({**base, "choices": [], "usage": usage})
        events.append(engine.DONE)
        return events

    def _rewrite(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """Our id and model name; usage taken for metering, shown only as the client asked."""
        usage = event.get("usage")
        if usage:
            self._record_usage(usage)
            if self.ttft_ms is None and self.completion_tokens > 0:
                self.ttft_ms = int((time.perf_counter() - self._started) * 1000)
        event["id"] = self.public_id
        event["model"] = self.model.name
        note_finish_reasons(self._finish_reasons, event.get("choices"))
        if self._may_store and self.cache_hit is None and event.get("choices"):
            content = (event["choices"][0].get("delta") or {}).get("content")
            if isinstance(content, str):
                self._answer_parts.append(content)
        if not event.get("choices") and usage is not None:
            # The engine's final usage-only chunk: held back until the request is settled.
            self._final_usage_chunk = event
            return None
        if self.wants_usage:
            event["usage"] = None
        else:
            event.pop("usage", None)
        return event

    def _record_usage(self, usage: dict[str, Any] | None) -> None:
        """Take the engine's (cumulative) usage as the truth."""
        if not isinstance(usage, dict):
            return
        if usage.get("prompt_tokens") is not None:
            self._reported_prompt = int(usage["prompt_tokens"])
        self.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details")
        self.cached_tokens = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0

    def _failed(self, exc: BaseException) -> int:
        """Note why the request failed (the first reason counts); returns its status."""
        status = status_of(exc)
        if not self.error_code:
            self.error_code = error_code_of(status, exc)
        return status

    @property
    def finish_reason(self) -> str:
        """Why generation stopped, as the usage record keeps it (``openai_wire.finish_reason_of``:
        with several choices, "length" if any was cut, else the first's; "" when unknown)."""
        return finish_reason_of(self._finish_reasons)

    # --- the end ---------------------------------------------------------------------------

    @property
    def prompt_tokens_metered(self) -> int:
        """The prompt tokens the usage event records.

        What the engine reported; else, when an engine accepted the request (so it read the
        prompt), our exact count. A request no engine ran (refused by every replica, or
        answered with an error before it started) records none: it costs nothing.
        """
        if self._reported_prompt is not None:
            return self._reported_prompt
        if self._ran and self.prompt_exact:
            return self.prompt_tokens
        return 0

    def _event(self, status: int, *, draft: bool = False) -> UsageEvent:
        """The usage event: as settled, or (``draft``) as the sweeper would settle it if this
        gateway died after admission: the counted prompt, nothing generated."""
        prompt = self.prompt_tokens if draft and self.prompt_exact else self.prompt_tokens_metered
        cost = Decimal(0)
        if self.price is not None:
            cost = self.price.charge(
                prompt=prompt,
                completion=self.completion_tokens,
                cached=self.cached_tokens,
                cache_hit=self.cache_hit is not None,
            )
        return UsageEvent(
            request_id=self.request_id,
            api_key_id=self.grant.key_id,
            organization_id=self.grant.organization_id,
            model=self.model.name,
            model_version=self.version.version,
            endpoint=self.endpoint.name,
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            latency_ms=int((time.perf_counter() - self._started) * 1000),
            ttft_ms=self.ttft_ms,
            status_code=status,
            created_at=self._admitted_at,
            price_id=self.price.price_id if self.price is not None else None,
            cost=cost,
            cache=self.cache_outcome,
            finish_reason="" if draft else self.finish_reason,
            error_code="" if draft else (self.error_code or error_code_of(status)),
            batch=self.batch,
        )

    async def close(self, status: int) -> None:
        """Release the replica, close the engine stream and settle the request, once.

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
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            try:
                await upstream.aclose()  # closing the connection makes vLLM abort the sequence
            except Exception:
                logger.debug("closing the engine stream failed", exc_info=True)
        if self._lease is not None:
            self._lease.release()
        if admission is None or not admission.maybe_admitted:
            return
        event = self._event(status)
        self.status = status
        if not await admission.settle(event):
            return  # admission outcome unknown: the ledger settles it if it landed
        labels = (event.model, event.model_version)
        metrics.REQUESTS.labels(*labels, self.endpoint.name, str(status)).inc()
        metrics.LATENCY.labels(*labels).observe(event.latency_ms / 1000)
        if event.ttft_ms is not None:
            metrics.TTFT.labels(*labels).observe(event.ttft_ms / 1000)
        metrics.TOKENS.labels(*labels, "prompt").inc(event.prompt_tokens)
        metrics.TOKENS.labels(*labels, "completion").inc(event.completion_tokens)
        if self.cache_hit is not None and status == 200:
            if self.cache_probe is not None:
                note_served(self.cache_probe, self.cache_hit, request_id=self.request_id,
                            organization_id=self.grant.organization_id, model_version=self.version.version)  # fmt: skip
            metrics.CACHE_TOKENS_SAVED.labels(event.model).inc(event.total_tokens)
            if self.price is not None:
                saved = self.price.saved(
                    prompt=event.prompt_tokens, completion=event.completion_tokens, charged=event.cost
                )
                metrics.CACHE_MONEY_SAVED.labels(event.model, self.price.currency).inc(float(saved))


# The threads that count large prompts (the tokenizer releases the GIL while it works).
_counting_pool = LazyThreadPool("prompt-count", lambda: int(settings.PROMPT_COUNT_THREADS))


def _count(counter: PromptCounter, body: Any, data: dict[str, Any]) -> list[PromptCount]:
    """Each prompt's tokens (a chat is one prompt): exact where the tokenizer and template allow."""
    if isinstance(body, ChatCompletionRequest):
        return [
            counter.count_chat(
                data["messages"],
                tools=data.get("tools"),
                documents=data.get("documents"),
                add_generation_prompt=body.add_generation_prompt is not False,
                continue_final_message=bool(body.continue_final_message),
                template_kwargs=body.chat_template_kwargs,
            )
        ]
    if isinstance(body, CompletionRequest) and body.prompt_count > 1:
        items = cast(list[str] | list[list[int]], body.prompt)
        return [PromptCount(counter.count_prompt(item), counter.exact) for item in items]
    prompt = body.prompt if isinstance(body, CompletionRequest) else body.input
    return [PromptCount(counter.count_prompt(prompt), counter.exact)]


def _text_chars(body: Any, data: dict[str, Any]) -> list[int]:
    """Characters of text in each prompt (what the cheap bound needs; token ids are not text)."""
    if isinstance(body, ChatCompletionRequest):
        total = 0
        for message in data["messages"]:
            content = message.get("content")
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        return [total]
    prompt = body.prompt if isinstance(body, CompletionRequest) else body.input
    if isinstance(prompt, str):
        return [len(prompt)]
    return [len(item) for item in prompt if isinstance(item, str)]


def _refuse_by_lower_bound(body: Any, data: dict[str, Any], counter: PromptCounter, max_len: int) -> None:
    """Refuse, without tokenising it, a prompt whose text alone needs more tokens than the
    context holds (``PromptCounter.at_least``): a 4 MB body is refused in microseconds."""
    if not counter.max_token_chars or getattr(body, "truncate_prompt_tokens", None) is not None:
        return
    least = max((counter.at_least(chars) for chars in _text_chars(body, data)), default=0)
    embeddings = isinstance(body, EmbeddingRequest)
    if least > max_len or (least >= max_len and not embeddings):
        where = "input" if embeddings else "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise InvalidRequest(
            f"This model's maximum context length is {max_len} tokens, but the {where} has at least {least} "
            "tokens. Please reduce the length of the prompt.",
            param=where,
            code="context_length_exceeded",
        )


def _check_completion_limit(body: Any, max_len: int) -> None:
    limit = getattr(body, "completion_limit", None)
    if limit is not None and limit > max_len:
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise InvalidRequest(
            f"'{param}' is too large: {limit}. This model's maximum context length is {max_len} tokens.",
            param=param,
            code="context_length_exceeded",
        )


def _check_context(body: Any, prompt_tokens: int, limit: int | None, max_len: int) -> None:
    """Call after _check_completion_limit: the prompt and the completion together."""
    requested = prompt_tokens + (limit or 0)
    if prompt_tokens >= max_len or requested > max_len:
        where = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise InvalidRequest(
            f"This model's maximum context length is {max_len} tokens. However, you requested {requested} "
            f"tokens ({prompt_tokens} in the {where}, {limit or 0} in the completion). "
            "Please reduce the length of the prompt or the completion.",
            param=where,
            code="context_length_exceeded",
        )


class ReplayStream:
    """A cached answer standing in for an engine stream (no replica, nothing to close)."""

    replica = None
    ready = True  # every event is in memory

    def __init__(self, events: list[Any]) -> None:
        self._events = iter(events)

    def __aiter__(self) -> ReplayStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return next(self._events)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        return None


def _pieces(text: str, size: int = 16) -> list[str]:
    """The text in pieces of about ``size`` characters, cut after whitespace, for replay."""
    pieces: list[str] = []
    current = ""
    for word in re.findall(r"\S+\s*|\s+", text):
        current += word
        if len(current) >= size:
            pieces.append(current)
            current = ""
    if current or not pieces:
        pieces.append(current)
    return pieces
