"""A fast mock of an OpenAI-compatible engine, for measuring what a gateway adds.

A raw ASGI app (no framework): every chat or completion request gets a fixed answer at
once, as JSON or, with ``"stream": true``, as ``--tokens`` SSE chunks (one content chunk
per token, a usage chunk when the request asks for ``stream_options.include_usage``, then
``[DONE]``), each chunk its own write so the gateway relays real chunks. /health and
/v1/models answer too, so the gateway's health checks and vLLM's clients are satisfied;
/stats counts the requests answered.

    .venv/bin/python bench/mock_openai.py --port 9100 --tokens 8

It runs under uvicorn with uvloop and httptools, one process, access log off.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

PROMPT_TOKENS = 12
TOKENS = 8  # set by --tokens
REQUESTS = 0  # chat and completion requests answered (GET /stats)
WORD = "hello"
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def _usage(completion: int) -> dict[str, int]:
    return {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": completion, "total_tokens": PROMPT_TOKENS + completion}


def _answer(path: str, model: str) -> bytes:
    text = " ".join([WORD] * TOKENS)
    created = int(time.time())
    if path.endswith("/chat/completions"):
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        kind = "text_completion"
    body = {"id": "mock-1", "object": kind, "created": created, "model": model, "choices": [choice]}
    body["usage"] = _usage(TOKENS)
    return orjson.dumps(body)


def _chunks(path: str, model: str, include_usage: bool) -> list[bytes]:
    chat = path.endswith("/chat/completions")
    kind = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())
    out = []
    for i in range(TOKENS):
        last = i == TOKENS - 1
        piece = WORD if i == 0 else " " + WORD
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
        if chat:
            choice["delta"] = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
        else:
            choice["text"] = piece
        chunk = {"id": "mock-1", "object": kind, "created": created, "model": model, "choices": [choice]}
        out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    if include_usage:
        usage = {"id": "mock-1", "object": kind, "created": created, "model": model, "choices": []}
        usage["usage"] = _usage(TOKENS)
        out.append(b"data: " + orjson.dumps(usage) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


async def _body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    if scope["method"] == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
        global REQUESTS
        REQUESTS += 1
        request = orjson.loads(await _body(receive))
        model = str(request.get("model", "mock"))
        if request.get("stream"):
            include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            for chunk in _chunks(path, model, include_usage):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": _answer(path, model)})
        return
    await _body(receive)
    if path == "/health":
        status, body = 200, b""
    elif path == "/stats":
        status, body = 200, orjson.dumps({"requests": REQUESTS})
    elif path == "/v1/models":
        status, body = 200, orjson.dumps({"object": "list", "data": [{"id": "mock", "object": "model"}]})
    else:
        status, body = 404, orjson.dumps({"error": {"message": "not found", "type": "not_found"}})
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    global TOKENS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens per answer (chunks per stream)")
    args = parser.parse_args()
    TOKENS = args.tokens
    import uvicorn

    uvicorn.run(
        app, host=args.host, port=args.port, loop="uvloop", http="httptools", access_log=False,
        log_level="warning", lifespan="off", backlog=4096,
    )  # fmt: skip


if __name__ == "__main__":
    main()
