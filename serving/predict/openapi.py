"""The Open Inference Protocol's paths (small models) and the seeds' predict shapes in the OpenAPI schema."""

from __future__ import annotations

from typing import Any

from registry.signatures import DATATYPES
from serving.gateway.openapi import COMPONENT, EVENT_STREAM, INFERENCE_ERRORS, READ_ERRORS, USAGE, json_ok, operation

_TENSOR = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "datatype": {"type": "string", "enum": sorted(DATATYPES)},
        "parameters": {
            "type": "object",
            "description": "`binary_data_size`: the tensor's bytes follow the JSON (binary extension)",
        },
        "data": {"type": "array", "items": {}, "description": "the elements, flat in row-major order, or nested"},
    },
    "required": ["name", "shape", "datatype"],
}


SMALL_SCHEMAS: dict[str, Any] = {
    "InferenceTensor": _TENSOR,
    "InferenceRequest": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object"},
            "inputs": {"type": "array", "items": {"$ref": COMPONENT.format(model="InferenceTensor")}},
            "outputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
                    "required": ["name"],
                },
            },
        },
        "required": ["inputs"],
    },
    "InferenceResponse": {
        "type": "object",
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "outputs": {"type": "array", "items": {"$ref": COMPONENT.format(model="InferenceTensor")}},
        },
        "required": ["model_name", "outputs"],
    },
    "ProtocolError": {
        "type": "object",
        "properties": {"error": {"type": "string"}},
        "required": ["error"],
        "description": "the Open Inference Protocol's error body",
    },
    "ModelMetadata": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": {"type": "object"}},
            "outputs": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["name", "versions", "platform", "inputs", "outputs"],
    },
    "PredictParams": {
        "type": "object",
        "properties": {"version": {"type": "string", "description": "serve it from this version"}},
    },
    "PredictRequest": {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "input": {"description": 'one instance: `{"text": "…"}`, `{"<input>": [...]}` or the values'},
            "params": {"$ref": COMPONENT.format(model="PredictParams")},
        },
        "required": ["model", "input"],
    },
    "PredictAnswer": {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "model_version": {"type": "string"},
            "prediction": {"nullable": True, "description": "the label (a classifier's), else null"},
            "confidence": {"type": "number", "nullable": True},
            "outputs": {"type": "object", "description": "every output of the instance, by name"},
            "latency_ms": {"type": "number"},
        },
        "required": ["model", "model_version", "prediction", "confidence", "outputs", "latency_ms"],
    },
    "ModelPredictRequest": {
        "type": "object",
        "properties": {
            "inputs": {"type": "array", "items": {}, "description": "the instances, one prediction each"},
            "params": {"$ref": COMPONENT.format(model="PredictParams")},
        },
        "required": ["inputs"],
    },
    "ModelPredictAnswer": {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "model_version": {"type": "string"},
            "predictions": {"type": "array", "items": {"type": "object"}},
            "latency_ms": {"type": "number"},
        },
        "required": ["model", "model_version", "predictions", "latency_ms"],
    },
    "GenerateRequest": {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "prompt": {"type": "string"},
            "stream": {"type": "boolean", "default": False},
            "max_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        },
        "required": ["prompt"],
        "description": "`model` is required on /api/v1/generate (the path names it on the other); "
        "other sampling fields as in /v1/chat/completions",
    },
    "GenerateAnswer": {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "text": {"type": "string"},
            "finish_reason": {"type": "string", "nullable": True},
            "usage": {**USAGE, "nullable": True},
            "latency_ms": {"type": "number"},
        },
        "required": ["model", "text", "finish_reason", "latency_ms"],
    },
    "EmbedRequest": {
        "type": "object",
        "properties": {"model": {"type": "string"}, "inputs": {"type": "array", "items": {"type": "string"}}},
        "required": ["model", "inputs"],
    },
    "EmbedAnswer": {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "embeddings": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
            "dimensions": {"type": "integer"},
            "usage": {**USAGE, "nullable": True},
        },
        "required": ["model", "embeddings", "dimensions"],
    },
}


_PROTOCOL_ERROR = {
    "oneOf": [{"$ref": COMPONENT.format(model="ProtocolError")}, {"$ref": COMPONENT.format(model="OpenAIError")}]
}


_MODEL = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
_VERSION = {"name": "version", "in": "path", "required": True, "schema": {"type": "string"}}


