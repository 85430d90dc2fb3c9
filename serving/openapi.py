"""The data plane in the OpenAPI schema: OpenAI's paths, the request bodies of ``serving.llm.schemas``,
the Open Inference Protocol's paths (small models) and the seed design's shapes.

The data plane is no DRF view (``serving.gateway.asgi`` serves it), so drf-spectacular cannot see
it; ``add_data_plane``, one of its postprocessing hooks, adds it to the schema at
``/api/schema/``. Request bodies come from the pydantic models that validate them, so the
schema cannot drift from what the gateway accepts. Every operation documents the errors
the gateway answers, each an OpenAI error body. The WebSocket API
(``/ws/v1/chat/completions``, ``serving.llm.consumers``) has no OpenAPI form.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from registry.signatures import DATATYPES
from serving.llm.schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, EmbeddingRequest

COMPONENT = "#/components/schemas/{model}"
BEARER = "bearerAuth"
TAG = "inference"

# What each error status means on the data plane (serving.gateway.errors; the engine's own 4xx pass through).
ERRORS: dict[int, str] = {
    400: "invalid request: bad JSON, an unknown or invalid argument (`param` names it), an unknown model, "
    "a context too long, or the engine's own refusal",
    401: "missing, incorrect, revoked or expired API key",
    403: "the key may not use this model",
    404: "no such path (or the engine's own 404)",
    405: "this path does not take that method (see `Allow`)",
    409: "the object's state does not allow it (a batch that has finished cannot be cancelled)",
    413: "the body is larger than the API accepts",
    429: "a rate limit, quota, budget or the model's queue refused it (see `Retry-After`)",
    502: "the engine failed after taking the request",
    503: "no replica is ready, or the platform's database, Redis or limiter is unavailable",
    504: "the engine sent no token in time, or the request ran past its time limit",
}
INFERENCE_ERRORS = tuple(status for status in ERRORS if status != 409)
READ_ERRORS = (401, 404, 405, 413, 503)

_ERROR_SCHEMAS: dict[str, Any] = {
    "OpenAIErrorDetail": {
        "type": "object",
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": "string", "nullable": True, "description": "the offending parameter, when one is"},
            "code": {"type": "string", "nullable": True},
        },
        "required": ["message", "type", "param", "code"],
    },
    "OpenAIError": {
        "type": "object",
        "properties": {"error": {"$ref": "#/components/schemas/OpenAIErrorDetail"}},
        "required": ["error"],
    },
}

_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": "object",
            "nullable": True,
            "properties": {"cached_tokens": {"type": "integer", "nullable": True}},
        },
    },
    "required": ["prompt_tokens", "total_tokens"],
}

# The answers, as far as the gateway shapes them: our id and the public model name on the
# engine's own answer (whose other fields pass through, so more may come).
_RESPONSE_SCHEMAS: dict[str, Any] = {
    "ChatCompletion": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "example": "chatcmpl-3f0c…"},
            "object": {"type": "string", "enum": ["chat.completion"]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "maxItems": MAX_CHOICES,
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        "message": {
                            "type": "object",
                            "properties": {
                                "role": {"type": "string"},
                                "content": {"type": "string", "nullable": True},
                                "tool_calls": {"type": "array", "nullable": True, "items": {"type": "object"}},
                            },
                            "required": ["role"],
                        },
                        "finish_reason": {"type": "string", "nullable": True},
                    },
                    "required": ["index", "message"],
                },
            },
            "usage": _USAGE,
        },
        "required": ["id", "object", "model", "choices"],
    },
    "TextCompletion": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "example": "cmpl-3f0c…"},
            "object": {"type": "string", "enum": ["text_completion"]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        "text": {"type": "string"},
                        "finish_reason": {"type": "string", "nullable": True},
                    },
                    "required": ["index", "text"],
                },
            },
            "usage": _USAGE,
        },
        "required": ["id", "object", "model", "choices"],
    },
    "EmbeddingList": {
        "type": "object",
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "model": {"type": "string"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        "object": {"type": "string", "enum": ["embedding"]},
                        "embedding": {
                            "description": "numbers, or a base64 string with encoding_format base64",
                            "oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}],
                        },
                    },
                    "required": ["index", "embedding"],
                },
            },
            "usage": _USAGE,
        },
        "required": ["object", "model", "data"],
    },
    "OpenAIModel": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "description": "the public model name"},
            "object": {"type": "string", "enum": ["model"]},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
        "required": ["id", "object", "created", "owned_by"],
    },
    "OpenAIModelList": {
        "type": "object",
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": {"$ref": "#/components/schemas/OpenAIModel"}},
        },
        "required": ["object", "data"],
    },
    "KeyUsageDay": {
        "type": "object",
        "properties": {
            "object": {"type": "string", "enum": ["usage.daily"]},
            "date": {"type": "string", "format": "date"},
            "model": {"type": "string"},
            "requests": {"type": "integer"},
            "errors": {"type": "integer", "description": "requests answered outside 2xx"},
            "input_tokens": {"type": "integer", "description": "prompt tokens less cached ones"},
            "output_tokens": {"type": "integer"},
            "cached_tokens": {"type": "integer"},
            "cost": {"type": "string", "description": "a decimal amount, exact to 12 places"},
            "batch_requests": {"type": "integer", "description": "of requests: batch jobs' lines"},
            "batch_cost": {"type": "string", "description": "of cost: batch jobs' lines', at the batch price"},
            "currency": {"type": "string"},
        },
        "required": [
            *("object", "date", "model", "requests", "errors"),
            *("input_tokens", "output_tokens", "cached_tokens", "cost", "currency"),
        ],
    },
    "KeyUsagePage": {
        "type": "object",
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": {"$ref": "#/components/schemas/KeyUsageDay"}},
            "has_more": {"type": "boolean"},
            "next_page": {"type": "string", "nullable": True, "description": "pass as `after` for the next page"},
        },
        "required": ["object", "data", "has_more", "next_page"],
    },
}

_REQUEST_ID = {"x-request-id": {"description": "the request's id (its usage record's)", "schema": {"type": "string"}}}
# One server-sent event (its `data` a JSON text, the last one `[DONE]`).
_EVENT_STREAM = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
        }
    }
}
_STREAMED = (
    'the answer; with `stream: true`, server-sent events: `data: <chunk JSON>` per chunk, a `data: {"error": …}` '
    "event if the engine fails mid-way, else `data: [DONE]` last"
)
_MODEL_VERSION = {
    "name": "X-Model-Version",
    "in": "header",
    "required": False,
    "description": "serve the request from this version of the model (the answer's `x-model-version` says which "
    "version served it)",
    "schema": {"type": "string"},
}


def _error_responses(statuses: tuple[int, ...]) -> dict[str, Any]:
    return {
        str(status): {
            "description": ERRORS[status],
            "headers": _REQUEST_ID,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}},
        }
        for status in statuses
    }


def _operation(
    operation_id: str,
    summary: str,
    *,
    ok: dict[str, Any],
    errors: tuple[int, ...],
    body: str | None = None,
    parameters: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        "tags": [TAG],
        "security": [{BEARER: []}],
        "parameters": parameters or [],
        "responses": {"200": {"headers": _REQUEST_ID, **ok}, **_error_responses(errors)},
    }
    if body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": COMPONENT.format(model=body)}}},
        }
    return operation


def _json_ok(schema: str, description: str) -> dict[str, Any]:
    reference = {"$ref": COMPONENT.format(model=schema)}
    return {"description": description, "content": {"application/json": {"schema": reference}}}


def data_plane_paths() -> dict[str, dict[str, Any]]:
    """OpenAI's paths as the gateway serves them, with the seed design's /api/v1 aliases."""
    limit = settings.API_MAX_BODY_BYTES
    inference = {
        "chat/completions": (
            "chat_completions", "Create a chat completion", ChatCompletionRequest, "ChatCompletion", True,
        ),
        "completions": ("completions", "Create a text completion", CompletionRequest, "TextCompletion", True),
        "embeddings": ("embeddings", "Create embeddings", EmbeddingRequest, "EmbeddingList", False),
    }  # fmt: skip
    paths: dict[str, dict[str, Any]] = {}
    for path, (name, summary, model, answer, streams) in inference.items():
        ok = _json_ok(answer, _STREAMED if streams else "the answer")
        if streams:
            ok["content"].update(_EVENT_STREAM)
        for prefix in ("/v1/", "/api/v1/"):
            alias = prefix != "/v1/"
            post = _operation(
                f"openai_{name}{'_alias' if alias else ''}",
                summary + (" (alias of /v1/" + path + ")" if alias else ""),
                ok=ok,
                errors=INFERENCE_ERRORS,
                body=model.__name__,
                parameters=[_MODEL_VERSION],
            )
            post["description"] = (
                f"Bodies larger than {limit} bytes are refused (413) before they are read. Nothing is dispatched "
                "or metered for a request refused before admission."
            )
            paths[prefix + path] = {"post": post}
    paths["/v1/models"] = {
        "get": _operation(
            "openai_models_list", "The models this key may use", ok=_json_ok("OpenAIModelList", "the models"),
            errors=READ_ERRORS,
        )
    }  # fmt: skip
    paths["/v1/models/{model}"] = {
        "get": _operation(
            "openai_models_retrieve",
            "One model",
            ok=_json_ok("OpenAIModel", "the model"),
            errors=(400, 403, *READ_ERRORS),
            parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        )
    }
    usage_parameters = [
        {"name": "start_date", "in": "query", "schema": {"type": "string", "format": "date"},
         "description": "the first UTC day, YYYY-MM-DD (default: 29 days before end_date)"},
        {"name": "end_date", "in": "query", "schema": {"type": "string", "format": "date"},
         "description": "the last UTC day, inclusive (default: today)"},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 30}},
        {"name": "after", "in": "query", "schema": {"type": "string"},
         "description": "the previous page's next_page"},
    ]  # fmt: skip
    for prefix in ("/v1/", "/api/v1/"):
        paths[prefix + "usage"] = {
            "get": _operation(
                f"openai_usage{'_alias' if prefix != '/v1/' else ''}",
                "This key's usage and cost by UTC day and model",
                ok=_json_ok("KeyUsagePage", "one page, oldest day first"),
                errors=(400, *READ_ERRORS),
                parameters=usage_parameters,
            )
        }
    return paths


# --- small models: the Open Inference Protocol (v2) and the seeds' predict shapes -----------

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
_SMALL_SCHEMAS: dict[str, Any] = {
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
            "usage": {**_USAGE, "nullable": True},
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
            "usage": {**_USAGE, "nullable": True},
        },
        "required": ["model", "embeddings", "dimensions"],
    },
}


def _page_of(item: str) -> dict[str, Any]:
    """OpenAI's cursor-paged list of ``item`` objects."""
    return {
        "type": "object",
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": {"$ref": COMPONENT.format(model=item)}},
            "has_more": {"type": "boolean"},
            "first_id": {"type": "string", "nullable": True},
            "last_id": {"type": "string", "nullable": True},
        },
        "required": ["object", "data", "has_more"],
    }


