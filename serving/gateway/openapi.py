"""What every data-plane operation shares in the OpenAPI schema: the error statuses and the OpenAI
error body, the bearer key, the request id and event-stream headers, an operation's builder, OpenAI's
paged list, and a pydantic schema said as OpenAPI 3.0. Each part describes its own paths with
these (``serving.llm.openapi``, ``serving.predict.openapi``, ``serving.batches.openapi``,
``serving.semcache.openapi``); ``serving.openapi`` gathers them."""

from __future__ import annotations

from typing import Any

COMPONENT = "#/components/schemas/{model}"
BEARER = "bearerAuth"
TAG = "inference"


# What each error status means on the data plane (serving.gateway.errors; the engine's own 4xx pass through).
ERRORS: dict[int, str] = {
    400: "invalid request: bad JSON, an unknown or invalid argument (`param` names it), an unknown model, "
    "a context too long, or the engine's own refusal",
    401: "missing, incorrect, revoked or expired API key",
    403: "refused to this caller: past the organisation's file storage quota (`storage_quota_exceeded`), "
    "or a signed-in session's socket opened from another site (`origin_not_allowed`); a model outside "
    "a key's scope is a 400 `model_not_found`",
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
ERROR_SCHEMAS: dict[str, Any] = {
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


REQUEST_ID = {"x-request-id": {"description": "the request's id (its usage record's)", "schema": {"type": "string"}}}


# One server-sent event (its `data` a JSON text, the last one `[DONE]`).
EVENT_STREAM = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
        }
    }
}


def error_responses(statuses: tuple[int, ...]) -> dict[str, Any]:
    return {
        str(status): {
            "description": ERRORS[status],
            "headers": REQUEST_ID,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}},
        }
        for status in statuses
    }


def operation(
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
        "responses": {"200": {"headers": REQUEST_ID, **ok}, **error_responses(errors)},
    }
    if body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": COMPONENT.format(model=body)}}},
        }
    return operation


def json_ok(schema: str, description: str) -> dict[str, Any]:
    reference = {"$ref": COMPONENT.format(model=schema)}
    return {"description": description, "content": {"application/json": {"schema": reference}}}


def page_of(item: str) -> dict[str, Any]:
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


USAGE = {
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
