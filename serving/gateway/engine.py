"""The engine client: pooled async HTTP to vLLM replicas, retries before the first byte,
timeouts, and engine errors mapped to OpenAI errors.

Each replica requires its own key (``registry.replica_keys``); an external upstream's replica
gets the upstream's key instead, and the upstream's name for the model
(``ReplicaRoute.upstream``). A replica that breaks a request (5xx, a dropped or garbled
connection) counts a failure on its circuit, one that answers (2xx, 4xx) a success, and a
replica whose circuit does not ``allow`` it is skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from django.conf import settings

from core.lifecycle import PerLoop, fail_all
from registry.replica_keys import replica_api_key
from serving.gateway.errors import APIError, EngineFailed, EngineTimeout, EngineUnavailable
from serving.gateway.inference_protocol import HEADER_LENGTH, MANY_PATH, BadRequest, Part, pack_many, take_answers
from serving.gateway.routing import Lease, ReplicaRoute, Router

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
    upstream = replica.upstream
    if upstream is None:
        authorization: dict[str, str] = {"authorization": f"Bearer {replica_api_key(replica.id)}"}
        if replica.lora is not None and isinstance(payload, dict):  # an adapter: its name in the base's engine
            payload = {**payload, "model": replica.lora}
    else:  # an external upstream: its own key, its own name for the model, no vLLM scheduling hint
        authorization = upstream.auth_headers
        if isinstance(payload, dict):
            payload = {**{k: v for k, v in payload.items() if k != "priority"}, "model": upstream.served_model}
    if isinstance(payload, RawBody):
        data, headers = payload.content, {**payload.headers, **authorization}
    else:
        data, headers = orjson.dumps(payload), {"content-type": "application/json", **authorization}
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
    together: bool = False,
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
    ``together`` (a predict worker's request, not streamed): it may travel with the other
    predictions waiting for the same replica (``Together``); its answer is its own all the same.
    """
    tried: list[int] = []
    try:
        return await _dispatch(
            router, replicas, path, payload, stream=stream, tried=tried, first_byte_by=first_byte_by, together=together
        )
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
    together: bool = False,
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
        response: aiohttp.ClientResponse | PartResponse
        try:
            async with timer:
                if together and isinstance(payload, RawBody):
                    response = await _together_for(replica).send(path, payload)
                else:
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
            assert isinstance(response, aiohttp.ClientResponse)
            router.record_success(replica.id)
            return lease, response
        try:
            answer = EngineAnswer(response.status, await response.read(), response.headers.get(HEADER_LENGTH))
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


# --- predictions that travel together -------------------------------------------------------