_FILE_SCHEMAS: dict[str, Any] = {
    "OpenAIFile": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "example": "file-3f0c…"},
            "object": {"type": "string", "enum": ["file"]},
            "bytes": {"type": "integer"},
            "created_at": {"type": "integer"},
            "expires_at": {"type": "integer", "nullable": True},
            "filename": {"type": "string"},
            "purpose": {"type": "string"},
            "status": {"type": "string", "enum": ["processed"]},
            "status_details": {"type": "string", "nullable": True},
        },
        "required": ["id", "object", "bytes", "created_at", "filename", "purpose", "status"],
    },
    "OpenAIFileList": _page_of("OpenAIFile"),
    "OpenAIFileDeleted": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["file"]},
            "deleted": {"type": "boolean"},
        },
        "required": ["id", "object", "deleted"],
    },
    "OpenAIFileUpload": {
        "type": "object",
        "properties": {
            "file": {"type": "string", "format": "binary", "description": "JSONL: one batch request per line"},
            "purpose": {"type": "string", "enum": ["batch"]},
        },
        "required": ["file", "purpose"],
    },
}
_FILE_ID = {"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}
_BATCH_ID = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}
_STAMP = {"type": "integer", "nullable": True}
_CACHE_SCHEMAS: dict[str, Any] = {
    "CacheFeedbackCreate": {
        "type": "object",
        "properties": {
            "request_id": {"type": "string", "description": "the x-request-id header's UUID, or the answer's id"},
            "reason": {"type": "string", "maxLength": 500},
        },
        "required": ["request_id"],
        "additionalProperties": False,
    },
    "CacheFeedback": {
        "type": "object",
        "properties": {
            "object": {"type": "string", "enum": ["cache.feedback"]},
            "request_id": {"type": "string"},
            "model": {"type": "string"},
            "model_version": {"type": "string"},
            "wording": {"type": "string", "description": "the tier it was served at: exact, same, typo, reordered"},
            "tightened": {"type": "integer", "description": "cache entries tightened (the served one, neighbours)"},
            "created_at": {"type": "integer"},
        },
        "required": ["object", "request_id", "model", "model_version", "wording", "tightened", "created_at"],
    },
}


