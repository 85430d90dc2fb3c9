"""A tiny stand-in for a vLLM OpenAI server, for fault injection and fast routing tests.

Speaks the same HTTP protocol (/health, /metrics, /v1/chat/completions, /v1/completions,
/v1/embeddings, SSE with usage) and misbehaves on request: ``POST /_control`` with
``{"mode": ...}`` sets how the next requests are answered:

- ``normal``: ``tokens`` chunks, ``delay`` seconds apart;
- ``hang``: accept the request and send nothing (first-token timeout);
- ``die``: send ``die_after`` chunks, then drop the connection;
- ``reset``: read the request, then drop the connection without answering;
- ``bad_event``: send ``die_after`` chunks, then an event that is JSON but not an object;
- ``error400`` / ``error500``: answer with an OpenAI-style error.

Other keys of the same body: ``health`` (``ok``, ``hang``: /health never answers, ``error``:
503), ``ignore_sigterm`` (true: SIGTERM is ignored, as by an engine stuck in shutdown),
``fail_rate`` (the share of /v1 requests answered 500 at once, drawn at random; ``seed``
makes the draws repeatable) and ``latency`` (seconds before any answer: the JSON one, or a
stream's first chunk), for judging a canary that fails or is slow.

With ``prefix_cache`` true it keeps a prefix cache of its own, as vLLM's: each prompt (a chat's
messages one JSON object a line, keys sorted; a completion's text) is cut into blocks of
``BLOCK_BYTES`` bytes (16 "tokens" of 4 bytes), hashed chained, and the blocks it holds from
the prompts it served (the newest ``prefix_cache_blocks``) count as cached: ``usage`` then says
``prompt_tokens`` (its bytes / 4) and ``prompt_tokens_details.cached_tokens``, and /metrics
counts them as vLLM does (``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``).
``prefix_cache_clear`` true empties it and zeroes the counters. Off (the default) every prompt is
3 tokens, none cached.

Like vLLM, with ``VLLM_API_KEY`` in its environment (or ``--api-key``) every /v1 request
needs ``Authorization: Bearer <that key>`` or gets 401; /health, /metrics and the test
endpoints stay open. ``GET /_env`` lists the names (never the values) of its environment.

``GET /v1/models`` lists the one model it serves (``--served-model-name``, default ``fake``),
and /_stats the ``model`` and ``user`` of each /v1 request, in order.

Started with ``--enable-lora`` it takes LoRA adapters at run time as vLLM does with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: ``POST /v1/load_lora_adapter`` (``lora_name``,
``lora_path``: a folder with an adapter_config.json, else 400; loaded already: 400 "has already
been loaded") and ``/v1/unload_lora_adapter`` (unknown: 404 "not found"); /v1/models lists them
after the base, and a request for a model it serves under neither name is a 404 as vLLM's (without
``--enable-lora`` any model name is answered, as the base). An adapter's
answer says which it is: each token is ``<lora name>`` instead of ``tok`` (``t<i>`` streamed
becomes ``<lora name><i>``). /_stats lists the adapters loaded under ``loras``.

Run it as ``python -m tests.support.fake_engine --port N``; it counts requests at /_stats, with the
requests being answered right now under ``active`` by ``<stream|json>:<the body's user>`` (a
stream once it has sent its first chunk: mid-stream), so a test can kill it mid-answer. A
request with ``X-Platform-Warm-Up`` (the supervisor's, before the replica is routed) is answered
at once whatever the mode, and listed under ``warm_ups``, not counted as a request.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import math
import os
import random
import signal
import threading
import time
import uuid
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STATE: dict[str, Any] = {
    "mode": "normal", "tokens": 5, "delay": 0.0, "die_after": 2, "requests": 0, "paths": [], "health": "ok",
    "ignore_sigterm": False, "fail_rate": 0.0, "latency": 0.0, "models": [], "users": [], "prefix_cache": False,
    "prefix_cache_blocks": 100_000,
}  # fmt: skip
LOCK = threading.Lock()
# Draws for fail_rate; ``seed`` in /_control reseeds it.
RNG = random.Random()
# The supervisor's warm-up requests (their paths), answered at once whatever the mode.
WARM_UPS: list[str] = []
# Kept out of STATE, which /_control echoes to anyone.
API_KEYS: list[str] = []
# The name it serves its model under (``--served-model-name``), listed at /v1/models.
SERVED: list[str] = ["fake"]
# LoRA adapters loaded (``--enable-lora``): name → path; None: LoRA off (no adapter routes).
LORAS: dict[str, str] | None = None
# Requests being answered now, by "<stream|json>:<user>" (see /_stats).
ACTIVE: dict[str, int] = {}
# The prefix cache (``prefix_cache``): block hash → None, oldest first; what vLLM's counters count.
BLOCK_BYTES = 64
PREFIX_BLOCKS: OrderedDict[bytes, None] = OrderedDict()
PREFIX_COUNTS = {"queries": 0, "hits": 0}


def prompt_text(path: str, body: dict[str, Any]) -> bytes:
    """What the prefix cache cuts into blocks: a chat's messages, a completion's prompt."""
    if path == "/v1/chat/completions":
        return b"".join(json.dumps(m, sort_keys=True).encode() + b"\n" for m in body.get("messages") or ())
    return json.dumps(body.get("prompt")).encode()


def prefix_usage(text: bytes) -> tuple[int, int]:
    """The prompt's tokens and how many of them were cached; the prompt's blocks are cached after."""
    tokens = max(1, -(-len(text) // 4))
    hashes, previous = [], b""
    for i in range(len(text) // BLOCK_BYTES):
        previous = hashlib.sha256(previous + text[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES]).digest()
        hashes.append(previous)
    with LOCK:
        hit = 0
        while hit < len(hashes) and hashes[hit] in PREFIX_BLOCKS:
            hit += 1
        for digest in hashes:
            PREFIX_BLOCKS[digest] = None
            PREFIX_BLOCKS.move_to_end(digest)
        while len(PREFIX_BLOCKS) > int(STATE["prefix_cache_blocks"]):
            PREFIX_BLOCKS.popitem(last=False)
        cached = min(hit * BLOCK_BYTES // 4, tokens - 1)  # as vLLM, the last token is always computed
        PREFIX_COUNTS["queries"] += tokens
        PREFIX_COUNTS["hits"] += cached
    return tokens, cached


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        """vLLM's rule: with an API key set, every /v1 request carries it as a Bearer token."""
        if not API_KEYS or not self.path.startswith("/v1"):
            return True
        scheme, _, token = self.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and any(hmac.compare_digest(token, key) for key in API_KEYS):
            return True
        self._json(401, {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                   "param": None, "code": "invalid_api_key"}})  # fmt: skip
        return False

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/health":
            health = STATE["health"]
            if health == "hang":
                time.sleep(3600)
                return
            self._json(200 if health == "ok" else 503, {})
        elif self.path == "/metrics":
            labels = f'{{engine="0",model_name="{SERVED[0]}"}}'
            body = (
                "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                f"vllm:prefix_cache_queries_total{labels} {PREFIX_COUNTS['queries']}\n"
                f"vllm:prefix_cache_hits_total{labels} {PREFIX_COUNTS['hits']}\n"
            ).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/v1/models":
            # Like vLLM: the served model name (``--served-model-name``), the model path otherwise.
            # Unhealthy (``health`` error) it answers 503 here too; ``hang`` hangs only /health.
            names = [SERVED[0], *(LORAS or {})]
            listed = {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "fake"} for name in names]}
            self._json(503 if STATE["health"] == "error" else 200, listed)
        elif self.path == "/_env":
            self._json(200, {"names": sorted(os.environ)})
        elif self.path == "/_stats":
            with LOCK:
                active = {tag: n for tag, n in ACTIVE.items() if n}
                self._json(200, {"requests": STATE["requests"], "paths": STATE["paths"], "models": STATE["models"],
                                 "users": STATE["users"], "active": active, "warm_ups": WARM_UPS,
                                 "loras": sorted(LORAS or {})})  # fmt: skip
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        if not self._authorized():
            return
        if self.path == "/_control":
            with LOCK:
                if body.pop("prefix_cache_clear", False):
                    PREFIX_BLOCKS.clear()
                    PREFIX_COUNTS.update(queries=0, hits=0)
                STATE.update(body)
                if "seed" in body:
                    RNG.seed(body["seed"])
            self._json(200, STATE)
            return
        if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            self._adapters(body)
            return
        if self.headers.get("x-platform-warm-up"):  # the supervisor's, before routing: not counted as a request
            with LOCK:
                WARM_UPS.append(self.path)
            self._json(200, {"id": "warm-up", "object": "text_completion", "model": body.get("model"),
                             "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})  # fmt: skip
            return
        model = body.get("model")
        if LORAS is not None and model not in (SERVED[0], *LORAS):  # vLLM's answer to a model it does not serve
            self._json(404, {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                                       "param": "model", "code": 404}})  # fmt: skip
            return
        with LOCK:
            STATE["requests"] += 1
            STATE["paths"].append(self.path)
            STATE["models"].append(body.get("model"))
            STATE["users"].append(body.get("user"))
            mode, tokens, delay, die_after = STATE["mode"], STATE["tokens"], STATE["delay"], STATE["die_after"]
            fail = RNG.random() < float(STATE["fail_rate"])
            latency = float(STATE["latency"])
        self._active_as = f"{'stream' if body.get('stream') else 'json'}:{body.get('user') or ''}"
        self._counted = False
        if not body.get("stream"):
            self._count_active()
        try:
            self._answer(body, mode, tokens, delay, die_after, fail, latency)
        finally:
            if self._counted:
                with LOCK:
                    ACTIVE[self._active_as] -= 1

    def _adapters(self, body: dict[str, Any]) -> None:
        """vLLM's runtime LoRA routes (only with ``--enable-lora``)."""
        if LORAS is None:
            self._json(404, {"detail": "Not Found"})
            return
        name = str(body.get("lora_name") or "")
        with LOCK:
            if self.path == "/v1/unload_lora_adapter":
                if LORAS.pop(name, None) is None:
                    self._json(404, {"error": {"message": f"The lora adapter '{name}' cannot be found.",
                                               "type": "NotFoundError", "code": 404}})  # fmt: skip
                    return
                self._json(200, f"Success: LoRA adapter '{name}' removed successfully.")
                return
            if name in LORAS:
                self._json(400, {"error": {"message": f"The lora adapter '{name}' has already been loaded.",
                                           "type": "InvalidUserInput", "code": 400}})  # fmt: skip
                return
            path = str(body.get("lora_path") or "")
            if not name or not os.path.isfile(os.path.join(path, "adapter_config.json")):
                self._json(400, {"error": {"message": f"No adapter found for {path}", "type": "BadRequestError",
                                           "code": 400}})  # fmt: skip
                return
            LORAS[name] = path
        self._json(200, f"Success: LoRA adapter '{name}' added successfully.")

    def _count_active(self) -> None:
        with LOCK:
            ACTIVE[self._active_as] = ACTIVE.get(self._active_as, 0) + 1
        self._counted = True

    def _answer(
        self, body: Any, mode: str, tokens: Any, delay: Any, die_after: Any, fail: bool, latency: float
    ) -> None:
        """Answer a /v1 request as ``mode`` says (the values are STATE's, as /_control set them)."""
        if mode == "reset":
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if mode == "error400":
            self._json(400, {"object": "error", "message": "fake engine refuses", "type": "BadRequestError",
                             "param": None, "code": 400})  # fmt: skip
            return
        if mode == "error500" or fail:
            self._json(500, {"object": "error", "message": "fake engine broke", "type": "InternalServerError"})
            return
        if latency:
            time.sleep(latency)
        if self.path == "/v1/embeddings":
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            data = [{"index": i, "object": "embedding", "embedding": embed(str(text))} for i, text in enumerate(inputs)]
            self._json(200, {"id": "embd-x", "object": "list", "model": body["model"], "data": data,
                             "usage": {"prompt_tokens": 3, "total_tokens": 3}})  # fmt: skip
            return
        chat = self.path == "/v1/chat/completions"
        prompt, cached = prefix_usage(prompt_text(self.path, body)) if STATE["prefix_cache"] else (3, 0)
        details = {"prompt_tokens_details": {"cached_tokens": cached}} if STATE["prefix_cache"] else {}
        word = body["model"] if body["model"] in (LORAS or {}) else "tok"
        if not body.get("stream"):
            if mode == "hang":
                time.sleep(3600)
            message = {"role": "assistant", "content": f"{word} " * tokens} if chat else None
            choice = {
                "index": 0,
                "finish_reason": "length",
                **({"message": message} if chat else {"text": f"{word} " * tokens}),
            }
            usage = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens, **details}
            kind = "chat.completion" if chat else "text_completion"
            self._json(
                200, {"id": "engine-id", "object": kind, "model": body["model"], "choices": [choice], "usage": usage}
            )
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        if mode == "hang":
            time.sleep(3600)
            return
        engine_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            for i in range(tokens):
                if mode == "die" and i == die_after:
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                if mode == "bad_event" and i == die_after:
                    self._chunk(b"data: [1, 2, 3]\n\n")
                piece = f"t{i} " if word == "tok" else f"{word}{i} "
                delta = {"content": piece} if chat else None
                choice = {"index": 0, "finish_reason": None, **({"delta": delta} if chat else {"text": piece})}
                chunk = {
                    "id": engine_id,
                    "object": "chat.completion.chunk",
                    "model": body["model"],
                    "choices": [choice],
                }
                chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": i + 1, "total_tokens": prompt + i + 1,
                                  **details}  # fmt: skip
                self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
                if not self._counted:
                    self._count_active()  # mid-stream from now on
                time.sleep(delay)
            usage = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens, **details}
            final = {
                "id": engine_id,
                "object": "chat.completion.chunk",
                "model": body["model"],
                "choices": [],
                "usage": usage,
            }
            self._chunk(f"data: {json.dumps(final)}\n\n".encode())
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            return

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def embed(text: str, dimensions: int = 384) -> list[float]:
    """A deterministic unit vector: hashed bag of lowercased words (texts sharing most of
    their words are very similar, as a real embedding model would rate a one-word change)."""
    vector = [0.0] * dimensions
    for word in "".join(c if c.isalnum() else " " for c in text.lower()).split():
        vector[int(hashlib.sha256(word.encode()).hexdigest(), 16) % dimensions] += 1.0
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # the default 5 refuses connections under a burst of requests


def serve(port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    return Server((host, port), Handler)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    # Accepted and ignored so the supervisor can launch this with vLLM's arguments.
    parser.add_argument("--model")
    parser.add_argument("--served-model-name")
    parser.add_argument("--api-key", action="append", default=[])
    parser.add_argument("--enable-lora", action="store_true")
    args, _unknown = parser.parse_known_args()
    global LORAS
    LORAS = {} if args.enable_lora else None
    # vLLM's precedence: --api-key wins over VLLM_API_KEY.
    API_KEYS.extend(key for key in args.api_key or [os.environ.get("VLLM_API_KEY", "")] if key)
    SERVED[0] = args.served_model_name or args.model or SERVED[0]
    signal.signal(signal.SIGTERM, _on_sigterm)
    serve(args.port, args.host).serve_forever()


def _on_sigterm(signum: int, _frame: object) -> None:
    # Only the main thread may install a signal disposition, and /_control runs in a
    # request thread: this handler, installed at start, reads the flag instead.
    if STATE["ignore_sigterm"]:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
