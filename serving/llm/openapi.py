"""The OpenAI paths in the OpenAPI schema (chat, completions, embeddings, models, the key's usage):
their responses, and the request bodies of ``serving.llm.schemas`` from the pydantic models that
validate them, so the schema cannot drift from what the gateway accepts."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from serving.gateway.openapi import (
    COMPONENT,
    EVENT_STREAM,
    INFERENCE_ERRORS,
    READ_ERRORS,
    USAGE,
    json_ok,
    openapi30,
    operation,
)
from serving.llm.schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, EmbeddingRequest

# The answers, as far as the gateway shapes them: our id and the public model name on the
# engine's own answer (whose other fields pass through, so more may come).
RESPONSE_SCHEMAS: dict[str, Any] = {
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
            "usage": USAGE,
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
            "usage": USAGE,
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
            "usage": USAGE,
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
        ok = json_ok(answer, _STREAMED if streams else "the answer")
        if streams:
            ok["content"].update(EVENT_STREAM)
        for prefix in ("/v1/", "/api/v1/"):
            alias = prefix != "/v1/"
            post = operation(
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
        "get": operation(
            "openai_models_list", "The models this key may use", ok=json_ok("OpenAIModelList", "the models"),
            errors=READ_ERRORS,
        )
    }  # fmt: skip
    paths["/v1/models/{model}"] = {
        "get": operation(
            "openai_models_retrieve",
            "One model",
            ok=json_ok("OpenAIModel", "the model"),
            errors=(400, *READ_ERRORS),
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
            "get": operation(
                f"openai_usage{'_alias' if prefix != '/v1/' else ''}",
                "This key's usage and cost by UTC day and model",
                ok=json_ok("KeyUsagePage", "one page, oldest day first"),
                errors=(400, *READ_ERRORS),
                parameters=usage_parameters,
            )
        }
    return paths


def request_schemas() -> dict[str, Any]:
    """The request bodies' JSON schemas (and the models they use), as OpenAPI 3.0 components."""
    models: list[type[BaseModel]] = [ChatCompletionRequest, CompletionRequest, EmbeddingRequest]
    _, definitions = models_json_schema([(m, "validation") for m in models], ref_template=COMPONENT)
    return {name: openapi30(schema) for name, schema in definitions["$defs"].items()}
