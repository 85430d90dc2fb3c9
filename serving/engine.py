"""The engine client: pooled async HTTP to vLLM replicas, retries before the first byte,
timeouts, and engine errors mapped to OpenAI errors.

Each replica requires its own key (``registry.replica_keys``); a replica that breaks a
request (5xx, a dropped or garbled connection) counts a failure on its circuit, one that
answers (2xx, 4xx) a success, and a replica whose circuit does not ``allow`` it is skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from django.conf import settings

from core.lifecycle import PerLoop
from registry.replica_keys import replica_api_key
from serving.errors import APIError, EngineFailed, EngineTimeout, EngineUnavailable
from serving.routing import Lease, ReplicaRoute, Router

logger = logging.getLogger(__name__)

DONE = object()  # the stream's `data: [DONE]`

# Failures before the request reached an engine: safe to try the next replica.
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# Failures after it may have: the request is not retried.
_BROKEN = (aiohttp.ClientError, asyncio.IncompleteReadError)


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=2048, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=300),
        timeout=aiohttp.ClientTimeout(
            total=None,
            connect=settings.ENGINE_CONNECT_TIMEOUT,
            sock_connect=settings.ENGINE_CONNECT_TIMEOUT,
            sock_read=settings.ENGINE_REQUEST_TIMEOUT,
        ),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
        auto_decompress=False,
        json_serialize=lambda obj: orjson.dumps(obj).decode(),
    )


_sessions = PerLoop(_session, usable=lambda session: not session.closed)


def engine_session() -> aiohttp.ClientSession:
    """This loop's pooled client (aiohttp: measured ~3x less CPU per request than httpx,
    docs/performance.md). ``connect`` bounds the wait for a pooled connection plus the
    connect; ``sock_read`` the silence between two reads of an answer."""
    return _sessions.get()


@dataclass
class EngineAnswer:
    """A whole (non-streaming) answer of an engine."""

    status_code: int
    content: bytes
    # The Open Inference Protocol's binary extension: the JSON part's length (predict workers).
    inference_header: str | None = None


@dataclass(frozen=True)
class RawBody:
    """A request body sent as it is (a predict worker's binary tensors), with its own headers."""

    content: bytes
    headers: dict[str, str]


def engine_error(status: int, content: bytes) -> APIError:
    """Turn an engine's error answer into our error, keeping its message and status."""
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        data = {}
    detail = data.get("error", data) if isinstance(data, dict) else {}
    if not isinstance(detail, dict):
        detail = {"message": str(detail)}
    message = str(detail.get("message") or f"The engine answered HTTP {status}.")
    code = detail.get("code")
    if status < 500:
        return APIError(
            message,
            status=status,
            type="invalid_request_error",
            param=detail.get("param"),
            code=code if isinstance(code, str) else None,
        )
    return EngineFailed(f"The engine failed: {message}", status=502)


class EngineStream:
    """An open streaming response from one replica: ``async for event in stream``.

    Events are parsed JSON objects, and ``DONE`` at the end. ``aclose()`` closes the
    connection (unless the stream ended with ``[DONE]``), which makes vLLM abort the sequence.
    """

    def __init__(self, router: Router, lease: Lease, response: aiohttp.ClientResponse) -> None:
        self.router = router
        self.lease = lease
        self.replica = lease.replica
        self._response = response
        self._finished = False
        self._buffer = b""
        self._iterator = self._events()

    @property
    def ready(self) -> bool:
        """Whether the next event is already received (taking it will not wait)."""
        return b"\n\n" in self._buffer

    async def _events(self) -> AsyncIterator[Any]:
        try:
            async for chunk in self._response.content.iter_any():
                self._buffer += chunk
                while True:
                    end = self._buffer.find(b"\n\n")
                    if end < 0:
                        break
                    block, self._buffer = self._buffer[:end], self._buffer[end + 2 :]
                    for line in block.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            self._finished = True
                            yield DONE
                            return
                        try:
                            event = orjson.loads(data)
                        except orjson.JSONDecodeError:
                            event = None
                        if not isinstance(event, dict):
                            self.router.record_failure(self.replica.id)
                            raise EngineFailed("The engine sent an event that is not a JSON object.")
                        yield event
        except (*_BROKEN, TimeoutError) as exc:
            self.router.record_failure(self.replica.id)
            raise EngineFailed(f"The engine connection broke mid-stream ({type(exc).__name__}).") from exc
        # The connection ended without [DONE]: the engine went away mid-stream.
        self.router.record_failure(self.replica.id)
        raise EngineFailed("The engine closed the stream before it finished.")

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterator

    async def __anext__(self) -> Any:
        return await self._iterator.__anext__()

    async def aclose(self) -> None:
        content = self._response.content
        try:
            if self._finished and not content.at_eof():
                # [DONE] seen; the body's last (empty) chunk usually follows at once.
                async with asyncio.timeout(0.1):
                    await content.read()
        except (*_BROKEN, TimeoutError):
            pass
        finally:
            if self._finished and content.at_eof():
                self._response.release()  # complete: the connection goes back to the pool
            else:
                self._response.close()  # unfinished: dropping the connection aborts the engine's sequence
            self.lease.release()


async def _send(replica: ReplicaRoute, path: str, payload: dict[str, Any] | RawBody) -> aiohttp.ClientResponse:
    authorization = f"Bearer {replica_api_key(replica.id)}"
    if isinstance(payload, RawBody):
        data, headers = payload.content, {**payload.headers, "authorization": authorization}
    else:
        data, headers = orjson.dumps(payload), {"content-type": "application/json", "authorization": authorization}
    return await engine_session().post(
        replica.endpoint.rstrip("/") + path, data=data, headers=headers, allow_redirects=False
    )


async def dispatch(
    router: Router,
    replicas: list[ReplicaRoute],
    path: str,
    payload: dict[str, Any] | RawBody,
    *,
    stream: bool,
    first_byte_by: float | None = None,
) -> tuple[Lease, Any]:
    """Send to the first replica that accepts the connection; try the next on connect failure.

    Only failures before the request reached an engine are retried, so a request is never
    run twice. A 4xx/5xx answer is raised as the matching APIError; a connection that
    breaks after the request went out is a 502. On success the replica is returned held
    (a ``Lease``): the caller releases it when the request is over. The
    answer is an ``EngineAnswer`` (read whole), or with ``stream`` the open aiohttp response.
    ``first_byte_by`` (loop time): an engine that has not begun to answer by then (no status
    line yet: hung, or too busy) is an ``EngineTimeout`` and a failure on its circuit.
    An error says which replicas the attempt went to (``APIError.replicas_tried``).
    """
    tried: list[int] = []
    try:
        return await _dispatch(router, replicas, path, payload, stream=stream, tried=tried, first_byte_by=first_byte_by)
    except APIError as exc:
        exc.replicas_tried = tuple(tried)  # the fallback tries other replicas
        raise


async def _dispatch(
    router: Router,
    replicas: list[ReplicaRoute],
    path: str,
    payload: dict[str, Any] | RawBody,
    *,
    stream: bool,
    tried: list[int],
    first_byte_by: float | None,
) -> tuple[Lease, Any]:
    tries = settings.ENGINE_CONNECT_RETRIES + 1
    last_error: Exception | None = None
    for replica in replicas:
        if tries == 0:
            break
        if not router.allow(replica.id):
            continue  # its circuit opened meanwhile, or another request is its half-open probe
        tries -= 1
        tried.append(replica.id)
        lease = router.lease(replica)
        timer = asyncio.timeout_at(first_byte_by)
        try:
            async with timer:
                response = await _send(replica, path, payload)
        except _NOT_SENT as exc:
            lease.release()
            router.record_failure(replica.id)
            logger.warning("replica %s could not be reached: %s %s", replica.id, type(exc).__name__, exc)
            last_error = exc
            continue
        except (*_BROKEN, TimeoutError) as exc:  # timed out, disconnected, bad HTTP, ...
            lease.release()
            router.record_failure(replica.id)
            if timer.expired():
                raise EngineTimeout("The engine did not begin to answer in time.") from exc
            raise EngineFailed(f"The engine connection broke ({type(exc).__name__}).") from exc
        except BaseException:
            lease.release()
            router.abandon(replica.id)  # cancelled: nothing learnt about the replica
            raise
        if response.status >= 400:
            lease.release()
            if response.status >= 500:
                router.record_failure(replica.id)
            else:
                router.record_success(replica.id)  # it refused the request, but it answered: it is up
            try:
                content = await response.read()
            except (*_BROKEN, TimeoutError):
                content = b""
            finally:
                response.release()
            raise engine_error(response.status, content)
        if stream:
            router.record_success(replica.id)
            return lease, response
        try:
            answer = EngineAnswer(
                response.status, await response.read(), response.headers.get("inference-header-content-length")
            )
        except (*_BROKEN, TimeoutError) as exc:
            lease.release()
            router.record_failure(replica.id)
            raise EngineFailed(f"The engine connection broke ({type(exc).__name__}).") from exc
        except BaseException:
            lease.release()
            router.abandon(replica.id)
            response.close()
            raise
        finally:
            response.release()
        router.record_success(replica.id)
        return lease, answer
    if last_error is None:
        raise EngineUnavailable("No replica of this model is ready. Try again shortly.")
    raise EngineUnavailable(f"No replica of this model could be reached ({type(last_error).__name__}).")


async def open_stream(
    router: Router,
    replicas: list[ReplicaRoute],
    path: str,
    payload: dict[str, Any] | RawBody,
    *,
    first_byte_by: float | None = None,
) -> EngineStream:
    """The replica stays held until the stream is closed (``aclose`` releases its lease).
    ``first_byte_by``: as ``dispatch``'s (a stream's first-token deadline)."""
    lease, response = await dispatch(router, replicas, path, payload, stream=True, first_byte_by=first_byte_by)
    return EngineStream(router, lease, response)


def parse_json(router: Router, replica: ReplicaRoute, content: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        router.record_failure(replica.id)
        raise EngineFailed("The engine sent a response that is not JSON.") from None
    if not isinstance(data, dict):
        router.record_failure(replica.id)
        raise EngineFailed("The engine sent a response that is not a JSON object.")
    return data
