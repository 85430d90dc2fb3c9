"""``POST /v1/cache/feedback``: report that an answer served from the cache was wrong.

Authenticated by an API key of the organisation the answer was served to (any of its keys:
the person who noticed is not always the caller). The body names the request:
``{"request_id": "<x-request-id, or the answer's id>", "reason": "…"}``. What a report does
is ``serving.semcache.feedback``'s (the entry and its neighbours tighten at once; the report
counts in the model's error budget).
"""

from __future__ import annotations

from typing import Any

import orjson
from django.http import HttpResponse

from core.db import run_db
from serving.gateway.auth import request_grant
from serving.gateway.errors import APIError, InvalidRequest, NotFound
from serving.gateway.requests import ApiRequest, reads_body
from serving.semcache.feedback import NotServedFromCache, parse_request_id, report

REASON_MAX_CHARS = 500


def _body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw or b"null")
    except orjson.JSONDecodeError:
        raise InvalidRequest("The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object with request_id.", code="invalid_type")
    unknown = sorted(set(body) - {"request_id", "reason"})
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}.", param=unknown[0],
                             code="unknown_parameter")  # fmt: skip
    return body


@reads_body()
async def cache_feedback(request: ApiRequest) -> HttpResponse:
    if request.method != "POST":
        raise APIError(f"Method {request.method} is not allowed here; use POST.", status=405,
                       type="invalid_request_error", code="method_not_allowed", headers={"Allow": "POST"})  # fmt: skip
    grant = await request_grant(request)
    body = _body(request.body)
    given = body.get("request_id")
    if not isinstance(given, str) or not given.strip():
        raise InvalidRequest("Missing required parameter: 'request_id'.", param="request_id", code="missing_required")
    request_id = parse_request_id(given)
    if request_id is None:
        raise InvalidRequest("Invalid 'request_id': expected the x-request-id header's UUID or the answer's id.",
                             param="request_id", code="invalid_value")  # fmt: skip
    reason = body.get("reason") or ""
    if not isinstance(reason, str) or len(reason) > REASON_MAX_CHARS:
        raise InvalidRequest(f"Invalid 'reason': a string of at most {REASON_MAX_CHARS} characters.",
                             param="reason", code="invalid_value")  # fmt: skip
    try:
        feedback = await run_db(report, request_id, organization_id=grant.organization_id,
                                reported_by=f"key {grant.prefix}", reason=reason)  # fmt: skip
    except NotServedFromCache:
        raise NotFound(
            "No answer from the cache is on record for this request in your organisation (answers can be "
            "reported for a limited time after they were served).",
            param="request_id", code="not_served_from_cache",
        ) from None  # fmt: skip
    answer = {
        "object": "cache.feedback",
        "request_id": request_id.hex,
        "model": feedback.model,
        "model_version": feedback.model_version,
        "wording": feedback.wording,
        "tightened": feedback.tightened,
        "created_at": int(feedback.created_at.timestamp()),
    }
    return HttpResponse(orjson.dumps(answer), content_type="application/json")
