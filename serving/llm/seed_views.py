"""The seed design's generate and embed shapes, as thin adapters over the OpenAI paths.

- ``POST /api/v1/generate`` ``{"model", "prompt", "max_tokens", "stream", …}`` and
  ``POST /api/v1/models/{name}/generate`` (the model from the path): a chat model is asked
  with the prompt as one user message (its chat template applies), a completion model with
  the prompt as is. With ``"stream": true`` the answer is SSE: ``data: {"token": "…"}`` per
  piece of text, then ``data: {"finish_reason", "usage"}`` and ``data: [DONE]`` (an
  ``{"error": …}`` event instead when the engine fails); else JSON ``{"model", "text",
  "finish_reason", "usage", "latency_ms"}``.
- ``POST /api/v1/embed`` ``{"model", "inputs": [text, …]}`` → ``{"model", "embeddings",
  "dimensions", "usage"}``.

Each runs the same ``InferenceCall`` as the OpenAI path it adapts (key, limits, routing,
canaries, caches, metering), and answers with the same headers; errors in OpenAI's shape.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from django.http import HttpResponse, HttpResponseBase

from accounts.grants import KeyGrant
from serving.gateway.auth import request_grant
from serving.gateway.errors import InvalidRequest
from serving.gateway.model_access import find_model_for
from serving.gateway.requests import ApiRequest, json_object, model_name, reads_body, require_method
from serving.gateway.responses import EventStreamResponse
from serving.llm.answers import annotate_answer, run_call, sse
from serving.llm.call import CHAT, COMPLETIONS, EMBEDDINGS, Endpoint, InferenceCall

# Sampling fields the seeds' generate passes through to the OpenAI request as they are.
SAMPLING = ("max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "user")


# --- generate ------------------------------------------------------------------------------


async def _generate(request: ApiRequest, grant: KeyGrant, model: str, data: dict[str, Any]) -> HttpResponseBase:
    started = time.perf_counter()
    prompt = data.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest("prompt is required: the text to continue or answer.", param="prompt")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be true or false.", param="stream")
    route = await find_model_for(grant, model)  # one outside the key's scope does not exist
    endpoint: Endpoint = CHAT if route.task in CHAT.tasks else COMPLETIONS
    body: dict[str, Any] = {"model": model, "stream": stream}
    if endpoint is CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body |= {name: data[name] for name in SAMPLING if name in data}
    if stream:
        body["stream_options"] = {"include_usage": True}
    call = InferenceCall(endpoint, grant, request.request_id)
    answer = await run_call(request, call, orjson.dumps(body))
    if answer is None:
        tokens = _Tokens()
        response: HttpResponseBase = EventStreamResponse(sse(call, tokens.render, tokens.last))
    else:
        choice = answer["choices"][0]
        text = choice["message"]["content"] if endpoint is CHAT else choice["text"]
        response = HttpResponse(
            orjson.dumps(
                {
                    "model": model,
                    "text": text or "",
                    "finish_reason": choice.get("finish_reason"),
                    "usage": answer.get("usage"),
                    "latency_ms": round((time.perf_counter() - started) * 1000, 2),
                }
            ),
            content_type="application/json",
        )
    annotate_answer(response, call)
    return response


class _Tokens:
    """A stream's chunks as the seeds' events: a ``{"token"}`` per piece of text, and last the
    finish reason and usage the chunks carried."""

    def __init__(self) -> None:
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def render(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                events.append({"token": str(text)})
            self.finish = choice.get("finish_reason") or self.finish
        return events

    def last(self) -> dict[str, Any]:
        return {"finish_reason": self.finish, "usage": self.usage}


@reads_body()
async def generate(request: ApiRequest) -> HttpResponseBase:
    """``POST /api/v1/generate``."""
    require_method(request, "POST")
    grant = await request_grant(request)  # a 401 before any word on the body
    data = json_object(request.body)
    return await _generate(request, grant, model_name(data), data)


@reads_body()
async def model_generate(request: ApiRequest, model: str) -> HttpResponseBase:
    """``POST /api/v1/models/{name}/generate``: the model from the path (one in the body must agree)."""
    require_method(request, "POST")
    grant = await request_grant(request)
    data = json_object(request.body)
    if data.get("model") not in (None, model):
        raise InvalidRequest(f"The body names the model `{data['model']}` but the path `{model}`.", param="model")
    return await _generate(request, grant, model, data)


# --- embed ---------------------------------------------------------------------------------


@reads_body()
async def embed(request: ApiRequest) -> HttpResponseBase:
    """``POST /api/v1/embed``."""
    require_method(request, "POST")
    grant = await request_grant(request)
    data = json_object(request.body)
    model = model_name(data)
    inputs = data.get("inputs")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) and i for i in inputs):
        raise InvalidRequest("inputs is required: a list of non-empty texts.", param="inputs")
    call = InferenceCall(EMBEDDINGS, grant, request.request_id)
    answer = await run_call(request, call, orjson.dumps({"model": model, "input": inputs}))
    assert answer is not None  # embeddings never stream
    embeddings = [item["embedding"] for item in sorted(answer["data"], key=lambda item: item["index"])]
    response = HttpResponse(
        orjson.dumps(
            {
                "model": model,
                "embeddings": embeddings,
                "dimensions": len(embeddings[0]) if embeddings else 0,
                "usage": answer.get("usage"),
            }
        ),
        content_type="application/json",
    )
    annotate_answer(response, call)
    return response
