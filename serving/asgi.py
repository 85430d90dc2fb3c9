"""The data plane's ASGI entry: OpenAI-compatible routes served without Django's handler.

Under ASGI, Django's handler runs per-request signal receivers and every sync
middleware hook in a thread of the request's own (one is created per request), and
releases the request's database connection only when the response ends. The API needs
none of that: keys travel in a header, no session or CSRF applies, and the hot path
makes no blocking call. So ``console.asgi`` sends data-plane paths here; everything else
(console, admin, health) goes through Django as usual.

The views are ordinary Django async views taking an ``HttpRequest`` and returning an
``HttpResponse`` or ``StreamingHttpResponse``; this module only reads the body, resolves
the path, maps every failure to an OpenAI error body, sends the response, and cancels
it when the client disconnects (which closes the stream to the engine, so vLLM aborts).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from django.core.handlers.asgi import ASGIRequest
from django.http import HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.urls import Resolver404, resolve

from serving.errors import APIError, InvalidRequest, NotFound
from serving.responses import EventStreamResponse
from serving.urls import DATA_PLANE_PREFIXES

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 32 * 1024 * 1024


def is_data_plane(scope: Scope) -> bool:
    return scope["type"] == "http" and str(scope["path"]).startswith(DATA_PLANE_PREFIXES)


class ClientGone(Exception):
    pass


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise InvalidRequest(f"The request body is larger than {MAX_BODY_BYTES} bytes.", code="body_too_large")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def handle(request: ASGIRequest) -> HttpResponseBase:
    """Resolve and run a data-plane view; any failure becomes an OpenAI error body."""
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


async def _send_response(response: HttpResponseBase, send: Send) -> None:
    headers = [(name.encode("ascii"), str(value).encode("latin1")) for name, value in response.items()]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    if isinstance(response, EventStreamResponse):
        # Iterate the view's generator itself (Django's wrappers would re-yield each chunk
        # twice and not close it), and always close it: that is what ends the upstream.
        async with aclosing(response.events) as events:
            async for part in events:
                await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body"})
    elif isinstance(response, StreamingHttpResponse):
        raise TypeError("data-plane streams must be EventStreamResponse")
    elif isinstance(response, HttpResponse):
        await send({"type": "http.response.body", "body": response.content})
    else:
        raise TypeError(f"data-plane views return HttpResponse or StreamingHttpResponse, not {type(response)}")


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def serve(scope: Scope, receive: Receive, send: Send) -> None:
    try:
        body = await _read_body(receive)
    except ClientGone:
        return
    except APIError as exc:
        await _send_response(exc.response(), send)
        return
    request = ASGIRequest(scope, io.BytesIO(body))

    async def respond() -> None:
        response = await handle(request)
        await _send_response(response, send)

    responding = asyncio.ensure_future(respond())
    watching = asyncio.ensure_future(_until_disconnect(receive))
    done, _ = await asyncio.wait({responding, watching}, return_when=asyncio.FIRST_COMPLETED)
    if responding in done:
        watching.cancel()
        responding.result()
        return
    # The client went away: cancelling closes our stream generator (aclosing), which
    # closes the engine connection and meters the request with the tokens produced.
    responding.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await responding


class DataPlaneRouter:
    """Sends data-plane HTTP requests to ``serve`` and everything else to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if is_data_plane(scope):
            await serve(scope, receive, send)
        else:
            await self.app(scope, receive, send)
