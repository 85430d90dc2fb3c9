"""The OpenAI-compatible REST and SSE endpoints (views only parse, call the pipeline, render)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from serving.auth import authenticate
from serving.errors import APIError, ModelNotAllowed, ModelNotFound
from serving.pipeline import CHAT, COMPLETIONS, EMBEDDINGS, Endpoint, StreamRelay, admit, prepare, run_json
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


def _model_object(model: ModelRoute) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": model.owner}


async def models_list(request: HttpRequest) -> HttpResponse:
    _require(request, "GET")
    grant = await authenticate(request.headers.get("Authorization"))
    table = await router.snapshot()
    data = [_model_object(m) for name, m in sorted(table.models.items()) if grant.may_use(name)]
    return _json({"object": "list", "data": data})


async def model_detail(request: HttpRequest, model: str) -> HttpResponse:
    _require(request, "GET")
    grant = await authenticate(request.headers.get("Authorization"))
    table = await router.snapshot()
    route = table.models.get(model)
    if route is None:
        raise ModelNotFound(model)
    if not grant.may_use(model):
        raise ModelNotAllowed(model)
    return _json(_model_object(route))


async def _sse(relay: StreamRelay) -> AsyncIterator[bytes]:
    async for chunk in relay.events():
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    if not relay.failed:
        yield b"data: [DONE]\n\n"


async def _infer(request: HttpRequest, endpoint: Endpoint) -> HttpResponse:
    _require(request, "POST")
    prepared = await prepare(
        endpoint,
        request.body,
        request.headers.get("Authorization"),
        request_id=request.request_id,  # type: ignore[attr-defined]
    )
    await admit(prepared)
    if prepared.stream:
        relay = StreamRelay(prepared)
        await relay.start()
        response: HttpResponse | StreamingHttpResponse = StreamingHttpResponse(
            _sse(relay), content_type="text/event-stream"
        )
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"  # proxies must not buffer the stream
        return response  # type: ignore[return-value]
    return _json(await run_json(prepared))


async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _infer(request, CHAT)


async def completions(request: HttpRequest) -> HttpResponse:
    return await _infer(request, COMPLETIONS)


async def embeddings(request: HttpRequest) -> HttpResponse:
    return await _infer(request, EMBEDDINGS)
