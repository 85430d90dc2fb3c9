"""Small models over HTTP: the Open Inference Protocol (v2) that KServe, Triton and MLServer
speak, so the unmodified ``tritonclient`` works against the gateway, and the seeds' shapes.

- ``GET /v2``, ``/v2/health/live``, ``/v2/health/ready``: the server (no key needed);
- ``GET /v2/models/{name}[/versions/{v}]`` and ``…/ready``: a model's signature and readiness;
- ``POST /v2/models/{name}[/versions/{v}]/infer``: JSON tensors or Triton's binary extension,
  in and out as the client asks; errors in the protocol's shape ``{"error": "…"}``;
- ``POST /api/v1/models/{name}/predict`` ``{"inputs": [instance, …], "params": {"version"}}``
  → ``{"model", "model_version", "predictions": [{"prediction", "confidence", "outputs"}],
  "latency_ms"}``, and ``POST /api/v1/predict`` ``{"model", "input": instance}`` →
  ``{"prediction", "confidence", "latency_ms", …}`` (errors in OpenAI's shape, like /api/v1).

Every inference goes through ``serving.predict.call.PredictCall``: the key, its limits, the
router, the result cache and metering. The version that answered is in ``x-model-version``,
the cache's outcome in ``x-cache``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

import orjson
from django.conf import settings
from django.http import HttpResponse

from accounts.grants import KeyGrant
from registry.signatures import Signature
from serving.gateway.auth import request_grant
from serving.gateway.errors import APIError
from serving.gateway.inference_protocol import (
    EXTENSIONS,
    HEADER_LENGTH,
    SERVER_NAME,
    encode_response,
    predictions,
    read_body,
    requested_outputs,
)
from serving.gateway.openai_wire import rate_limit_headers
from serving.gateway.requests import ApiRequest, json_object, reads_body, require_method
from serving.gateway.routing import ModelRoute, routing_table
from serving.predict.call import PredictCall, is_ready, predict_model, served_versions
from serving.predict.call import model_metadata as call_model_metadata
from serving.predict.instances import instances_parse, predict_answer, version_param

View = TypeVar("View", bound=Callable[..., Coroutine[Any, Any, HttpResponse]])


def _json(data: Any, *, status: int = 200) -> HttpResponse:
    return HttpResponse(orjson.dumps(data), status=status, content_type="application/json")


def protocol_errors(view: View) -> View:
    """Errors as the protocol has them: ``{"error": "<message>"}`` with the status (and any
    headers, e.g. Retry-After) the error carries."""

    @functools.wraps(view)
    async def wrapped(request: ApiRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return await view(request, *args, **kwargs)
        except APIError as exc:
            response = _json({"error": exc.message}, status=exc.status)
            for name, value in exc.headers.items():
                response[name] = value
            return response

    return cast(View, wrapped)


# --- server ------------------------------------------------------------------------------


@protocol_errors
async def server_metadata(request: ApiRequest) -> HttpResponse:
    require_method(request, "GET")
    return _json({"name": SERVER_NAME, "version": settings.PLATFORM_VERSION, "extensions": list(EXTENSIONS)})


@protocol_errors
async def server_live(request: ApiRequest) -> HttpResponse:
    require_method(request, "GET")
    return _json({"live": True})


@protocol_errors
async def server_ready(request: ApiRequest) -> HttpResponse:
    """Ready when this gateway has a routing table (it can route a request now)."""
    require_method(request, "GET")
    await routing_table()
    return _json({"ready": True})


# --- models ------------------------------------------------------------------------------


async def _model(request: ApiRequest, name: str) -> ModelRoute:
    return await predict_model(await request_grant(request), name)


@protocol_errors
async def model_metadata(request: ApiRequest, model: str, version: str | None = None) -> HttpResponse:
    require_method(request, "GET")
    route = await _model(request, model)
    return _json(call_model_metadata(route, served_versions(route, version)))


@protocol_errors
async def model_ready(request: ApiRequest, model: str, version: str | None = None) -> HttpResponse:
    """200 when a replica of the model (or that version) can take a request now, else 503."""
    require_method(request, "GET")
    route = await _model(request, model)
    if is_ready(served_versions(route, version)):
        return _json({"name": route.name, "ready": True})
    raise APIError(f"No replica of `{route.name}` is ready.", status=503)


@reads_body()
@protocol_errors
async def model_infer(request: ApiRequest, model: str, version: str | None = None) -> HttpResponse:
    require_method(request, "POST")
    grant = await request_grant(request)
    call = PredictCall(grant, request.request_id, endpoint="v2-infer")
    request.on_close(call.close)
    pinned = version or (request.header("x-model-version") or "").strip() or None
    await call.prepare(model, version=pinned, pin_param="model_version")
    raw, header_length = request.body, request.header(HEADER_LENGTH)

    def parse(signature: Signature) -> tuple[object, tuple[dict[str, bool], str | None]]:
        body = read_body(raw, header_length)
        request_id = body.get("id") if isinstance(body.get("id"), str) else None
        return body.get("inputs"), (requested_outputs(signature, body), request_id)

    wanted, request_id = await call.take_inputs(parse, size=len(raw))
    outputs = await call.run()
    content, length = encode_response(
        call.signature, outputs, wanted, model_name=call.model.name, model_version=call.version.version,
        request_id=request_id,
    )  # fmt: skip
    response = HttpResponse(content, content_type="application/octet-stream" if length else "application/json")
    if length is not None:
        response[HEADER_LENGTH] = str(length)
    _annotate(response, call)
    return response


def _annotate(response: HttpResponse, call: PredictCall) -> None:
    response["x-model-version"] = call.version.version
    response["x-cache"] = call.cache
    if call.rate_limits is not None:
        for name, value in rate_limit_headers(call.rate_limits).items():
            response[name] = value
    response["Server-Timing"] = ", ".join(f"{stage};dur={ms:.2f}" for stage, ms in call.stage_ms.items())


# --- the seeds' shapes -------------------------------------------------------------------


async def _predict(
    request: ApiRequest, grant: KeyGrant, model: str, instances: object, version: str | None, *, endpoint: str
) -> tuple[PredictCall, list[dict[str, Any]]]:
    started = time.perf_counter()
    call = PredictCall(grant, request.request_id, endpoint=endpoint)
    request.on_close(call.close)
    await call.prepare(model, version=version)
    await call.take_inputs(instances_parse(instances), size=len(request.body))
    outputs = await call.run()
    answers = predictions(outputs, call.version.labels, call.rows)
    call.stage_ms["total"] = (time.perf_counter() - started) * 1000
    return call, answers


@reads_body(sessions=True)
async def model_predict(request: ApiRequest, model: str) -> HttpResponse:
    """``POST /api/v1/models/{name}/predict``: a batch of instances, one prediction each."""
    require_method(request, "POST")
    grant = await request_grant(request, sessions=True)  # a 401 before any word on the body
    data = json_object(request.body)
    call, answers = await _predict(request, grant, model, data.get("inputs"), version_param(data), endpoint="predict")
    response = _json({
        "model": call.model.name,
        "model_version": call.version.version,
        "predictions": answers,
        "latency_ms": round(call.stage_ms["total"], 2),
    })  # fmt: skip
    _annotate(response, call)
    return response


@reads_body(sessions=True)
async def predict(request: ApiRequest) -> HttpResponse:
    """``POST /api/v1/predict`` ``{"model", "input"}``: one instance, one prediction."""
    require_method(request, "POST")
    grant = await request_grant(request, sessions=True)
    data = json_object(request.body)
    call = PredictCall(grant, request.request_id, endpoint="predict")
    request.on_close(call.close)
    response = _json(await predict_answer(call, data, size=len(request.body)))
    _annotate(response, call)
    return response
