"""The OpenAI-compatible REST and SSE endpoints (views only parse, drive the orchestrator, render).

A request may pin the version of its model with ``X-Model-Version: <version>``; every
answer says which version served it in ``x-model-version``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
from django.http import HttpResponse, HttpResponseBase
from redis.exceptions import RedisError

from accounts.grants import KeyGrant
from billing import ledger
from serving.auth import request_grant
from serving.errors import APIError, RateLimited
from serving.model_access import find_model_for
from serving.openai_wire import rate_limit_headers
from serving.orchestrator import CHAT, COMPLETIONS, EMBEDDINGS, Endpoint, InferenceCall
from serving.requests import ApiRequest, reads_body, require_method
from serving.responses import EventStreamResponse
from serving.routing import ModelRoute, routing_table


def _json(data: Any, *, status: int = 200) -> HttpResponse:
    return HttpResponse(orjson.dumps(data), status=status, content_type="application/json")


async def _current_limits(grant: KeyGrant) -> dict[str, str]:
    """x-ratelimit-* headers for an answer that charged nothing (best effort)."""
    try:
        return rate_limit_headers(await ledger.peek(grant))
    except RedisError:
        return {}


def _model_object(model: ModelRoute) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": model.owner}


async def models_list(request: ApiRequest) -> HttpResponse:
    require_method(request, "GET")
    grant = await request_grant(request)
    table = await routing_table()
    data = [_model_object(m) for name, m in sorted(table.models.items()) if grant.may_use(name)]
    return await _with_limits(_json({"object": "list", "data": data}), grant)


async def model_detail(request: ApiRequest, model: str) -> HttpResponse:
    require_method(request, "GET")
    grant = await request_grant(request)
    route = await find_model_for(grant, model)  # one outside the key's scope does not exist
    return await _with_limits(_json(_model_object(route)), grant)


def _pinned_version(request: ApiRequest) -> str | None:
    """The version the ``X-Model-Version`` header pins the request to (an empty one pins nothing)."""
    value = (request.header("x-model-version") or "").strip()
    return value or None


def _as_is(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    return [chunk]


async def sse(
    call: InferenceCall,
    render: Callable[[dict[str, Any]], list[dict[str, Any]]] = _as_is,
    last: Callable[[], dict[str, Any]] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The call's chunks as SSE events (``render`` turns a chunk into the events it makes; an
    error chunk is always the last), then ``last()``'s event and ``[DONE]`` unless it failed.
    Chunks already received together go out in one write (one syscall, one ASGI message)."""
    held: list[bytes] = []
    async for chunk in call.chunks():
        events = [chunk] if "error" in chunk else render(chunk)
        held.extend(b"data: " + orjson.dumps(event) + b"\n\n" for event in events)
        if held and not call.more_ready:
            yield b"".join(held)
            held.clear()
    if not call.failed:
        if last is not None:
            held.append(b"data: " + orjson.dumps(last()) + b"\n\n")
        held.append(b"data: [DONE]\n\n")
    if held:
        yield b"".join(held)


async def run_call(
    request: ApiRequest, call: InferenceCall, raw_body: bytes, *, pinned_version: str | None = None
) -> dict[str, Any] | None:
    """Drive ``call`` for this request (settled however the request ends): its JSON answer,
    or None for a stream (``sse``). A refused or failed call's error carries the key's limits
    (a 429 its own)."""
    request.on_close(call.close)
    try:
        return await call.run(raw_body, pinned_version=pinned_version, cache_control=request.header("cache-control"))
    except APIError as exc:
        if not isinstance(exc, RateLimited):
            exc.headers.update(
                rate_limit_headers(call.rate_limits) if call.rate_limits else await _current_limits(call.grant)
            )
        raise


async def _infer(request: ApiRequest, endpoint: Endpoint) -> HttpResponseBase:
    require_method(request, "POST")
    grant = await request_grant(request)
    call = InferenceCall(endpoint, grant, request.request_id)
    answer = await run_call(request, call, request.body, pinned_version=_pinned_version(request))
    response: HttpResponseBase = EventStreamResponse(sse(call)) if answer is None else _json(answer)
    annotate_answer(response, call)
    return response


def annotate_answer(response: HttpResponseBase, call: InferenceCall) -> None:
    """An answer's headers: the key's limits once admitted (a cache hit too), the version that
    served it (pinned or chosen), the cache's outcome, and where the time before the first
    byte went (W3C Server-Timing, for clients and benchmarks)."""
    if call.rate_limits is not None:
        for name, value in rate_limit_headers(call.rate_limits).items():
            response[name] = value
    response["x-model-version"] = call.version.version
    if call.endpoint is not COMPLETIONS:
        response["x-cache"] = call.cache_outcome
        if call.cache_hit is not None:
            response["x-cache-similarity"] = f"{call.cache_hit.similarity:.4f}"
    response["Server-Timing"] = ", ".join(f"{stage};dur={ms:.2f}" for stage, ms in call.stage_ms.items())


async def _with_limits(response: HttpResponse, grant: KeyGrant) -> HttpResponse:
    for name, value in (await _current_limits(grant)).items():
        response[name] = value
    return response


@reads_body()
async def chat_completions(request: ApiRequest) -> HttpResponseBase:
    return await _infer(request, CHAT)


@reads_body()
async def completions(request: ApiRequest) -> HttpResponseBase:
    return await _infer(request, COMPLETIONS)


@reads_body()
async def embeddings(request: ApiRequest) -> HttpResponseBase:
    return await _infer(request, EMBEDDINGS)
