"""The data plane's ASGI entry: OpenAI-compatible routes served without Django's handler.

Under ASGI, Django's handler runs per-request signal receivers and every sync
middleware hook in a thread of the request's own (one is created per request), and
releases the request's database connection only when the response ends. The API needs
none of that: keys travel in a header, no session or CSRF applies, and the hot path
makes no blocking call. So ``console.asgi`` sends data-plane paths here; everything else
(console, admin, health) goes through Django as usual.

Views are async functions taking an ``ApiRequest`` and returning an ``HttpResponse`` or
an ``EventStreamResponse``; this module reads the body (at most API_MAX_BODY_BYTES, else
413), resolves the path, maps every failure to an OpenAI error body, sends the response,
cancels it when the client disconnects (which closes the stream to the engine, so vLLM
aborts), and finally runs the request's closers: whatever ended the request, every call
it admitted is settled exactly once.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpResponse, HttpResponseBase
from django.urls import Resolver404, resolve
from redis.exceptions import RedisError

from billing.outcomes import CLIENT_CLOSED
from serving.gateway.auth import request_grant
from serving.gateway.errors import APIError, EngineUnavailable, NotFound, PayloadTooLarge, bounded
from serving.gateway.requests import BEFORE_UPLOAD, READS_BODY, TAKES_SESSIONS, ApiRequest, UploadCheck
from serving.gateway.responses import EventStreamResponse

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
View = Callable[..., Awaitable[HttpResponseBase]]


# The data plane's routes: a URLconf named, as Django names its ROOT_URLCONF, so that this entry
# (the gateway's) never imports the views of the parts above it.
DATA_PLANE_URLCONF = "serving.urls"
# Paths this entry serves itself (answered in OpenAI's error shape, or the protocol's for /v2);
# and, under the management API's /api/v1/models/, the paths that end in one of
# DATA_PLANE_MODEL_ACTIONS.
DATA_PLANE_PREFIXES = (
    "/v1/", "/v2", "/api/v1/chat/", "/api/v1/completions", "/api/v1/embeddings", "/api/v1/usage", "/api/v1/predict",
    "/api/v1/generate", "/api/v1/embed", "/api/v1/batch",
)  # fmt: skip
DATA_PLANE_MODEL_ACTIONS = ("/predict", "/generate")


def is_data_plane(scope: Scope) -> bool:
    if scope["type"] != "http":
        return False
    path = str(scope["path"])
    if path.startswith(DATA_PLANE_PREFIXES):
        return True
    # /api/v1/models/<name>/predict is the data plane's; the rest of /api/v1/models/ is management.
    return path.startswith("/api/v1/models/") and path.endswith(DATA_PLANE_MODEL_ACTIONS) and path.count("/") == 5


class ClientGone(Exception):
    pass


# Methods whose bodies a data-plane view reads; any other request's body is never read.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# An upload is kept in memory up to this size, then on disk.
UPLOAD_SPOOL_BYTES = 1024 * 1024


def _body_limit(*, upload: bool) -> int:
    if upload:  # room for the multipart envelope around the file
        return int(settings.FILES_MAX_BYTES) + 1024 * 1024
    return int(settings.API_MAX_BODY_BYTES)


def _declared_length(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        declared = int(value)
    except ValueError:
        declared = -1
    if declared < 0:
        raise APIError("Invalid Content-Length header.", status=400, type="invalid_request_error",
                       code="invalid_header")  # fmt: skip
    return declared


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"The request body is larger than this API accepts ({limit} bytes, {limit / 1024 / 1024:g} MiB).",
    )


async def _body_chunks(receive: Receive, declared: int | None, *, upload: bool = False) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive, bounded by the view's limit: refused by its declared
    length before a byte is read, or as soon as more than the limit came."""
    limit = _body_limit(upload=upload)
    if declared is not None and declared > limit:
        raise _too_large(limit)
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        yield chunk
        if not message.get("more_body", False):
            return


async def _read_body(receive: Receive, declared: int | None) -> bytes:
    return b"".join([chunk async for chunk in _body_chunks(receive, declared)])


async def _spool_body(receive: Receive, declared: int | None) -> BinaryIO:
    """An upload's body, written to a temporary file as it arrives (in memory only up to
    UPLOAD_SPOOL_BYTES), positioned at its start."""
    spool = tempfile.SpooledTemporaryFile(max_size=UPLOAD_SPOOL_BYTES)  # noqa: SIM115 (the request closes it)
    try:
        async for chunk in _body_chunks(receive, declared, upload=True):
            spool.write(chunk)
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return cast(BinaryIO, spool)