def _protocol_operation(
    operation_id: str, summary: str, *, ok: dict[str, Any], errors: tuple[int, ...], **fields: Any
) -> dict[str, Any]:
    """An Open Inference Protocol operation: its errors in the protocol's shape (OpenAI's for
    what the gateway refuses before the protocol's view: an unknown path, a body too large)."""
    described = operation(operation_id, summary, ok=ok, errors=errors, **fields)
    for status in errors:
        described["responses"][str(status)]["content"] = {"application/json": {"schema": _PROTOCOL_ERROR}}
    return described


def small_model_paths() -> dict[str, dict[str, Any]]:
    """The Open Inference Protocol over HTTP, and the seeds' predict, generate and embed shapes."""
    public: dict[str, Any] = {"security": []}
    server = {
        "/v2": ("v2_server_metadata", "The server's name, version and protocol extensions"),
        "/v2/health/live": ("v2_server_live", "The server is live"),
        "/v2/health/ready": ("v2_server_ready", "The server can route requests"),
    }
    paths: dict[str, dict[str, Any]] = {}
    for path, (name, summary) in server.items():
        ok = {"description": summary, "content": {"application/json": {"schema": {"type": "object"}}}}
        paths[path] = {"get": {**_protocol_operation(name, summary, ok=ok, errors=(405, 503)), **public}}
    infer_ok = json_ok("InferenceResponse", "the outputs (with the binary extension: JSON, then the bytes)")
    infer_ok["content"]["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
    for suffix, parameters, tag in (("", [_MODEL], ""), ("/versions/{version}", [_MODEL, _VERSION], "_version")):
        base = "/v2/models/{model}" + suffix
        paths[base] = {
            "get": _protocol_operation(
                f"v2_model_metadata{tag}", "The model's signature", ok=json_ok("ModelMetadata", "its metadata"),
                errors=(400, *READ_ERRORS), parameters=parameters,
            )
        }  # fmt: skip
        paths[base + "/ready"] = {
            "get": _protocol_operation(
                f"v2_model_ready{tag}", "A replica can take a request now (503 when none can)",
                ok={"description": "ready", "content": {"application/json": {"schema": {"type": "object"}}}},
                errors=(400, *READ_ERRORS), parameters=parameters,
            )
        }  # fmt: skip
        infer = _protocol_operation(
            f"v2_model_infer{tag}", "Run the model (Open Inference Protocol)", ok=infer_ok,
            errors=INFERENCE_ERRORS, body="InferenceRequest", parameters=parameters,
        )  # fmt: skip
        infer["requestBody"]["content"]["application/octet-stream"] = {
            "schema": {"type": "string", "format": "binary"},
        }
        infer["description"] = (
            "JSON tensors, or the binary extension (`Inference-Header-Content-Length`: the JSON part's "
            "length, the tensors' bytes after it). A tensor that does not fit the signature is a 400 naming it."
        )
        paths[base + "/infer"] = {"post": infer}
    predict_errors = INFERENCE_ERRORS
    paths["/api/v1/predict"] = {
        "post": operation(
            "seed_predict", "One prediction", ok=json_ok("PredictAnswer", "the prediction"), errors=predict_errors,
            body="PredictRequest",
        )
    }  # fmt: skip
    paths["/api/v1/models/{model}/predict"] = {
        "post": operation(
            "seed_model_predict", "A prediction per instance", ok=json_ok("ModelPredictAnswer", "the predictions"),
            errors=predict_errors, body="ModelPredictRequest", parameters=[_MODEL],
        )
    }  # fmt: skip
    generate_ok = json_ok("GenerateAnswer", 'the text; with `stream: true`, SSE of `{"token"}` then the finish')
    generate_ok["content"].update(EVENT_STREAM)
    paths["/api/v1/generate"] = {
        "post": operation(
            "seed_generate", "Generate text", ok=generate_ok, errors=INFERENCE_ERRORS, body="GenerateRequest"
        )
    }
    paths["/api/v1/models/{model}/generate"] = {
        "post": operation(
            "seed_model_generate", "Generate text with the model in the path", ok=generate_ok,
            errors=INFERENCE_ERRORS, body="GenerateRequest", parameters=[_MODEL],
        )
    }  # fmt: skip
    embed_ok = json_ok("EmbedAnswer", "one embedding per text")
    paths["/api/v1/embed"] = {
        "post": operation("seed_embed", "Embed texts", ok=embed_ok, errors=INFERENCE_ERRORS, body="EmbedRequest")
    }
    return paths
