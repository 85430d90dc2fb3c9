"""An LLM call's answer over HTTP: driven for its request, sent as JSON or as SSE events, with
the key's limits, the version that served it and where the time went in its headers. Shared by
the OpenAI paths (``serving.llm.views``) and the seeds' generate (``serving.llm.seed_views``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
from django.http import HttpResponseBase
from redis.exceptions import RedisError

from accounts.grants import KeyGrant
from billing import ledger
from serving.gateway.errors import APIError, RateLimited
from serving.gateway.openai_wire import rate_limit_headers
from serving.gateway.requests import ApiRequest
from serving.llm.call import COMPLETIONS, InferenceCall


async def current_limits(grant: KeyGrant) -> dict[str, str]:
    """x-ratelimit-* headers for an answer that charged nothing (best effort)."""
    try:
        return rate_limit_headers(await ledger.peek(grant))
    except RedisError:
        return {}


def _as_is(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    return [chunk]


async def sse(
    call: InferenceCall,
    render: Callable[[dict[str, Any]], list[dict[str, Any]]] = _as_is,
    last: Callable[[], dict[str, Any]] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The call's chunks as SSE events (``render`` turns a chunk into the events it makes; an
    error chunk is always the last), then ``last()``'s event and ``[DONE]`` unless it failed.
    Chunks already received together go out in one write (one syscall, one ASGI message)."""
    held: list[bytes] = []
    async for chunk in call.chunks():
        events = [chunk] if "error" in chunk else render(chunk)
        held.extend(b"data: " + orjson.dumps(event) + b"\n\n" for event in events)
        if held and not call.more_ready:
            yield b"".join(held)
            held.clear()
    if not call.failed:
        if last is not None:
            held.append(b"data: " + orjson.dumps(last()) + b"\n\n")
        held.append(b"data: [DONE]\n\n")
    if held:
        yield b"".join(held)


async def run_call(
    request: ApiRequest, call: InferenceCall, raw_body: bytes, *, pinned_version: str | None = None
) -> dict[str, Any] | None:
    """Drive ``call`` for this request (settled however the request ends): its JSON answer,
    or None for a stream (``sse``). A refused or failed call's error carries the key's limits
    (a 429 its own)."""
    request.on_close(call.close)
    try:
        return await call.run(raw_body, pinned_version=pinned_version, cache_control=request.header("cache-control"))
    except APIError as exc:
        if not isinstance(exc, RateLimited):
            exc.headers.update(
                rate_limit_headers(call.rate_limits) if call.rate_limits else await current_limits(call.grant)
            )
        raise


def annotate_answer(response: HttpResponseBase, call: InferenceCall) -> None:
    """An answer's headers: the key's limits once admitted (a cache hit too), the version that
    served it (pinned or chosen), the cache's outcome, and where the time before the first
    byte went (W3C Server-Timing, for clients and benchmarks)."""
    if call.rate_limits is not None:
        for name, value in rate_limit_headers(call.rate_limits).items():
            response[name] = value
    response["x-model-version"] = call.version.version
    if call.endpoint is not COMPLETIONS:
        response["x-cache"] = call.cache_outcome
        if call.cache_hit is not None:
            response["x-cache-similarity"] = f"{call.cache_hit.similarity:.4f}"
            response["x-cache-tier"] = call.cache_hit.wording
            if call.cache_hit.score is not None:
                response["x-cache-score"] = f"{call.cache_hit.score:.4f}"
    response["Server-Timing"] = ", ".join(f"{stage};dur={ms:.2f}" for stage, ms in call.stage_ms.items())
