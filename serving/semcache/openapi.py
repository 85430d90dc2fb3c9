"""The semantic cache's feedback path in the OpenAPI schema."""

from __future__ import annotations

from typing import Any

from serving.gateway.openapi import json_ok, operation

CACHE_SCHEMAS: dict[str, Any] = {
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
    report = operation(
        "cache_feedback_create", "Report an answer served from the cache as wrong",
        ok=json_ok("CacheFeedback", "the report (the first one, when the request was reported before)"),
        errors=(400, 401, 404, 405, 413, 503), body="CacheFeedbackCreate",
    )  # fmt: skip
    report["description"] = (
        "The cache entry that answered and its near neighbours serve only closer matches from now on, and the "
        "report counts in the model's wrong-hit estimate."
    )
    return {"/v1/cache/feedback": {"post": report}}
