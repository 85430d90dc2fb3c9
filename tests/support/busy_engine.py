"""The fake engine (tests/support/fake_engine.py) with vLLM's load gauges on /metrics.

``vllm:num_requests_running`` is the number of /v1 requests it is answering (a stream
counts until its last chunk), so a supervisor's drain waits for in-flight streams as it
does with vLLM; ``vllm:num_requests_waiting`` is whatever ``POST /_control {"waiting": N}``
set (0 at first), so the autoscaler sees a queue.

Run as ``python -m tests.support.busy_engine --port N`` (a supervisor's
WORKER_ENGINE_LAUNCHER); ``--fake-tokens`` and ``--fake-delay`` set how long streams are
from the start (through ENGINE_EXTRA_ARGS: a supervisor's engines all start the same way).
"""

from __future__ import annotations

import argparse
import threading

from tests.support import fake_engine

_lock = threading.Lock()
_answering = 0


class BusyHandler(fake_engine.Handler):
    def do_GET(self) -> None:
        if self.path != "/metrics":
            super().do_GET()
            return
        with _lock:
            running = _answering
        waiting = float(fake_engine.STATE.get("waiting", 0))
        body = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="fake"}} {float(running)}\n'
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="fake"}} {waiting}\n'
        ).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        global _answering
        counted = self.path.startswith("/v1")
        if counted:
            with _lock:
                _answering += 1
        try:
            super().do_POST()
        finally:
            if counted:
                with _lock:
                    _answering -= 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fake-tokens", type=int)
    parser.add_argument("--fake-delay", type=float)
    args, _rest = parser.parse_known_args()
    if args.fake_tokens is not None:
        fake_engine.STATE["tokens"] = args.fake_tokens
    if args.fake_delay is not None:
        fake_engine.STATE["delay"] = args.fake_delay
    fake_engine.Handler = BusyHandler  # type: ignore[misc]  # serve() builds its server with this name
    fake_engine.main()


if __name__ == "__main__":
    main()
