"""The engine client: pooled async HTTP to vLLM replicas, retries before the first byte,
timeouts, and engine errors mapped to OpenAI errors.

Each replica requires its own key (``serving.replica_keys``); a replica that breaks a
request (5xx, a dropped or garbled connection) counts a failure on its circuit, one that
answers (2xx, 4xx) a success, and a replica whose circuit does not ``allow`` it is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
from django.conf import settings

from serving.errors import APIError, EngineFailed, EngineUnavailable
from serving.replica_keys import replica_api_key
from serving.routing import ReplicaRoute, Router

logger = logging.getLogger(__name__)

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()

DONE = object()  # the stream's `data: [DONE]`


def engine_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=settings.ENGINE_CONNECT_TIMEOUT,
                read=settings.ENGINE_REQUEST_TIMEOUT,
                write=settings.ENGINE_CONNECT_TIMEOUT,
                pool=settings.ENGINE_CONNECT_TIMEOUT,
            ),
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256, keepalive_expiry=30),
        )
        _clients[loop] = client
    return client


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
    connection, which makes vLLM abort the sequence.
    """

    def __init__(self, router: Router, replica: ReplicaRoute, response: httpx.Response) -> None:
        self.router = router
        self.replica = replica
        self._response = response
        self._iterator = self._events()

    async def _events(self) -> AsyncIterator[Any]:
        buffer = b""
        try:
            async for chunk in self._response.aiter_raw():
                buffer += chunk
                while True:
                    end = buffer.find(b"\n\n")
                    if end < 0:
                        break
                    block, buffer = buffer[:end], buffer[end + 2 :]
                    for line in block.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
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
        except httpx.HTTPError as exc:
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
        await self._response.aclose()


async def _send(replica: ReplicaRoute, path: str, payload: dict[str, Any], *, stream: bool) -> httpx.Response:
    client = engine_client()
    request = client.build_request(
        "POST",
        replica.endpoint.rstrip("/") + path,
        content=orjson.dumps(payload),
        headers={"content-type": "application/json", "authorization": f"Bearer {replica_api_key(replica.id)}"},
    )
    return await client.send(request, stream=stream)


async def dispatch(
    router: Router, replicas: list[ReplicaRoute], path: str, payload: dict[str, Any], *, stream: bool
) -> tuple[ReplicaRoute, httpx.Response]:
    """Send to the first replica that accepts the connection; try the next on connect failure.

    Only failures before the request reached an engine are retried, so a request is never
    run twice. A 4xx/5xx answer is raised as the matching APIError; a connection that
    breaks after the request went out is a 502. On success the replica is returned
    acquired (``router.acquire``): the caller releases it when the request is over.
    """
    tries = settings.ENGINE_CONNECT_RETRIES + 1
    last_error: Exception | None = None
    for replica in replicas:
        if tries == 0:
            break
        if not router.allow(replica.id):
            continue  # its circuit opened meanwhile, or another request is its half-open probe
        tries -= 1
        router.acquire(replica.id)
        try:
            response = await _send(replica, path, payload, stream=stream)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            router.release(replica.id)
            router.record_failure(replica.id)
            logger.warning("replica %s could not be reached: %s %s", replica.id, type(exc).__name__, exc)
            last_error = exc
            continue
        except httpx.TimeoutException as exc:
            router.release(replica.id)
            router.record_failure(replica.id)
            raise EngineFailed(f"The engine connection timed out ({type(exc).__name__}).") from exc
        except httpx.TransportError as exc:  # RemoteProtocolError, ReadError, WriteError, ...
            router.release(replica.id)
            router.record_failure(replica.id)
            raise EngineFailed(f"The engine connection broke ({type(exc).__name__}).") from exc
        except BaseException:
            router.release(replica.id)
            router.abandon(replica.id)  # cancelled: nothing learnt about the replica
            raise
        if response.status_code >= 400:
            router.release(replica.id)
            if response.status_code >= 500:
                router.record_failure(replica.id)
            else:
                router.record_success(replica.id)  # it refused the request, but it answered: it is up
            try:
                content = await response.aread()
            except httpx.HTTPError:
                content = b""
            finally:
                await response.aclose()
            raise engine_error(response.status_code, content)
        router.record_success(replica.id)
        return replica, response
    if last_error is None:
        raise EngineUnavailable("No replica of this model is ready. Try again shortly.")
    raise EngineUnavailable(f"No replica of this model could be reached ({type(last_error).__name__}).")


async def open_stream(router: Router, replicas: list[ReplicaRoute], path: str, payload: dict[str, Any]) -> EngineStream:
    """The replica stays acquired until the caller releases it (after closing the stream)."""
    replica, response = await dispatch(router, replicas, path, payload, stream=True)
    return EngineStream(router, replica, response)


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