def cache_paths() -> dict[str, dict[str, Any]]:
    """Feedback on answers served from the semantic cache (``serving.semcache.views``)."""
    report = _operation(
        "cache_feedback_create", "Report an answer served from the cache as wrong",
        ok=_json_ok("CacheFeedback", "the report (the first one, when the request was reported before)"),
        errors=(400, 401, 404, 405, 413, 503), body="CacheFeedbackCreate",
    )  # fmt: skip
    report["description"] = (
        "The cache entry that answered and its near neighbours serve only closer matches from now on, and the "
        "report counts in the model's wrong-hit estimate."
    )
    return {"/v1/cache/feedback": {"post": report}}


_BATCH_SCHEMAS: dict[str, Any] = {
    "OpenAIBatchCreate": {
        "type": "object",
        "properties": {
            "input_file_id": {"type": "string", "description": "a file uploaded with purpose `batch`"},
            "endpoint": {
                "type": "string",
                "enum": ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/v1/predict"],
            },
            "completion_window": {"type": "string", "enum": ["24h"]},
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}, "nullable": True},
        },
        "required": ["input_file_id", "endpoint", "completion_window"],
    },
    "OpenAIBatch": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "example": "batch_6c1a…"},
            "object": {"type": "string", "enum": ["batch"]},
            "endpoint": {"type": "string"},
            "model": {"type": "string", "nullable": True},
            "errors": {"type": "object", "nullable": True},
            "input_file_id": {"type": "string"},
            "completion_window": {"type": "string"},
            "status": {
                "type": "string",
                "enum": [
                    "validating",
                    "failed",
                    "in_progress",
                    "finalizing",
                    "completed",
                    "expired",
                    "cancelling",
                    "cancelled",
                ],
            },
            "output_file_id": {"type": "string", "nullable": True},
            "error_file_id": {"type": "string", "nullable": True},
            "created_at": {"type": "integer"},
            **{
                name: _STAMP
                for name in (
                    "in_progress_at",
                    "expires_at",
                    "finalizing_at",
                    "completed_at",
                    "failed_at",
                    "expired_at",
                    "cancelling_at",
                    "cancelled_at",
                )
            },
            "request_counts": {
                "type": "object",
                "properties": {n: {"type": "integer"} for n in ("total", "completed", "failed")},
                "required": ["total", "completed", "failed"],
            },
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}, "nullable": True},
        },
        "required": [
            "id",
            "object",
            "endpoint",
            "input_file_id",
            "completion_window",
            "status",
            "created_at",
            "request_counts",
        ],
    },
    "OpenAIBatchList": _page_of("OpenAIBatch"),
    "SeedBatchCreate": {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "inputs": {
                "type": "array",
                "minItems": 1,
                "items": {},
                "description": "one request each: a prompt or {messages} (chat), a text (embeddings), an instance "
                "(small models)",
            },
            "params": {"type": "object", "description": "fields every request gets, e.g. max_tokens"},
            "callback_url": {"type": "string", "description": "a signed webhook goes here when the batch ends"},
        },
        "required": ["model", "inputs"],
    },
    "SeedBatchCreated": {
        "type": "object",
        "properties": {
            "batch_id": {"type": "string"},
            "status": {"type": "string"},
            "estimated_time": {"type": "integer", "description": "seconds, from the model's measured throughput"},
            "input_file_id": {"type": "string"},
        },
        "required": ["batch_id", "status", "estimated_time"],
    },
    "SeedBatch": {
        "type": "object",
        "properties": {
            "batch_id": {"type": "string"},
            "status": {"type": "string"},
            "model": {"type": "string", "nullable": True},
            "progress": {
                "type": "object",
                "properties": {n: {"type": "integer"} for n in ("total", "completed", "failed")},
            },
            "output_file_id": {"type": "string", "nullable": True},
            "error_file_id": {"type": "string", "nullable": True},
            "created_at": {"type": "integer"},
            "expires_at": {"type": "integer", "nullable": True},
        },
        "required": ["batch_id", "status", "progress"],
    },
}


