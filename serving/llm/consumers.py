"""The WebSocket API: several chat completions at once on one socket, each cancellable.

Protocol (JSON text frames):

- authenticate with ``Authorization: Bearer sk-…`` on the handshake, or send
  ``{"type": "auth", "api_key": "sk-…"}`` first (browsers cannot set headers); the console's
  playground sends ``{"type": "auth", "organization": <id>}`` instead, on a socket opened from
  this site by a signed-in member of that organisation (serving.gateway.session_auth);
- ``{"type": "chat.completion", "id": "<client id>", "body": {…chat request…}}`` starts one
  (always streamed); an optional ``"model_version": "<version>"`` beside ``body`` pins the
  version of its model, as ``X-Model-Version`` does on REST; an ``X-Model-Version`` header on
  the handshake pins every request of the socket that names none;
- the server answers ``{"type": "chunk", "id", "data": <chat.completion.chunk>}`` per chunk;
- every request ends with exactly one final frame: ``{"type": "usage", "id", "request_id",
  "status", "status_code", "model_version", "usage": {…}}`` when it was admitted (it is metered; ``status``
  is ``completed``, ``cancelled`` or ``error``, and an ``error`` frame comes just before
  it on failure), or ``{"type": "error", "id", "error": {…}}`` when it was refused or
  cancelled before admission (nothing ran, nothing is metered);
- ``{"type": "cancel", "id": "<client id>"}`` stops one; closing the socket stops all.
- a frame larger than ``API_MAX_BODY_BYTES`` is refused with an error frame
  (``request_body_too_large``) and never parsed; the server closes the socket (1009) on a
  frame more than a MiB over it (uvicorn's ``--ws-max-size``).
- a gateway that is stopping behind a balancer (``GATEWAY_DRAIN_SECONDS``) closes each socket
  with 1012 ("service restart") as soon as it carries no request: a request that got no
  frame back on a socket closed so never started; send it again on a new connection.

Each request runs the same ``InferenceCall`` as the REST API (serving.llm.call).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import orjson
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from accounts.grants import KeyGrant
from billing.outcomes import CLIENT_CLOSED
from core.lifecycle import draining
from serving.gateway.auth import authenticate
from serving.gateway.errors import APIError, AuthenticationFailed, InvalidRequest, PayloadTooLarge
from serving.gateway.session_auth import session_grant
from serving.llm.call import CHAT, InferenceCall

logger = logging.getLogger(__name__)

_CANCELLED = APIError("The request was cancelled before it started.", status=499, type="invalid_request_error",
                      code="cancelled")  # fmt: skip


class ChatCompletionsConsumer(AsyncWebsocketConsumer):
    # No channel layer: nothing is ever sent to a socket through one, and with one Channels
    # keeps a blocking read on Redis open per socket, whose failure when Redis restarts (or
    # refuses writes) ended every socket at once, cutting its streams without a final frame.
    # Redis trouble reaches a request through the ledger instead (503 limiter_unavailable).
    channel_layer_alias = None

    grant: KeyGrant | None
    authorization: str | None
    pinned_version: str | None  # from the handshake's X-Model-Version
    session_organization: Any  # the playground's organisation id, when signed in by session

    async def connect(self) -> None:
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.closing = False  # closed for a draining gateway: nothing more is started
        self.grant = None
        self.authorization = None
        self.session_organization = None
        headers = dict(self.scope.get("headers", []))
        self.pinned_version = headers.get(b"x-model-version", b"").decode("latin1").strip() or None
        header = headers.get(b"authorization")
        if header:
            try:
                self.authorization = header.decode()
                self.grant = await authenticate(self.authorization)
            except APIError:
                await self.close(code=4401)
                return
        await self.accept()

    async def disconnect(self, code: int) -> None:
        tasks = list(getattr(self, "tasks", {}).values())
        for task in tasks:
            task.cancel()
        if tasks:
            # Each task settles its request in its own finally; wait for all of them.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _send(self, message: dict[str, Any]) -> None:
        """Send a frame, bounded by CLIENT_SEND_TIMEOUT: a client that stops reading has its
        socket closed, which cancels (and settles) its requests."""
        try:
            async with asyncio.timeout(settings.CLIENT_SEND_TIMEOUT):
                await self.send(text_data=orjson.dumps(message).decode())
        except TimeoutError:
            logger.warning("a WebSocket client stopped reading for %g s; closing it", settings.CLIENT_SEND_TIMEOUT)
            await self.close(code=1008)
            raise ClientStalled from None

    async def _error(self, client_id: Any, error: APIError) -> None:
        await self._send({"type": "error", "id": client_id, "error": error.detail()})

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if _frame_size(text_data, bytes_data) > settings.API_MAX_BODY_BYTES:
            limit = settings.API_MAX_BODY_BYTES
            await self._error(None, PayloadTooLarge(
                f"The frame is larger than this API accepts ({limit} bytes, {limit / 1024 / 1024:g} MiB)."
            ))  # fmt: skip
            return
        if text_data is None:
            # The protocol is JSON text frames: a binary one is refused, whatever it holds.
            await self._error(None, InvalidRequest("Frames must be JSON text frames, not binary ones."))
            return
        try:
            message = orjson.loads(text_data)
        except orjson.JSONDecodeError:
            await self._error(None, InvalidRequest("Frames must be JSON."))
            return
        if not isinstance(message, dict):
            await self._error(None, InvalidRequest("Frames must be objects."))
            return
        kind = message.get("type")
        client_id = message.get("id")
        if kind == "auth" and "organization" in message and "api_key" not in message:
            await self._auth_session(message["organization"])
        elif kind == "auth":
            await self._auth(str(message.get("api_key", "")))
        elif kind == "cancel":
            task = self.tasks.get(str(client_id))
            if task is not None:
                task.cancel()
        elif kind == "chat.completion":
            await self._start(client_id, message.get("body"), message.get("model_version"))
        else:
            await self._error(client_id, InvalidRequest(f"Unknown message type {kind!r}.", param="type"))

    async def _auth(self, secret: str) -> None:
        self.session_organization = None
        try:
            self.authorization = f"Bearer {secret}"
            self.grant = await authenticate(self.authorization)
            await self._send({"type": "auth", "ok": True})
        except APIError as exc:
            self.grant = None
            await self._send({"type": "auth", "ok": False, "error": exc.detail()})

    async def _auth_session(self, organization: Any) -> None:
        self.authorization = None
        self.session_organization = organization
        try:
            self.grant = await session_grant(self.scope, organization)
            await self._send({"type": "auth", "ok": True})
        except APIError as exc:
            self.grant = None
            self.session_organization = None
            await self._send({"type": "auth", "ok": False, "error": exc.detail()})

    async def _authenticate(self) -> KeyGrant:
        if self.session_organization is not None:
            return await session_grant(self.scope, self.session_organization)
        return await authenticate(self.authorization)

    async def _start(self, client_id: Any, body: Any, model_version: Any = None) -> None:
        if self.closing:  # sent as the socket closed (1012): never started, so safe to send again
            return
        if not isinstance(client_id, str) or not client_id:
            await self._error(client_id, InvalidRequest("Each request needs a string 'id'.", param="id"))
            return
        if client_id in self.tasks:
            await self._error(client_id, InvalidRequest(f"Request id {client_id!r} is already running.", param="id"))
            return
        if self.grant is None:
            await self._error(client_id, AuthenticationFailed(
                "Authenticate first: an Authorization header on the handshake or an 'auth' message.",
                code="missing_api_key",
            ))  # fmt: skip
            return
        limit = settings.WS_MAX_REQUESTS_PER_SOCKET
        if len(self.tasks) >= limit:
            await self._error(client_id, InvalidRequest(f"At most {limit} requests may run on one socket."))
            return
        if not isinstance(body, dict):
            await self._error(client_id, InvalidRequest("'body' must be a chat completion request object.",
                                                        param="body"))  # fmt: skip
            return
        if model_version is not None and (not isinstance(model_version, str) or not model_version.strip()):
            await self._error(client_id, InvalidRequest("'model_version' must be a non-empty string.",
                                                        param="model_version"))  # fmt: skip
            return
        if model_version is not None:
            pin: tuple[str, str] | None = (model_version.strip(), "model_version")
        elif self.pinned_version is not None:
            pin = (self.pinned_version, "x-model-version")
        else:
            pin = None
        task = asyncio.get_running_loop().create_task(self._run(client_id, body, pin))
        self.tasks[client_id] = task
        task.add_done_callback(lambda _t: self.tasks.pop(client_id, None))

    async def _run(self, client_id: str, body: dict[str, Any], pin: tuple[str, str] | None) -> None:
        """One request; ``pin``: the version it is pinned to and where the pin came from."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        call: InferenceCall | None = None
        status = 200
        error: APIError | None = None
        try:
            # Checked again per request: a key revoked mid-socket stops working within a second
            # (a session signed out, or a member removed, at the next request).
            grant = await self._authenticate()
            call = InferenceCall(CHAT, grant, uuid.uuid4())
            pinned, param = pin or (None, "x-model-version")
            await call.run(orjson.dumps(body), pinned_version=pinned, pin_param=param)
            async for chunk in call.chunks():
                if "error" in chunk:
                    status = call.status or 502
                    error = APIError(**_detail_args(chunk["error"]), status=status)
                elif chunk.get("choices"):
                    await self._send({"type": "chunk", "id": client_id, "data": chunk})
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        except ClientStalled:
            status = CLIENT_CLOSED  # it stopped reading: settled with what it was sent
        except APIError as exc:
            status, error = exc.status, exc
        except Exception:
            logger.exception("WebSocket request %s failed", client_id)
            status = 500
            error = APIError("The server had an error while processing your request.")
        finally:
            # Its own task, shielded: a second cancel (cancel, then the socket closing) cannot
            # skip the settlement or the final frame.
            await asyncio.shield(asyncio.ensure_future(self._finish(client_id, call, status, error)))

    async def _finish(self, client_id: str, call: InferenceCall | None, status: int, error: APIError | None) -> None:
        """Settle (idempotent; waits for an admission still in flight), then the request's one
        final frame (and an error frame before it when it failed)."""
        if call is not None:
            await call.close(status)
        frames: list[dict[str, Any]] = []
        if call is not None and call.admitted:
            if error is not None:
                frames.append({"type": "error", "id": client_id, "error": error.detail()})
            outcome = "completed" if status == 200 else "cancelled" if status == CLIENT_CLOSED else "error"
            frames.append({
                "type": "usage",
                "id": client_id,
                "request_id": str(call.request_id),
                "status": outcome,
                "status_code": call.status or status,
                "cache": call.cache_outcome,
                "model_version": call.version.version,
                "usage": {
                    "prompt_tokens": call.prompt_tokens_metered,
                    "completion_tokens": call.completion_tokens,
                    "total_tokens": call.prompt_tokens_metered + call.completion_tokens,
                },
            })  # fmt: skip
        else:
            frames.append({"type": "error", "id": client_id, "error": (error or _CANCELLED).detail()})
        try:
            for frame in frames:
                await self._send(frame)
        except Exception:  # noqa: BLE001 - the socket may be gone; the usage is metered regardless
            logger.debug("could not send the final frame for %s", client_id)
        if draining() and not self.closing and all(other == client_id for other in self.tasks):
            # The gateway is stopping behind a balancer: leave at the first moment this socket
            # carries no request, with "service restart" (1012); the client sends its next
            # request on a new connection, which the balancer gives another gateway. A
            # request that got no frame back on a socket closed so was never started.
            self.closing = True
            await self.close(code=1012)


class ClientStalled(Exception):
    """The client stopped reading: a frame waited longer than CLIENT_SEND_TIMEOUT."""


def _frame_size(text_data: str | None, bytes_data: bytes | None) -> int:
    """A frame's size in bytes, as API_MAX_BODY_BYTES counts a request body (text is encoded
    only when its length alone cannot decide: a character is one to four bytes)."""
    if bytes_data is not None:
        return len(bytes_data)
    if not text_data:
        return 0
    if len(text_data) * 4 <= settings.API_MAX_BODY_BYTES or len(text_data) > settings.API_MAX_BODY_BYTES:
        return len(text_data)  # decided either way without encoding: within the limit, or over it
    return len(text_data.encode())


def _detail_args(detail: dict[str, Any]) -> dict[str, Any]:
    return {
        "message": str(detail.get("message", "")),
        "type": detail.get("type"),
        "param": detail.get("param"),
        "code": detail.get("code"),
    }