@functools.cache
def _exact_routes() -> dict[str, View]:
    """Data-plane paths without parameters, straight to their view (no resolver on the hot path)."""
    urlpatterns = importlib.import_module(DATA_PLANE_URLCONF).urlpatterns
    return {f"/{p.pattern}": p.callback for p in urlpatterns if "<" not in str(p.pattern)}


@functools.cache
def _parameter_routes() -> list[tuple[Any, View]]:
    """Data-plane paths with parameters (``/v2/models/<model>/infer`` …): their own patterns,
    matched in order, without Django's resolver walking the whole URLconf for each request."""
    urlpatterns = importlib.import_module(DATA_PLANE_URLCONF).urlpatterns
    return [(p.pattern, p.callback) for p in urlpatterns if "<" in str(p.pattern)]


def _route(path: str) -> tuple[View, dict[str, Any]] | None:
    for pattern, callback in _parameter_routes():
        matched = pattern.match(path[1:])
        if matched is not None:
            return callback, matched[2]
    return None


def _unavailable(scope: Scope, exc: Exception, what: str) -> EngineUnavailable:
    logger.error("%s unavailable on %s %s: %s", what, scope["method"], scope["path"], exc)
    name = "database" if what == "database" else "Redis"
    return EngineUnavailable(f"The platform's {name} is unavailable; try again shortly.", code=f"{what}_unavailable")


@dataclass(frozen=True, slots=True)
class Route:
    view: View
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def reads_body(self) -> bool:
        return bool(getattr(self.view, READS_BODY, False))

    @property
    def takes_sessions(self) -> bool:
        return bool(getattr(self.view, TAKES_SESSIONS, False))

    @property
    def before_upload(self) -> UploadCheck | None:
        return cast("UploadCheck | None", getattr(self.view, BEFORE_UPLOAD, None))


def resolve_route(path: str) -> Route | None:
    """The data-plane view of ``path`` and its arguments; None for a path no route has."""
    if "\x00" in path:  # no route has one, and the database would refuse it as an id
        return None
    view = _exact_routes().get(path)
    if view is not None:
        return Route(view, (), {})
    if (routed := _route(path)) is not None:
        return Route(routed[0], (), routed[1])
    try:
        match = resolve(path)
    except Resolver404:
        return None
    return Route(match.func, match.args, match.kwargs)


async def handle(request: ApiRequest, route: Route | None) -> HttpResponseBase:
    """Run a data-plane view; any failure becomes an OpenAI error body."""
    header = str(request.request_id)
    if route is None:
        return NotFound(
            f"Unknown request URL: {request.method} {bounded(request.path, 200)}. Please check the URL for typos.",
            code="unknown_url",
        ).response(header)
    view, args, kwargs = route.view, route.args, route.kwargs
    try:
        response: HttpResponseBase = await view(request, *args, **kwargs)
    except APIError as exc:
        return exc.response(header)
    except DatabaseError as exc:
        return _unavailable({"method": request.method, "path": request.path}, exc, "database").response(header)
    except RedisError as exc:
        return _unavailable({"method": request.method, "path": request.path}, exc, "redis").response(header)
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return APIError("The server had an error while processing your request.").response(header)
    response["x-request-id"] = header
    return response


class ClientStalled(Exception):
    """The client stopped reading: a write waited longer than CLIENT_SEND_TIMEOUT."""


async def _send_in_time(send: Send, message: dict[str, Any]) -> None:
    """Send, bounded: the server's ``send`` waits while the client's socket is full, and a
    client that stops reading must not hold the request (and its place in flight) for ever."""
    try:
        async with asyncio.timeout(settings.CLIENT_SEND_TIMEOUT):
            await send(message)
    except TimeoutError:
        raise ClientStalled from None


