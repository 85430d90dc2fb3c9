"""The OpenAI-compatible REST and SSE endpoints (views only parse, call the pipeline, render)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from redis.exceptions import RedisError

from serving import limits
from serving.auth import KeyGrant, authenticate
from serving.errors import APIError, ModelNotAllowed, ModelNotFound, RateLimited
from serving.limits import RateLimitHeaders
from serving.pipeline import CHAT, COMPLETIONS, EMBEDDINGS, Endpoint, StreamRelay, admit, prepare, run_json
from serving.responses import EventStreamResponse
from serving.routing import ModelRoute, router


def _json(data: Any, *, status: int = 200) -> HttpResponse:
    return HttpResponse(orjson.dumps(data), status=status, content_type="application/json")


def _require(request: HttpRequest, method: str) -> None:
    if request.method != method:
        raise APIError(
            f"Method {request.method} is not allowed here; use {method}.",
            status=405,
            type="invalid_request_error",
            code="method_not_allowed",
            headers={"Allow": method},
        )


async def _current_limits(grant: KeyGrant) -> dict[str, str]:
    """x-ratelimit-* headers for an answer that charged nothing (best effort)."""
    try:
        return (await limits.peek(grant)).values
    except RedisError:
        return {}


def _model_object(model: ModelRoute) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": model.owner}


async def models_list(request: HttpRequest) -> HttpResponse:
    _require(request, "GET")
    grant = await authenticate(request.headers.get("Authorization"))
    table = await router.snapshot()
    data = [_model_object(m) for name, m in sorted(table.models.items()) if grant.may_use(name)]
    return await _with_limits(_json({"object": "list", "data": data}), grant)


async def model_detail(request: HttpRequest, model: str) -> HttpResponse:
    _require(request, "GET")
    grant = await authenticate(request.headers.get("Authorization"))
    route = (await router.snapshot()).models.get(model) or (await router.fresh_snapshot()).models.get(model)
    if route is None:
        raise ModelNotFound(model)
    if not grant.may_use(model):
        raise ModelNotAllowed(model)
    return await _with_limits(_json(_model_object(route)), grant)


async def _sse(relay: StreamRelay) -> AsyncGenerator[bytes, None]:
    async for chunk in relay.events():
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    if not relay.failed:
        yield b"data: [DONE]\n\n"


async def _infer(request: HttpRequest, endpoint: Endpoint) -> HttpResponseBase:
    _require(request, "POST")
    started = time.perf_counter()
    grant = await authenticate(request.headers.get("Authorization"))
    rate_limits: RateLimitHeaders | None = None
    try:
        prepared = await prepare(endpoint, request.body, grant, request_id=request.request_id)  # type: ignore[attr-defined]
        prepared_at = time.perf_counter()
        rate_limits = await admit(prepared)
        admitted_at = time.perf_counter()
        response: HttpResponseBase
        if prepared.stream:
            relay = StreamRelay(prepared)
            await relay.start()
            response = EventStreamResponse(_sse(relay))
        else:
            response = _json(await run_json(prepared))
    except RateLimited:
        raise  # carries its own headers
    except APIError as exc:
        exc.headers.update(rate_limits.values if rate_limits else await _current_limits(grant))
        raise
    for name, value in rate_limits.values.items():
        response[name] = value
    # Where the time before the first byte went (W3C Server-Timing), for clients and benchmarks.
    response["Server-Timing"] = (
        f"prepare;dur={(prepared_at - started) * 1000:.2f}, admit;dur={(admitted_at - prepared_at) * 1000:.2f}, "
        f"engine;dur={(time.perf_counter() - admitted_at) * 1000:.2f}"
    )
    return response


async def _with_limits(response: HttpResponse, grant: KeyGrant) -> HttpResponse:
    for name, value in (await _current_limits(grant)).items():
        response[name] = value
    return response


async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    return await _infer(request, CHAT)


async def completions(request: HttpRequest) -> HttpResponseBase:
    return await _infer(request, COMPLETIONS)


async def embeddings(request: HttpRequest) -> HttpResponseBase:
    return await _infer(request, EMBEDDINGS)
