"""The OpenAI-compatible REST and SSE endpoints (views only parse, drive the LLM call, render).

A request may pin the version of its model with ``X-Model-Version: <version>``; every
answer says which version served it in ``x-model-version``.
"""

from __future__ import annotations

from typing import Any

import orjson
from django.http import HttpResponse, HttpResponseBase

from accounts.grants import KeyGrant
from serving.gateway.auth import request_grant
from serving.gateway.model_access import find_model_for
from serving.gateway.requests import ApiRequest, reads_body, require_method
from serving.gateway.responses import EventStreamResponse
from serving.gateway.routing import ModelRoute, routing_table
from serving.llm.answers import annotate_answer, current_limits, run_call, sse
from serving.llm.call import CHAT, COMPLETIONS, EMBEDDINGS, Endpoint, InferenceCall


def _json(data: Any, *, status: int = 200) -> HttpResponse:
    return HttpResponse(orjson.dumps(data), status=status, content_type="application/json")


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


async def _infer(request: ApiRequest, endpoint: Endpoint) -> HttpResponseBase:
    require_method(request, "POST")
    grant = await request_grant(request)
    call = InferenceCall(endpoint, grant, request.request_id)
    answer = await run_call(request, call, request.body, pinned_version=_pinned_version(request))
    response: HttpResponseBase = EventStreamResponse(sse(call)) if answer is None else _json(answer)
    annotate_answer(response, call)
    return response


async def _with_limits(response: HttpResponse, grant: KeyGrant) -> HttpResponse:
    for name, value in (await current_limits(grant)).items():
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