async def _send_response(response: HttpResponseBase, send: Send) -> None:
    headers = [(name.encode("ascii"), str(value).encode("latin1")) for name, value in response.items()]
    await _send_in_time(send, {"type": "http.response.start", "status": response.status_code, "headers": headers})
    if isinstance(response, EventStreamResponse):
        # Iterate the view's generator itself (Django's wrappers would re-yield each chunk
        # twice and not close it), and always close it: that is what ends the upstream.
        async with aclosing(response.events) as events:
            async for part in events:
                await _send_in_time(send, {"type": "http.response.body", "body": part, "more_body": True})
        await _send_in_time(send, {"type": "http.response.body"})
    elif isinstance(response, HttpResponse):
        await _send_in_time(send, {"type": "http.response.body", "body": response.content})
    else:
        raise TypeError(f"data-plane views return HttpResponse or EventStreamResponse, not {type(response)}")


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _receive_request(scope: Scope, receive: Receive, request_id: uuid.UUID, route: Route | None) -> ApiRequest:
    """The request, its body read only by a view that takes one (``reads_body``) and only once
    its sender is judged from the headers: a request with a body and no valid key is answered
    401 without reading a byte of the body, and an upload is charged to the key's request rate
    and checked against its organisation's storage before it is read
    (the view's ``reads_body(upload=...)`` check), then spooled to disk. Any other request's body is
    never read (its view answers 405, 404 or what its method asks for)."""
    request = ApiRequest(scope, b"", request_id)
    declared = _declared_length(request.header("content-length"))
    if request.method not in BODY_METHODS or route is None or not route.reads_body:
        return request
    grant = await request_grant(request, sessions=route.takes_sessions)
    if route.before_upload is not None and request.method == "POST":
        await route.before_upload(grant, declared)
        request.upload = await _spool_body(receive, declared)
    else:
        request.body = await _read_body(receive, declared)
    return request


async def serve(scope: Scope, receive: Receive, send: Send) -> None:
    request_id = uuid.uuid4()
    route = resolve_route(scope["path"])
    try:
        request = await _receive_request(scope, receive, request_id, route)
    except ClientGone:
        return
    except APIError as exc:
        await _send_response(exc.response(str(request_id), protocol=scope["path"].startswith("/v2")), send)
        return
    except DatabaseError as exc:  # the sender could not be judged; nothing was read
        await _send_response(_unavailable(scope, exc, "database").response(str(request_id)), send)
        return
    except RedisError as exc:
        await _send_response(_unavailable(scope, exc, "redis").response(str(request_id)), send)
        return
    try:
        await _serve(request, route, receive, send)
    finally:
        request.close()


async def _serve(request: ApiRequest, route: Route | None, receive: Receive, send: Send) -> None:
    """Answer in this task (the server's own); one more task per request, the disconnect watcher,
    which cancels this one if the client goes away while it is answered."""
    request_id = request.request_id
    # What the closers settle a call with if the call did not settle itself: the client
    # went away (499), or something failed in sending (500).
    ending = 500
    this = asyncio.current_task()
    assert this is not None
    answering, gone = True, False

    async def watch() -> None:
        nonlocal gone
        await _until_disconnect(receive)
        # `answering` turns false, with no await between, the moment the answer is out: a
        # cancel sent from here always lands inside the answer, never in what follows it.
        if answering:
            gone = True
            this.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        try:
            response = await handle(request, route)
            await _send_response(response, send)
        finally:
            answering = False
            watcher.cancel()
    except ClientStalled:
        # Settled as the client going away, with what it was sent; the server closes
        # the connection when this returns without finishing the response.
        ending = CLIENT_CLOSED
        logger.warning("request %s: the client stopped reading for %g s; closed", request_id,
                       settings.CLIENT_SEND_TIMEOUT)  # fmt: skip
    except asyncio.CancelledError:
        # The client went away (the watcher's cancel: taken back, the request ends here) or the
        # server is stopping (passed on). Cancelling closed our stream generator (aclosing),
        # which closes the engine connection and settles the request with the tokens produced.
        ending = CLIENT_CLOSED
        if not gone or this.uncancel() > 0:
            raise
    finally:
        if request.closers:
            # One shielded gather: a cancellation arriving now cannot skip any of them.
            results = await asyncio.shield(
                asyncio.gather(*(closer(ending) for closer in request.closers), return_exceptions=True)
            )
            for result in results:
                if isinstance(result, BaseException):
                    logger.error("closing request %s failed: %r", request_id, result)


class DataPlaneRouter:
    """Sends data-plane HTTP requests to ``serve`` and everything else to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if is_data_plane(scope):
            await serve(scope, receive, send)
        else:
            await self.app(scope, receive, send)