def batch_paths() -> dict[str, dict[str, Any]]:
    """OpenAI's Batch API and the seeds' batch (``serving.batches.views``)."""
    create = _operation(
        "openai_batches_create", "Create a batch", ok=_json_ok("OpenAIBatch", "the batch, validating"),
        errors=(400, 429, *READ_ERRORS), body="OpenAIBatchCreate",
    )  # fmt: skip
    create["description"] = (
        "Runs every request of the input file offline, each exactly once, at the batch price; the output "
        "and error files list the answers by custom_id when it ends."
    )
    listing = _operation(
        "openai_batches_list", "This organisation's batches, newest first", ok=_json_ok("OpenAIBatchList", "one page"),
        errors=(400, *READ_ERRORS), parameters=[
            {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
            {"name": "after", "in": "query", "schema": {"type": "string"}, "description": "a batch id"},
        ],
    )  # fmt: skip
    seed = _operation(
        "seed_batch_create", "Run many inputs as one batch (the seeds' shape)", ok=_json_ok("SeedBatchCreated", ""),
        errors=(400, 403, 429, *READ_ERRORS), body="SeedBatchCreate",
    )  # fmt: skip
    seed["responses"]["202"] = {**seed["responses"].pop("200"), "description": "queued"}
    return {
        "/v1/batches": {"get": listing, "post": create},
        "/v1/batches/{batch_id}": {
            "get": _operation(
                "openai_batches_retrieve",
                "One batch",
                ok=_json_ok("OpenAIBatch", "the batch"),
                errors=READ_ERRORS,
                parameters=[_BATCH_ID],
            ),
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": _operation(
                "openai_batches_cancel",
                "Cancel a batch",
                ok=_json_ok("OpenAIBatch", "cancelling"),
                errors=(409, *READ_ERRORS),
                parameters=[_BATCH_ID],
            ),
        },
        "/api/v1/batch": {"post": seed},
        "/api/v1/batch/{batch_id}": {
            "get": _operation(
                "seed_batch_retrieve",
                "A batch's progress (the seeds' shape)",
                ok=_json_ok("SeedBatch", "its progress"),
                errors=READ_ERRORS,
                parameters=[_BATCH_ID],
            ),
        },
    }