class PartResponse:
    """A predict worker's answer to one request, read whole, as ``_dispatch`` reads a response."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes, header_length: str | None) -> None:
        self.status = status
        self.body = body
        self.headers = {HEADER_LENGTH: header_length} if header_length is not None else {}

    async def read(self) -> bytes:
        return self.body

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


_Waiting = tuple[str, RawBody, "asyncio.Future[PartResponse]"]


class Together:
    """The predictions of this process waiting for one replica, sent together.

    At most ``IN_FLIGHT`` calls to the replica are on their way at once. A prediction that
    finds one free goes at once, alone, as the ordinary request it is; those that find none
    wait, and go together as the next call (the worker's ``MANY_PATH``, at most
    ``MAX_PARTS``), where the worker answers each as if it came alone, as soon as it is
    ready (the answer streams: no prediction waits for another's batch). No timer: at low load
    nothing waits; under load one HTTP exchange carries many predictions, which is where a
    one-process gateway's CPU went (the worker call was measured at about a third of it per
    prediction: docs/performance.md). A failed call fails each of its predictions as its own
    request would have failed (each is judged, retried or fallen back by its caller).
    """

    IN_FLIGHT = 2
    MAX_PARTS = 64

    def __init__(self, replica: ReplicaRoute) -> None:
        self.replica = replica
        self.many = True  # False once the worker says it has no MANY_PATH (started by older code)
        self._waiting: deque[_Waiting] = deque()
        self._in_flight = 0
        self._calls: set[asyncio.Task[None]] = set()

    @property
    def idle(self) -> bool:
        return not self._waiting and self._in_flight == 0

    async def send(self, path: str, payload: RawBody) -> PartResponse:
        future: asyncio.Future[PartResponse] = asyncio.get_running_loop().create_future()
        self._waiting.append((path, payload, future))
        self._launch()
        return await future

    def _launch(self) -> None:
        while self._waiting and self._in_flight < self.IN_FLIGHT:
            batch: list[_Waiting] = []
            while self._waiting and len(batch) < self.MAX_PARTS:
                waiting = self._waiting.popleft()
                if not waiting[2].done():  # its caller gave up (timed out, cancelled): not sent
                    batch.append(waiting)
            if not batch:
                return
            self._in_flight += 1
            call = asyncio.get_running_loop().create_task(self._call(batch))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[_Waiting]) -> None:
        try:
            if len(batch) > 1 and self.many:
                await self._together(batch)
            else:
                await asyncio.gather(*(self._alone(*waiting) for waiting in batch))
        finally:
            self._in_flight -= 1
            self._launch()

    async def _exchange(self, path: str, payload: RawBody) -> tuple[int, bytes, str | None]:
        response = await _send(self.replica, path, payload)
        try:
            return response.status, await response.read(), response.headers.get(HEADER_LENGTH)
        finally:
            response.release()

    async def _alone(self, path: str, payload: RawBody, future: asyncio.Future[PartResponse]) -> None:
        try:
            status, body, header_length = await self._exchange(path, payload)
        except BaseException as exc:
            fail_all([future], exc)
            if not isinstance(exc, Exception):
                raise
            return
        if not future.done():
            future.set_result(PartResponse(status, body, header_length))

    async def _together(self, batch: list[_Waiting]) -> None:
        futures = [future for *_, future in batch]
        body = pack_many([Part(0, payload.headers.get(HEADER_LENGTH), payload.content) for _, payload, _ in batch])
        try:
            response = await _send(self.replica, MANY_PATH, RawBody(body, {"content-type": "application/octet-stream"}))
            try:
                if response.status == 404:  # a worker older than this path: each goes alone from now on
                    self.many = False
                    await asyncio.gather(*(self._alone(*waiting) for waiting in batch))
                    return
                if response.status != 200:  # the call itself was refused (a wrong key, say): so is each
                    refused = PartResponse(response.status, await response.read(), None)
                    for future in futures:
                        if not future.done():
                            future.set_result(refused)
                    return
                await self._read_answers(response.content, futures)
            finally:
                response.release()
        except BadRequest as exc:
            unreadable = f"the worker's answer to several predictions is unreadable: {exc}"
            fail_all(futures, aiohttp.ClientPayloadError(unreadable))
        except BaseException as exc:  # what was answered stands; the rest fail with this
            fail_all(futures, exc)
            if not isinstance(exc, Exception):
                raise

    @staticmethod
    async def _read_answers(reader: aiohttp.StreamReader, futures: list[asyncio.Future[PartResponse]]) -> None:
        """Each part's answer as the worker streams it (``answer_frame``s), to its caller as soon
        as its frame is whole (one read takes whatever frames have come)."""
        answered: set[int] = set()
        buffer = b""
        while len(answered) < len(futures):
            chunk = await reader.readany()
            if not chunk:
                raise aiohttp.ClientPayloadError(f"the worker answered {len(answered)} of {len(futures)} predictions")
            whole, buffer = take_answers(buffer + chunk, len(futures))
            for index, part in whole:
                if index in answered:
                    raise BadRequest(f"part {index} answered twice")
                answered.add(index)
                if not futures[index].done():
                    futures[index].set_result(PartResponse(part.status, part.body, part.header_length))


_together_by_loop: PerLoop[dict[tuple[int, str], Together]] = PerLoop(dict)


# Replicas come and go (hot-swaps, restarts): past this many, the idle ones are forgotten.
TOGETHER_KEPT = 256


def _together_for(replica: ReplicaRoute) -> Together:
    calls = _together_by_loop.get()
    key = (replica.id, replica.endpoint)
    together = calls.get(key)
    if together is None:
        if len(calls) >= TOGETHER_KEPT:
            for idle in [k for k, t in calls.items() if t.idle]:
                del calls[idle]
        together = calls[key] = Together(replica)
    return together


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
