"""Several gateway processes on one port: ``python -m console.gateway --processes N``.

Each process opens its own listening socket on the port with ``SO_REUSEPORT``, so the kernel
hands each new connection to one of them by a hash of its addresses: connections spread
evenly whichever process is busiest (with one shared socket, as uvicorn's ``--workers``
has, the process that wakes first takes them). This parent only starts the processes,
starts again one that dies, and on SIGTERM or SIGINT stops them all and waits for them
(each finishes its requests in flight, as one uvicorn does). ``console.servers`` builds the
command; one process runs uvicorn directly.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import FrameType

logger = logging.getLogger("console.gateway")

RESTART_DELAY_SECONDS = 1.0
# A process that ends this soon after its start, EARLY_ENDS times in a row, will not start
# (the port taken, a bad setting): the gateway ends instead of starting it for ever.
EARLY_END_SECONDS = 5.0
EARLY_ENDS = 3


def listening_socket(host: str, port: int, *, shared: bool = True) -> socket.socket:
    """The process's socket; ``shared``: one of several on the port (a lone gateway's bind
    fails on a port taken, as uvicorn's does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def serve_one(host: str, port: int, *, shared: bool = True) -> None:
    """One gateway process: uvicorn on its own socket of the shared port. Asked to stop, it
    first drains for ``GATEWAY_DRAIN_SECONDS``: /readyz answers 503 while it still serves, so
    a balancer's health checks take it out before its socket closes."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import uvicorn
    from django.conf import settings

    from console.servers import uvicorn_options

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            from core.lifecycle import draining, start_draining

            drain = float(settings.GATEWAY_DRAIN_SECONDS)
            if drain <= 0 or draining():  # nothing to wait for, or a second signal: stop now
                super().handle_exit(sig, frame)
                return
            start_draining()
            logger.info("draining: /readyz fails for %.1f s, then the gateway stops", drain)

            def stop() -> None:
                if not self.should_exit:  # a second signal stopped it meanwhile
                    super(DrainingServer, self).handle_exit(sig, frame)

            timer = threading.Timer(drain, stop)
            timer.daemon = True
            timer.start()

    config = uvicorn.Config("console.asgi:application", **uvicorn_options())  # type: ignore[arg-type]
    DrainingServer(config).run(sockets=[listening_socket(host, port, shared=shared)])


def supervise(host: str, port: int, processes: int) -> int:
    command = [sys.executable, "-m", "console.gateway", "--host", host, "--port", str(port), "--one", "--shared"]
    children: list[subprocess.Popen[bytes]] = [subprocess.Popen(command) for _ in range(processes)]
    started = [time.monotonic()] * processes
    early = [0] * processes
    stopping = False
    failed = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping:
        for i, child in enumerate(children):
            code = child.poll()
            if code is None or stopping:
                continue
            early[i] = early[i] + 1 if time.monotonic() - started[i] < EARLY_END_SECONDS else 0
            if early[i] >= EARLY_ENDS:
                logger.error("gateway process %s ended (%s) as it started, %d times; stopping the gateway",
                             child.pid, code, EARLY_ENDS)  # fmt: skip
                failed = True
                stop(signal.SIGTERM, None)
                break
            logger.error("gateway process %s ended (%s); starting another", child.pid, code)
            time.sleep(RESTART_DELAY_SECONDS)
            children[i], started[i] = subprocess.Popen(command), time.monotonic()
        time.sleep(0.2)
    for child in children:
        child.wait()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--one", action="store_true", help="be one process, serving the port alone")
    parser.add_argument("--shared", action="store_true", help="with --one: one of several (the parent starts them)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.one:
        serve_one(args.host, args.port, shared=args.shared)
        return 0
    return supervise(args.host, args.port, max(1, args.processes))


if __name__ == "__main__":
    sys.exit(main())
