"""haproxy (Debian's) in front of gateways, as a platform team runs it: HTTP and WebSocket,
health checks on ``/readyz``, a server taken out after three failed connections in a row, and its
runtime API on a Unix socket (``state``: each server's UP/DOWN, sessions and checks).

The configuration is ``config()``: docs/scale-out.md shows the same file."""

from __future__ import annotations

import contextlib
import csv
import io
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.processes import start_process, stop_process

# How often each gateway's /readyz is checked, how many failed checks in a row take it out
# and how many passed bring it back, and how long a check may take. A gateway that refuses
# connections (killed) is taken out at once by its traffic ("observe layer4"), not by checks;
# checks take out a gateway that is alive but not ready (draining, cut off from Redis or
# PostgreSQL). One failed check is not enough: on a saturated host /readyz can be slow.
CHECK_INTERVAL_MS = 1000
FALL = 2
RISE = 2
CHECK_TIMEOUT_MS = 2000


def unavailable() -> str | None:
    if shutil.which("haproxy") is None:
        return "haproxy is not installed (Debian: haproxy; .ci/run installs it)"
    return None


def config(*, bind: str, servers: dict[str, str], stats_socket: Path) -> str:
    """haproxy's configuration: ``servers`` is {name: "address:port"}."""
    every = f"{CHECK_INTERVAL_MS}ms"
    lines = [
        "global",
        f"    stats socket {stats_socket} mode 600 level admin",
        "    maxconn 4096",
        "defaults",
        "    mode http",
        # Connections to the gateways are kept alive and reused (haproxy's default): one per
        # request would run out of source ports under load (TIME_WAIT).
        "    http-reuse safe",
        "    timeout connect 2s",
        "    timeout client 120s",
        "    timeout server 120s",
        # A WebSocket (an upgraded connection) is a tunnel: the same idle limit as a request.
        "    timeout tunnel 120s",
        f"    timeout check {CHECK_TIMEOUT_MS}ms",
        # A request whose connection to a gateway was refused goes to another: it never reached
        # a gateway, so nothing was admitted or metered. A GET (a WebSocket's handshake, a
        # read) whose gateway closed without an answer is sent again too; any other request
        # that reached a gateway is never retried: it may have been admitted.
        "    retries 2",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response",
        "frontend api",
        f"    bind {bind}",
        # In production the balancer terminates TLS (bind :443 ssl crt …) and says so; the
        # gateways trust it (TRUST_PROXY_HEADERS) and redirect no request. Here the test's
        # clients speak plain HTTP to haproxy, which says the same.
        "    http-request set-header X-Forwarded-Proto https",
        "    default_backend gateways",
        "backend gateways",
        "    http-request disable-l7-retry unless METH_GET",
        "    balance roundrobin",
        "    option httpchk",
        "    http-check send meth GET uri /readyz ver HTTP/1.1 hdr Host localhost",
        "    http-check expect status 200",
        f"    default-server inter {every} fastinter {every} downinter {every} fall {FALL} rise {RISE}"
        " observe layer4 error-limit 3 on-error mark-down",
    ]
    lines += [f"    server {name} {address} check" for name, address in servers.items()]
    return "\n".join(lines) + "\n"


@dataclass
class Balancer:
    directory: Path
    bind_host: str
    port: int
    servers: dict[str, str]
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.bind_host}:{self.port}"

    @property
    def stats_socket(self) -> Path:
        return self.directory / "haproxy.sock"

    def start(self) -> Balancer:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "haproxy.cfg"
        path.write_text(config(bind=f"{self.bind_host}:{self.port}", servers=self.servers,
                               stats_socket=self.stats_socket))  # fmt: skip
        check = subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy refused its configuration:\n{check.stdout}{check.stderr}")
        with open(self.directory / "haproxy.log", "wb") as log:
            self.process = start_process(["haproxy", "-db", "-f", str(path)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, httpx.HTTPError):
                if self.state():
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"haproxy did not start: {(self.directory / 'haproxy.log').read_text()}")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, grace=5)

    def command(self, line: str) -> str:
        """One command of haproxy's runtime API."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.stats_socket))
            sock.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def state(self) -> dict[str, dict[str, Any]]:
        """{server: its row of ``show stat``} (status "UP"/"DOWN", stot: sessions so far …)."""
        text = self.command("show stat").lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return {row["svname"]: row for row in rows if row["pxname"] == "gateways" and row["svname"] in self.servers}

    def status(self, server: str) -> str:
        return str(self.state()[server]["status"])

    def sessions(self) -> dict[str, int]:
        return {name: int(row["stot"] or 0) for name, row in self.state().items()}
