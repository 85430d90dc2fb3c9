"""An LLM request from body to usage event: prepare → cache → admit → run → settle.

The REST/SSE views and the WebSocket consumer drive the same ``InferenceCall`` through the
same script (``run``), so a fix to the request's life lands once. ``prepare`` does everything
that can refuse a request before it is admitted (nothing is dispatched or metered for a
refused request): validate the body (``serving.llm.schemas``), choose the version, count the
prompts (``serving.llm.prompts``). Then the semantic cache (``serving.semcache``), admission,
the engine (complete or streamed), and the settlement every call shares
(``serving.gateway.call``). A model with a shadow policy has a share of its requests copied
to a candidate version as they are dispatched (``serving.shadow.traffic``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import orjson
from django.conf import settings

from accounts.grants import KeyGrant
from billing.ledger import Headroom, UsageEvent
from serving.gateway import engine, metrics
from serving.gateway.admission import error_code_of
from serving.gateway.call import Call
from serving.gateway.errors import (
    APIError,
    EngineFailed,
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
)
from serving.gateway.model_access import find_model_for
from serving.gateway.openai_wire import finish_reason_of, note_finish_reasons
from serving.gateway.prefixes import prefix_memory
from serving.gateway.routing import ReplicaRoute, router
from serving.llm.prompts import (
    check_completion_limit,
    check_context,
    count_prompts,
    counter_of,
    counting_pool,
    prompt_blocks,
    refuse_by_lower_bound,
)
from serving.llm.replay import ReplayStream, text_pieces
from serving.llm.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, engine_payload, parse_body
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


class InferenceCall(Call):
    """An LLM request (``serving.gateway.call.Call``). Drive it as prepare → admit → complete()
    or start_stream()/chunks(), and always ``close(status)`` in a ``finally``."""

    def __init__(self, endpoint: Endpoint, grant: KeyGrant, request_id: uuid.UUID, *, batch: bool = False) -> None:
        super().__init__(grant, request_id, endpoint_name=endpoint.name, batch=batch)
        self.endpoint = endpoint
        self.failed = False  # a stream ended with an error event
        self.prompt_tokens = 0
        self.prompt_exact = True
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.ttft_ms: int | None = None
        self._reported_prompt: int | None = None
        self._reserved = 0
        self._reserved_spend = Decimal(0)
        self._upstream: engine.EngineStream | ReplayStream | None = None
        self._first: Any = None
        self.cache_probe: CacheProbe | None = None
        self.cache_hit: CacheHit | None = None
        self._embeddings_key: str | None = None
        self._may_store = False
        self._answer_parts: list[str] = []
        self._finish_reasons: dict[int, str] = {}  # by choice index, as the engine said
        self._final_usage_chunk: dict[str, Any] | None = None
        self._prompt_blocks: tuple[bytes, ...] = ()  # its leading blocks' hashes (prefix-aware routing)

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
        sticky = getattr(body, "user", None) or f"key:{self.grant.key_id}"
        version = self._choose_version(model, sticky=sticky, version=pinned_version, pin_param=pin_param)
        max_len = version.max_model_len
        # Whatever the prompt, and whether or not it can be counted: no model generates past its
        # context (and a reservation of 16 choices of 2**64 tokens cannot even be written down).
        check_completion_limit(body, max_len)
        counter = await counter_of(version)
        # A large body pays its place in the per-minute request bucket before its prompt is
        # counted (a 4 MB prompt is about a second of CPU), so it cannot be repeated for free.
        large = len(raw_body) > settings.PROMPT_COUNT_INLINE_BYTES
        await self._pay_before_reading(large=large)
        async with self._refusals_charged():
            refuse_by_lower_bound(body, data, counter, max_len)
            if large:  # off the event loop: every other request on this process goes on meanwhile
                loop = asyncio.get_running_loop()
                per_prompt = await loop.run_in_executor(counting_pool.get(), count_prompts, counter, body, data)
            else:
                per_prompt = count_prompts(counter, body, data)
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
                    check_context(body, max(c.tokens for c in per_prompt), limit, max_len)
                # Reserved against TPM and budgets: every prompt plus the most every choice may
                # generate. An estimated prompt is capped by the context the engine allows.
                prompt_bound = prompt_tokens if exact else min(prompt_tokens, max_len * prompts)
                longest = max(c.tokens for c in per_prompt) if exact else 0
                per_choice = limit if limit is not None else max(1, max_len - longest)
                reserved = prompt_bound + prompts * body.n * per_choice
            if settings.ROUTING_PREFIX_AWARE and len(version.replicas) > 1:
                self._prompt_blocks = prompt_blocks(body, data, per_prompt)

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
    def cache_outcome(self) -> str:
        """How it was answered: ``hit``, ``semantic-hit`` or ``miss`` (the x-cache header)."""
        return self.cache_hit.outcome if self.cache_hit is not None else MISS

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
                intent=intent, scope=scope, query=query, model=self.model.name, paraphrases=rules.paraphrases,
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
        return await self._admit(tokens=self._reserved, spend=self._reserved_spend)

    # --- running ---------------------------------------------------------------------------

    async def complete(self) -> dict[str, Any]:
        """A non-streaming request: the engine's JSON answer, with our id and model name; settled."""
        if self.cache_hit is not None:
            data = self._replayed_json()
            await self.close(200)
            return data
        try:
            self._mirror()
            replicas = await self._replica_order()
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
                    prefix_memory.note(self._lease.replica.kv_cache, self._prompt_blocks)
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

    def _attempt_event(self, exc: APIError, started: float) -> UsageEvent:
        logger.warning("request %s: %s failed on %s (%s); falling back", self.request_id, self.model.name,
                       self.version.version, exc.code)  # fmt: skip
        return UsageEvent(
            request_id=self.request_id, api_key_id=self.grant.key_id, organization_id=self.grant.organization_id,
            model=self.model.name, model_version=self.version.version, endpoint=self.endpoint.name,
            prompt_tokens=0, completion_tokens=0, cached_tokens=0,
            latency_ms=int((time.perf_counter() - started) * 1000), ttft_ms=None, status_code=exc.status,
            created_at=self._admitted_at, error_code=error_code_of(exc.status, exc),
        )  # fmt: skip

    def _version_changed(self) -> None:
        # Its answer is not cached under the scope (and version) the request was looked up in.
        self._may_store = False

    async def _close_upstream(self) -> None:
        """Close the engine stream, if one is open (closing the connection makes vLLM abort the sequence)."""
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            try:
                await upstream.aclose()
            except Exception:
                logger.debug("closing the engine stream failed", exc_info=True)

    async def _let_go(self) -> None:
        """Close a failed attempt's stream and release its replica: the next attempt starts clean."""
        await self._close_upstream()
        await super()._let_go()
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
            replicas = await self._replica_order()
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

    async def _replica_order(self) -> list[ReplicaRoute]:
        """The replicas of the chosen version to try, best first: for a chat or completion, the
        one most likely to hold its prompt's prefix (``Router.prefix_order``), else least busy."""
        if self.endpoint is EMBEDDINGS:
            return router.replica_order(self.version)
        return await router.prefix_order(self.model.name, self.version, self._prompt_blocks)

    async def _open_stream(self, replicas: list[ReplicaRoute]) -> None:
        """One attempt: open the stream and take its first event (an error event fails it), both
        within ENGINE_FIRST_TOKEN_TIMEOUT: an engine that never even sends its headers is a
        first-token timeout too, not a wait for the whole request's limit."""
        first_by = asyncio.get_running_loop().time() + settings.ENGINE_FIRST_TOKEN_TIMEOUT
        upstream = await engine.open_stream(router, replicas, self.endpoint.path, self.payload, first_byte_by=first_by)
        self._upstream, self._lease, self._ran = upstream, upstream.lease, True
        prefix_memory.note(upstream.replica.kv_cache, self._prompt_blocks)
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
        pieces = text_pieces(text)
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
        return self._usage_event(
            status,
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            ttft_ms=self.ttft_ms,
            cost=cost,
            cache=self.cache_outcome,
            cache_tier=self.cache_hit.wording if self.cache_hit is not None else "",
            cache_entry=self.cache_hit.entry_id if self.cache_hit is not None else None,
            finish_reason="" if draft else self.finish_reason,
            error_code="" if draft else (self.error_code or error_code_of(status)),
        )

    async def _release(self) -> None:
        await self._close_upstream()
        await super()._release()

    def _settled(self, event: UsageEvent, status: int) -> None:
        labels = (event.model, event.model_version)
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
