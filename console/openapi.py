"""The management API in the OpenAPI schema: its sign-in schemes and what every view may answer.

A drf-spectacular postprocessing hook (``document_errors``, before ``serving.openapi``
adds the data plane). DRF answers some statuses for every view, whatever the view says:
403 when the caller is not signed in (session authentication comes first, so never 401)
or may not act, 429 when HTTP Basic meets the sign-in lockout (``console.auth``), 404
when a path names an object the caller cannot see (or a page past the last), 400 when a
body (or a page size) does not validate. Views declare only the statuses of their own
rules (409 on a conflict, 400 from a query or a body-less action); this hook adds the rest
and gives every error its body: ``{"detail": …}``, or for a 400 the fields and their
messages.

Request bodies are documented as JSON only. DRF also parses forms (the browsable API
posts them), where an empty field of a nullable value reads as null; that reading is
DRF's and no part of the API's contract.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.authentication import BasicScheme

DETAIL = "ErrorDetail"
VALIDATION = "ValidationErrors"
METHODS = ("get", "put", "post", "patch", "delete")

SCHEMAS: dict[str, Any] = {
    DETAIL: {
        "type": "object",
        "properties": {"detail": {"type": "string"}},
        "required": ["detail"],
    },
    VALIDATION: {
        "description": "each invalid field with its messages (nested for nested fields), or the messages alone",
        "oneOf": [
            {"type": "object", "additionalProperties": True, "example": {"name": ["This field is required."]}},
            {"type": "array", "items": {"type": "string"}},
        ],
    },
}
DESCRIPTIONS = {
    400: "invalid input: the fields (or query parameters) and what is wrong with each",
    403: "not signed in, or not allowed to do this",
    429: "too many failed sign-ins for this account or address (HTTP Basic); see Retry-After",
    404: "no such object among those the caller may see, or no such page",
}


class RateLimitedBasicScheme(BasicScheme):  # type: ignore[no-untyped-call]  # its __init_subclass__ registers it
    """HTTP Basic under the sign-in lockout is HTTP Basic to a client (drf-spectacular's own
    extension matches BasicAuthentication itself, not its subclasses). Registered on import:
    ConsoleConfig.ready imports this module."""

    target_class = "console.auth.RateLimitedBasicAuthentication"


def _error(status: int, description: str | None = None) -> dict[str, Any]:
    schema = VALIDATION if status == 400 else DETAIL
    return {
        "description": description or DESCRIPTIONS.get(status, "refused"),
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }


def document_operation_errors(path: str, operation: dict[str, Any]) -> None:
    """Add the statuses DRF may answer for this operation, and a body to every 4xx that has none."""
    responses = operation.setdefault("responses", {})
    query = {p.get("name") for p in operation.get("parameters", []) if p.get("in") == "query"}
    expected = {403, 429}
    if "{" in path or "page" in query:  # a page past the last, or not a number
        expected.add(404)
    if "requestBody" in operation or "page_size" in query:  # a page_size that is not a positive integer
        expected.add(400)
    for status in sorted(expected):
        responses.setdefault(str(status), _error(status))
    for status, response in responses.items():
        if status.startswith("4") and "content" not in response:
            response.update(_error(int(status), response.get("description")))
    body = operation.get("requestBody", {}).get("content", {})
    if "application/json" in body:
        for media_type in [m for m in body if m != "application/json"]:
            del body[media_type]


def document_errors(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: every management operation's error answers."""
    result.setdefault("components", {}).setdefault("schemas", {}).update(SCHEMAS)
    for path, item in result.get("paths", {}).items():
        for method in METHODS:
            if method in item:
                document_operation_errors(path, item[method])
    return result
