"""The seeds' prediction shapes over a ``PredictCall``: instances as the seeds send them, the
``params.version`` pin, and the one-instance answer that ``/api/v1/predict`` and batch jobs' lines
(``serving.batches``) share."""

from __future__ import annotations

import time
from typing import Any

from registry.signatures import Signature
from serving.gateway.errors import InvalidRequest
from serving.gateway.inference_protocol import instances_to_tensors, predictions
from serving.gateway.requests import model_name
from serving.predict.call import Parse, PredictCall


def instances_parse(instances: object) -> Parse[None]:
    """The seeds' instances as a ``PredictCall.take_inputs`` reads them."""

    def parse(signature: Signature) -> tuple[object, None]:
        return instances_to_tensors(signature, instances), None

    return parse


def version_param(data: dict[str, Any]) -> str | None:
    params = data.get("params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise InvalidRequest("params must be an object.", param="params")
    version = params.get("version")
    if version is not None and not isinstance(version, str):
        raise InvalidRequest("params.version must be a string.", param="params.version")
    return version or None


async def predict_answer(call: PredictCall, data: dict[str, Any], *, size: int = 0) -> dict[str, Any]:
    """The seeds' one-instance prediction (``{"model", "input", "params"}``) run by ``call``:
    its answer's body. Shared by ``/api/v1/predict`` and batch jobs' lines (``serving.batches``);
    ``size``: the request body's bytes (``PredictCall.take_inputs``)."""
    started = time.perf_counter()
    model = model_name(data)
    if "input" not in data:
        raise InvalidRequest('input is required: one instance, e.g. {"text": "…"}.', param="input")
    await call.prepare(model, version=version_param(data))
    await call.take_inputs(instances_parse([data["input"]]), size=size)
    outputs = await call.run()
    answer = predictions(outputs, call.version.labels, call.rows)[0]
    call.stage_ms["total"] = (time.perf_counter() - started) * 1000
    return {
        "model": call.model.name,
        "model_version": call.version.version,
        "prediction": answer.get("prediction"),
        "confidence": answer.get("confidence"),
        "outputs": answer["outputs"],
        "latency_ms": round(call.stage_ms["total"], 2),
    }
