"""The command that serves ``console.asgi:application``: one place for `make run`, the tests and the benchmarks.

``ASGI_SERVER=uvicorn`` (the default) runs uvicorn with uvloop and httptools: against the
same mock engine it costs about a fifth less CPU per request than daphne and its p99 at
concurrency 1 is ten times lower (docs/performance.md, ``bench/mock_suite.py``).
WebSockets (Channels) run on its ``websockets`` implementation, pinged every 20 s.
``ASGI_SERVER=daphne`` keeps the previous server.

Proxy headers are never taken from the server: the platform decides whether to trust
them (``TRUST_PROXY_HEADERS``). Graceful shutdown waits for requests in flight up to
``ASGI_GRACEFUL_SHUTDOWN_SECONDS``, after ``GATEWAY_DRAIN_SECONDS`` of failing /readyz
(``console.gateway``) when a balancer is in front. ``GATEWAY_PROCESSES`` (uvicorn only) runs that many
processes on the one port, each a gateway of its own (its own router state and ledger
identity, as gateways on several hosts are): one Python process tops out near one core.
They are started by ``console.gateway``, each with its own listening socket, so that the
kernel spreads connections evenly over them (uvicorn's ``--workers`` shares one socket,
and the process that wakes first can take most of the connections a client opens at once:
measured, 0.75 vs 0.07 of a core between two of them).
"""

from __future__ import annotations

import os

from django.conf import settings

SERVERS = ("uvicorn", "daphne")


def server_command(
    python: str, *, host: str, port: int, server: str | None = None, processes: int | None = None
) -> list[str]:
    server = server or os.environ.get("ASGI_SERVER", "uvicorn")
    if server == "daphne":
        return [python, "-m", "daphne", "-b", host, "-p", str(port), "console.asgi:application"]
    if server != "uvicorn":
        raise ValueError(f"ASGI_SERVER must be one of {', '.join(SERVERS)}, not {server!r}")
    processes = processes or settings.GATEWAY_PROCESSES
    if processes > 1:
        return [python, "-m", "console.gateway", "--host", host, "--port", str(port), "--processes", str(processes)]
    if settings.GATEWAY_DRAIN_SECONDS > 0:  # uvicorn's command line has no drain: one process of ours
        return [python, "-m", "console.gateway", "--host", host, "--port", str(port), "--one"]
    flags: list[str] = []
    for name, value in uvicorn_options().items():
        flag = "--" + name.replace("_", "-")
        flags += [flag.replace("--", "--no-", 1)] if value is False else [flag, str(value)]
    return [python, "-m", "uvicorn", "console.asgi:application", "--host", host, "--port", str(port), *flags]


def uvicorn_options() -> dict[str, str | int | bool]:
    """How uvicorn serves the gateway (its ``Config``'s names), in one process or several."""
    return {
        "loop": "uvloop",
        "http": "httptools",
        "ws": "websockets",
        "lifespan": "off",
        "access_log": False,
        "proxy_headers": False,
        "server_header": False,
        "backlog": 4096,
        # A WebSocket frame over the API's body limit gets an error frame from the consumer;
        # one far over it is not even buffered: the server closes the socket (1009).
        "ws_max_size": settings.API_MAX_BODY_BYTES + 1024 * 1024,
        "timeout_graceful_shutdown": int(os.environ.get("ASGI_GRACEFUL_SHUTDOWN_SECONDS", "30")),
    }
