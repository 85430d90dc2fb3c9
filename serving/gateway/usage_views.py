"""``GET /v1/usage``: an API key's own usage and cost by UTC day and model, from the daily rollups.

Authenticated by the key itself, like every data-plane route; it sees only its own
requests (not its organisation's other keys, not a key it was rotated from). Today's
numbers trail the requests by about a minute (``billing.rollups``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any
from urllib.parse import parse_qs

import orjson
from django.conf import settings
from django.http import HttpResponse

from billing.usage_selectors import (
    USAGE_PAGE_DEFAULT,
    USAGE_PAGE_MAX,
    DailyUsage,
    InvalidCursor,
    UsageCursor,
    usage_daily_for_key,
    usage_window,
)
from core.db import run_db
from serving.gateway.auth import request_grant
from serving.gateway.errors import APIError, InvalidRequest
from serving.gateway.requests import ApiRequest

PARAMS = ("start_date", "end_date", "limit", "after")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_EXACT = Decimal("1e-12")


@dataclass(frozen=True)
class UsageQuery:
    start: date
    end: date
    limit: int
    after: UsageCursor | None


def _invalid(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"Invalid value for '{param}': {message}.", param=param, code="invalid_value")


def _date(value: str | None, param: str) -> date | None:
    if value is None:
        return None
    try:
        # fromisoformat alone would also take "20261122" and week dates.
        if not _DATE.fullmatch(value):
            raise ValueError(value)
        return date.fromisoformat(value)
    except ValueError:
        raise _invalid(param, "expected a date as YYYY-MM-DD (UTC)") from None


def parse_usage_query(query_string: str, *, today: date) -> UsageQuery:
    """The query of a usage request; InvalidRequest naming the parameter when it is not one."""
    try:
        params = parse_qs(query_string, keep_blank_values=True, max_num_fields=len(PARAMS))
    except ValueError:
        raise InvalidRequest(f"Too many query parameters; this endpoint takes {', '.join(PARAMS)}.") from None
    for name, values in params.items():
        if name not in PARAMS:
            raise InvalidRequest(f"Unrecognized query parameter: {name}.", param=name, code="unknown_parameter")
        if len(values) > 1:
            raise _invalid(name, "given more than once")
    given = {name: values[0] for name, values in params.items()}
    start_date, end_date = _date(given.get("start_date"), "start_date"), _date(given.get("end_date"), "end_date")
    try:
        start, end = usage_window(start=start_date, end=end_date, today=today)
    except ValueError:
        raise _invalid("start_date", "it is after end_date (which defaults to today, UTC)") from None
    limit = USAGE_PAGE_DEFAULT
    if "limit" in given:
        text = given["limit"]
        if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= USAGE_PAGE_MAX:
            raise _invalid("limit", f"expected an integer from 1 to {USAGE_PAGE_MAX}")
        limit = int(text)
    after = None
    if "after" in given:
        try:
            after = UsageCursor.decode(given["after"])
        except InvalidCursor:
            raise _invalid("after", "not a cursor from this endpoint's next_page") from None
    return UsageQuery(start=start, end=end, limit=limit, after=after)


def _entry(row: DailyUsage) -> dict[str, Any]:
    return {
        "object": "usage.daily",
        "date": row.date.isoformat(),
        "model": row.model,
        "requests": row.requests,
        "errors": row.errors,
        "cancelled": row.cancelled,  # by the client (499): not in errors (billing.outcomes)
        "input_tokens": row.input_tokens,
        "output_tokens": row.output_tokens,
        "cached_tokens": row.cached_tokens,
        "cost": f"{row.cost.quantize(_EXACT):f}",
        "batch_requests": row.batch_requests,
        "batch_cost": f"{row.batch_cost.quantize(_EXACT):f}",
        "currency": settings.BILLING_CURRENCY,
    }


async def usage(request: ApiRequest) -> HttpResponse:
    if request.method != "GET":
        raise APIError(
            f"Method {request.method} is not allowed here; use GET.",
            status=405,
            type="invalid_request_error",
            code="method_not_allowed",
            headers={"Allow": "GET"},
        )
    grant = await request_grant(request)
    query = parse_usage_query(request.query_string, today=datetime.now(UTC).date())
    page = await run_db(
        usage_daily_for_key,
        api_key_id=grant.key_id,
        start=query.start,
        end=query.end,
        limit=query.limit,
        after=query.after,
    )
    cursor = page.next_page
    body = {
        "object": "list",
        "data": [_entry(row) for row in page.rows],
        "has_more": page.has_more,
        "next_page": cursor.encode() if cursor else None,
    }
    return HttpResponse(orjson.dumps(body), content_type="application/json")
