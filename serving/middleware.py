"""The data plane's fast path through Django.

Django's built-in middleware runs its sync hooks in a thread per request under ASGI;
the API needs none of them (no sessions, cookies or CSRF: keys travel in a header). This
middleware sits first, resolves data-plane paths itself, calls the async view directly,
and guarantees an OpenAI error body, never an HTML page, for every failure on those paths.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

from asgiref.sync import markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from django.urls import Resolver404, resolve

from serving.errors import APIError, NotFound
from serving.urls import DATA_PLANE_PREFIXES

logger = logging.getLogger(__name__)


class DataPlaneMiddleware:
    sync_capable = False
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if not request.path_info.startswith(DATA_PLANE_PREFIXES):
            return await self.get_response(request)
        request_id = uuid.uuid4()
        request.request_id = request_id  # type: ignore[attr-defined]
        header = str(request_id)
        try:
            match = resolve(request.path_info)
        except Resolver404:
            return NotFound(
                f"Unknown request URL: {request.method} {request.path_info}. Please check the URL for typos.",
                code="unknown_url",
            ).response(header)
        try:
            response: HttpResponseBase = await match.func(request, *match.args, **match.kwargs)
        except APIError as exc:
            return exc.response(header)
        except Exception:
            logger.exception("unhandled error on %s %s", request.method, request.path_info)
            return APIError("The server had an error while processing your request.").response(header)
        response["x-request-id"] = header
        return response
