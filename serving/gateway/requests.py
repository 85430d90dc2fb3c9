"""The request object of the data plane's views (serving.gateway.asgi builds it; no Django handler involved)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any, BinaryIO, TypeVar
from urllib.parse import parse_qs

import orjson

from accounts.grants import KeyGrant
from serving.gateway.errors import APIError, InvalidRequest

Closer = Callable[[int], Awaitable[None]]
# The longest query parameter value a data-plane view takes.
QUERY_VALUE_MAX = 200


class ApiRequest:
    """What a data-plane view needs of an HTTP request, and the closers it registers.

    ``grant``: the sender of a request with a body, judged from its headers before the body
    was read (``serving.gateway.asgi``); ``upload``: an upload's body, spooled to a temporary file
    (``body`` is then empty), closed with the request."""

    def __init__(self, scope: dict[str, Any], body: bytes, request_id: uuid.UUID) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query_string: str = scope.get("query_string", b"").decode("latin1")
        self.body = body
        self.request_id = request_id
        self.grant: KeyGrant | None = None  # set once judged (serving.gateway.auth.request_grant)
        self.upload: BinaryIO | None = None
        self.raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        self._headers = {name.decode("latin1").lower(): value.decode("latin1") for name, value in scope["headers"]}
        self.closers: list[Closer] = []

    def header(self, name: str) -> str | None:
        return self._headers.get(name.lower())

    def close(self) -> None:
        if self.upload is not None:
            self.upload.close()

    def query(self) -> dict[str, str]:
        """The query string's parameters (the last of each name); a 400 naming one that holds
        a NUL character or more than QUERY_VALUE_MAX characters (ids, cursors and filters are
        short, and the database refuses NUL)."""
        query = {name: values[-1] for name, values in parse_qs(self.query_string).items()}
        for name, value in query.items():
            if "\x00" in name or "\x00" in value or len(value) > QUERY_VALUE_MAX:
                raise InvalidRequest(f"The query parameter {name[:40]!r} is not valid here.", param=name[:40])
        return query

    def on_close(self, closer: Closer) -> None:
        """Run ``closer(status)`` when the request is over, however it ended (499: client gone)."""
        self.closers.append(closer)


READS_BODY = "reads_body"
TAKES_SESSIONS = "takes_sessions"
BEFORE_UPLOAD = "before_upload"
V = TypeVar("V", bound=Callable[..., Any])
# An upload's checks before its body is read: (the sender's grant, the bytes it declares).
UploadCheck = Callable[[KeyGrant, int | None], Awaitable[None]]


def reads_body(*, sessions: bool = False, upload: UploadCheck | None = None) -> Callable[[V], V]:
    """Mark a view that reads its request's body (a POST's): the data plane's entry reads a
    body only for such a view, and only after judging its sender from the headers
    (``serving.gateway.asgi``, ``serving.gateway.auth.request_grant``); every other view's body is never read.
    ``sessions``: a signed-in member's page may call it without a key (the portal's "try it").
    ``upload``: a POST's body is an upload (the Files API's): its own larger limit, spooled to
    disk as it arrives, and ``upload(grant, declared_bytes)`` runs before a byte of it is read
    (the key's request rate, the organisation's storage)."""

    def mark(view: V) -> V:
        setattr(view, READS_BODY, True)
        setattr(view, TAKES_SESSIONS, sessions)
        setattr(view, BEFORE_UPLOAD, upload)
        return view

    return mark


def require_method(request: ApiRequest, *methods: str) -> None:
    """A data-plane view answers its methods; any other is a 405 naming those it takes."""
    if request.method not in methods:
        raise APIError(
            f"Method {request.method} is not allowed here; use {' or '.join(methods)}.",
            status=405,
            type="invalid_request_error",
            code="method_not_allowed",
            headers={"Allow": ", ".join(methods)},
        )


def json_object(raw: bytes) -> dict[str, Any]:
    """A body that must be one JSON object (the seeds' shapes), else a 400 ``invalid_json``."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The body is not JSON ({exc}).", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The body must be a JSON object.", code="invalid_json")
    return data


def model_name(data: dict[str, Any]) -> str:
    """The body's ``model`` (the seeds' shapes), else a 400 naming it."""
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required: the model's name.", param="model")
    return model
