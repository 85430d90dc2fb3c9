"""The predict worker: one replica of a small model, run with ONNX Runtime behind the dynamic
batcher, answering the Open Inference Protocol over HTTP.

The supervisor (``manage.py runworkers``) starts it like a vLLM engine: one process per
replica, on a slot, with the replica's key in its environment (``WORKER_API_KEY``), and
watches it the same way (``/health`` for readiness and heartbeats, ``/metrics`` for drain).
It needs no database, no Redis and no Django: the version's config (signature, batcher,
labels) comes on its command line.

Routes (all but ``/health`` require ``Authorization: Bearer <replica key>``):

- ``GET /health``: 200 once the model is loaded and the batcher runs;
- ``POST /v2/models/{name}[/versions/{v}]/infer``: JSON or Triton's binary tensors in and
  out (``serving.gateway.inference_protocol``); a bad tensor is a 400 naming it, a full queue a 429,
  a request that waited past its deadline a 504, a failed batch a 500 (its requests only);
- ``POST /internal/infer-many``: several such requests in one call, each answered as if sent
  alone, as soon as it is ready (``serving.gateway.inference_protocol.MANY_PATH``: how a gateway sends
  the predictions that wait for this replica together);
- ``GET /v2/models/{name}``: the signature; ``GET /stats``: what the batcher formed (batch
  sizes, why each went, queue depth, refusals) for the console; ``GET /metrics``: Prometheus
  text (``predict:num_requests_running`` and ``…_waiting``, which the supervisor's drain reads).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson

from registry.batching import BatcherConfig
from registry.signatures import Signature, TextInput, onnx_file, torchscript_file
from serving.gateway.inference_protocol import (
    HEADER_LENGTH,
    MANY_PATH,
    BadRequest,
    BadTensor,
    Part,
    answer_frame,
    decode_inputs,
    encode_response,
    read_body,
    requested_outputs,
    unpack_many,
)
from serving.predict.batcher import BatchTooLarge, DynamicBatcher, QueueFull, RequestTimedOut
from serving.predict.runner import OnnxRunner, TorchScriptRunner

logger = logging.getLogger("serving.predict.worker")

KEY_ENV = "WORKER_API_KEY"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class Worker:
    def __init__(
        self,
        *,
        name: str,
        version: str,
        artifact: Path,
        config: dict[str, Any],
        threads: int,
        framework: str = "onnx",
        device: str = "cpu",
    ) -> None:
        self.name = name
        self.version = version
        self.framework = framework
        self.signature = Signature.from_json(config["signature"])
        self.batcher_config = BatcherConfig.from_json(config.get("batcher"))
        # Each instance runs its batches on the slot's threads; instances share them.
        self.runner: OnnxRunner | TorchScriptRunner
        if framework == "torchscript":
            self.runner = TorchScriptRunner(torchscript_file(artifact), self.signature, threads=threads, device=device)
        else:
            text = TextInput.from_json(config.get("tokenizer"))
            self.runner = OnnxRunner(onnx_file(artifact), self.signature, threads=threads, text=text, device=device)
        if self.runner.device != device:
            logger.warning("%s:%s asked for %s; runs on %s (not available here)", name, version, device,
                           self.runner.device)  # fmt: skip
        self.batcher = DynamicBatcher(self.runner.run_batch, self.batcher_config)
        self.key = os.environ.get(KEY_ENV, "")
        self.running = 0
        self.requests = 0
        self.failed = 0
        self.ready = False

    # --- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if path == "/health":
            await _respond(send, 200 if self.ready else 503, b"{}")
            return
        if method == "GET" and path == "/metrics":  # open, as vLLM's is: Prometheus scrapes it keyless
            await _respond(send, 200, self.metrics().encode(), content_type=b"text/plain; version=0.0.4")
            return
        headers = {k.decode("latin1").lower(): v.decode("latin1") for k, v in scope["headers"]}
        if not self._authorized(headers.get("authorization")):
            await _respond_part(send, _error(401, "The replica's API key is required.", "invalid_api_key"))
            return
        body = await _read(receive)
        if method == "POST" and path.startswith("/v2/models/") and path.endswith("/infer"):
            await _respond_part(send, await self._answer(body, headers.get(HEADER_LENGTH)))
        elif method == "POST" and path == MANY_PATH:
            await self._answer_many(send, body)
        elif method == "GET" and path.startswith("/v2/models/"):
            await _respond(send, 200, orjson.dumps(self.metadata()))
        elif method == "GET" and path == "/stats":
            await _respond(send, 200, orjson.dumps(self.stats()))
        else:
            await _respond_part(send, _error(404, f"No route {method} {path}.", "unknown_url"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.batcher.start()
                self.ready = True
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.ready = False
                await self.batcher.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _authorized(self, authorization: str | None) -> bool:
        if not self.key:
            return True  # started by hand without a key (a benchmark's direct run)
        given = (authorization or "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self.key.encode())

    # --- inference -----------------------------------------------------------------------

    async def _answer(self, body: bytes, header_length: str | None) -> Part:
        """One inference request's answer: its tensors run in whatever batch forms."""
        self.requests += 1
        try:
            request = read_body(body, header_length)
            arrays, rows = decode_inputs(self.signature, request.get("inputs"))
            wanted = requested_outputs(self.signature, request)
        except (BadTensor, BadRequest) as exc:
            return _error(400, str(exc), "invalid_tensor", param=getattr(exc, "tensor", None))
        self.running += 1
        try:
            outputs = await self.batcher.submit(arrays, rows)
        except QueueFull as exc:
            return _error(429, str(exc), "model_queue_full")
        except BatchTooLarge as exc:
            return _error(400, str(exc), "batch_too_large")
        except RequestTimedOut as exc:
            return _error(504, str(exc), "model_timeout")
        except Exception as exc:
            self.failed += 1
            logger.exception("batch failed")
            return _error(500, f"The model failed: {exc}", "model_error")
        finally:
            self.running -= 1
        answer, length = encode_response(
            self.signature, outputs, wanted, model_name=self.name, model_version=self.version,
            request_id=request.get("id") if isinstance(request.get("id"), str) else None,
        )  # fmt: skip
        return Part(200, None if length is None else str(length), answer)

    async def _answer_many(self, send: Send, body: bytes) -> None:
        try:
            parts = unpack_many(body)
        except BadRequest as exc:
            await _respond_part(send, _error(400, str(exc), "invalid_request"))
            return
        # Every part is in the batcher's queue before it forms a batch (the tasks start in
        # order, before the batcher wakes); each answer goes out when its batch is done.
        waiting = {asyncio.ensure_future(self._answer(p.body, p.header_length)): i for i, p in enumerate(parts)}
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/octet-stream")]})  # fmt: skip
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                frames = b"".join(answer_frame(waiting.pop(task), task.result()) for task in done)
                await send({"type": "http.response.body", "body": frames, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            for task in waiting:
                task.cancel()

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": "pytorch_libtorch" if self.framework == "torchscript" else "onnxruntime_onnx",
            "inputs": [s.as_json() for s in self.signature.inputs],
            "outputs": [s.as_json() for s in self.signature.outputs],
        }

    def stats(self) -> dict[str, Any]:
        stats = self.batcher.stats
        return {
            "batcher": self.batcher_config.as_json(),
            "device": self.runner.device,
            "batch_sizes": {str(size): count for size, count in sorted(stats.batch_sizes.items())},
            "reasons": dict(stats.reasons),
            "queue_rows": self.batcher.queue_rows,
            "running": self.running,
            "requests": self.requests,
            "refused": stats.refused,
            "timed_out": stats.timed_out,
            "failed": self.failed,
        }

    def metrics(self) -> str:
        stats = self.batcher.stats
        lines = [
            f"predict:num_requests_running {self.running}",
            f"predict:num_requests_waiting {self.batcher.queue_rows}",
            f"predict:requests_total {self.requests}",
            f"predict:refused_total {stats.refused}",
            f"predict:timed_out_total {stats.timed_out}",
        ]
        lines += [
            f'predict:batches_total{{size="{size}"}} {count}' for size, count in sorted(stats.batch_sizes.items())
        ]
        return "\n".join(lines) + "\n"


async def _read(receive: Receive) -> bytes:
    parts: list[bytes] = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    *,
    content_type: bytes = b"application/json",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _respond_part(send: Send, part: Part) -> None:
    if part.header_length is None:
        await _respond(send, part.status, part.body)
    else:
        extra = [(HEADER_LENGTH.encode(), part.header_length.encode())]
        await _respond(send, part.status, part.body, content_type=b"application/octet-stream", extra=extra)


def _error(status: int, message: str, code: str, *, param: str | None = None) -> Part:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return Part(status, None, orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="the model's public name")
    parser.add_argument("--version", required=True)
    parser.add_argument("--artifact", required=True, type=Path, help="the .onnx file, or a folder with model.onnx")
    parser.add_argument("--config", required=True, help="the version's config, JSON (signature, batcher, labels)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1, help="the runtime's threads (the slot's cores)")
    parser.add_argument("--framework", default="onnx", choices=["onnx", "torchscript"])
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the slot's GPU (torch; onnxruntime-gpu)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    worker = Worker(
        name=args.name, version=args.version, artifact=args.artifact, config=orjson.loads(args.config),
        threads=args.threads, framework=args.framework, device=args.device,
    )  # fmt: skip
    config = uvicorn.Config(
        worker, host=args.host, port=args.port, loop="uvloop", http="httptools", lifespan="on",
        log_level="warning", access_log=False,
    )  # fmt: skip
    server = uvicorn.Server(config)
    logger.info("serving %s:%s on %s:%s (%s)", args.name, args.version, args.host, args.port, worker.runner.device)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        await server.serve()

    import uvloop

    uvloop.run(serve())


if __name__ == "__main__":
    main()