def file_paths() -> dict[str, dict[str, Any]]:
    """OpenAI's Files API (``serving.batches.file_views``)."""
    upload = _operation(
        "openai_files_create", "Upload a batch input file", ok=_json_ok("OpenAIFile", "the file"),
        errors=(400, *READ_ERRORS),
    )  # fmt: skip
    upload["requestBody"] = {
        "required": True,
        "content": {"multipart/form-data": {"schema": {"$ref": COMPONENT.format(model="OpenAIFileUpload")}}},
    }
    upload["description"] = (
        f"Every line is checked (`{{custom_id, method: POST, url, body: {{model, …}}}}`); the first bad one "
        f"refuses the file (400 naming the line). At most {settings.FILES_MAX_BYTES} bytes and "
        f"{settings.FILES_MAX_LINES} requests."
    )
    list_parameters = [
        {"name": "purpose", "in": "query", "schema": {"type": "string"}},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
        {"name": "after", "in": "query", "schema": {"type": "string"}, "description": "a file id: the page after it"},
        {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
    ]
    listing = _operation(
        "openai_files_list", "This organisation's files", ok=_json_ok("OpenAIFileList", "one page"),
        errors=(400, *READ_ERRORS), parameters=list_parameters,
    )  # fmt: skip
    content_ok = {
        "description": "the file's bytes, as uploaded",
        "content": {"application/jsonl": {"schema": {"type": "string", "format": "binary"}}},
    }
    return {
        "/v1/files": {"get": listing, "post": upload},
        "/v1/files/{file_id}": {
            "get": _operation(
                "openai_files_retrieve",
                "One file",
                ok=_json_ok("OpenAIFile", "the file"),
                errors=READ_ERRORS,
                parameters=[_FILE_ID],
            ),
            "delete": _operation(
                "openai_files_delete",
                "Delete a file",
                ok=_json_ok("OpenAIFileDeleted", "deleted"),
                errors=READ_ERRORS,
                parameters=[_FILE_ID],
            ),
        },
        "/v1/files/{file_id}/content": {
            "get": _operation(
                "openai_files_content", "A file's content", ok=content_ok, errors=READ_ERRORS, parameters=[_FILE_ID]
            ),
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
    operation = _operation(operation_id, summary, ok=ok, errors=errors, **fields)
    for status in errors:
        operation["responses"][str(status)]["content"] = {"application/json": {"schema": _PROTOCOL_ERROR}}
    return operation


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
    infer_ok = _json_ok("InferenceResponse", "the outputs (with the binary extension: JSON, then the bytes)")
    infer_ok["content"]["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
    for suffix, parameters, tag in (("", [_MODEL], ""), ("/versions/{version}", [_MODEL, _VERSION], "_version")):
        base = "/v2/models/{model}" + suffix
        paths[base] = {
            "get": _protocol_operation(
                f"v2_model_metadata{tag}", "The model's signature", ok=_json_ok("ModelMetadata", "its metadata"),
                errors=(400, 403, *READ_ERRORS), parameters=parameters,
            )
        }  # fmt: skip
        paths[base + "/ready"] = {
            "get": _protocol_operation(
                f"v2_model_ready{tag}", "A replica can take a request now (503 when none can)",
                ok={"description": "ready", "content": {"application/json": {"schema": {"type": "object"}}}},
                errors=(400, 403, *READ_ERRORS), parameters=parameters,
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
        "post": _operation(
            "seed_predict", "One prediction", ok=_json_ok("PredictAnswer", "the prediction"), errors=predict_errors,
            body="PredictRequest",
        )
    }  # fmt: skip
    paths["/api/v1/models/{model}/predict"] = {
        "post": _operation(
            "seed_model_predict", "A prediction per instance", ok=_json_ok("ModelPredictAnswer", "the predictions"),
            errors=predict_errors, body="ModelPredictRequest", parameters=[_MODEL],
        )
    }  # fmt: skip
    generate_ok = _json_ok("GenerateAnswer", 'the text; with `stream: true`, SSE of `{"token"}` then the finish')
    generate_ok["content"].update(_EVENT_STREAM)
    paths["/api/v1/generate"] = {
        "post": _operation(
            "seed_generate", "Generate text", ok=generate_ok, errors=INFERENCE_ERRORS, body="GenerateRequest"
        )
    }
    paths["/api/v1/models/{model}/generate"] = {
        "post": _operation(
            "seed_model_generate", "Generate text with the model in the path", ok=generate_ok,
            errors=INFERENCE_ERRORS, body="GenerateRequest", parameters=[_MODEL],
        )
    }  # fmt: skip
    embed_ok = _json_ok("EmbedAnswer", "one embedding per text")
    paths["/api/v1/embed"] = {
        "post": _operation("seed_embed", "Embed texts", ok=embed_ok, errors=INFERENCE_ERRORS, body="EmbedRequest")
    }
    return paths


def request_schemas() -> dict[str, Any]:
    """The request bodies' JSON schemas (and the models they use), as OpenAPI 3.0 components."""
    models: list[type[BaseModel]] = [ChatCompletionRequest, CompletionRequest, EmbeddingRequest]
    _, definitions = models_json_schema([(m, "validation") for m in models], ref_template=COMPONENT)
    return {name: openapi30(schema) for name, schema in definitions["$defs"].items()}


def openapi30(node: Any) -> Any:
    """A pydantic (JSON Schema 2020-12) schema as OpenAPI 3.0.3 says it: ``nullable`` for a
    union with null, ``enum`` for ``const``, boolean ``exclusiveMinimum``/``exclusiveMaximum``."""
    if isinstance(node, list):
        return [openapi30(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: openapi30(value) for key, value in node.items()}
    if "const" in out:
        out["enum"] = [out.pop("const")]
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(bound), int | float) and not isinstance(out[bound], bool):
            out[limit], out[bound] = out[bound], True
    members = out.get("anyOf")
    if isinstance(members, list) and {"type": "null"} in members:
        others = [m for m in members if m != {"type": "null"}]
        del out["anyOf"]
        if len(others) == 1 and "$ref" in others[0]:
            out["allOf"] = others  # a $ref takes no siblings in 3.0
        elif len(others) == 1:
            out = {**others[0], **out}
        else:
            out["anyOf"] = others
        out["nullable"] = True
    return out


def add_data_plane(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: the data plane's paths, schemas and bearer auth."""
    components = result.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    added = {
        **_ERROR_SCHEMAS, **_RESPONSE_SCHEMAS, **_SMALL_SCHEMAS, **_FILE_SCHEMAS, **_BATCH_SCHEMAS, **_CACHE_SCHEMAS,
        **request_schemas(),
    }  # fmt: skip
    clash = sorted(set(added) & set(schemas))
    if clash:
        raise ValueError(f"data-plane schema names taken by the management API: {', '.join(clash)}")
    schemas.update(added)
    components.setdefault("securitySchemes", {})[BEARER] = {
        "type": "http",
        "scheme": "bearer",
        "description": "an API key: `Authorization: Bearer sk-…`",
    }
    paths = result.setdefault("paths", {})
    paths.update(data_plane_paths())
    paths.update(small_model_paths())
    paths.update(file_paths())
    paths.update(batch_paths())
    paths.update(cache_paths())
    result.setdefault("tags", [])
    if not any(tag.get("name") == TAG for tag in result["tags"]):
        result["tags"].append(
            {"name": TAG, "description": "OpenAI-compatible inference: authenticated by an API key (Bearer)"}
        )
    return result
