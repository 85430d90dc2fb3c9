"""The gateway's server command (console.servers): GATEWAY_PROCESSES runs several uvicorn
processes on one port (console.gateway), each serving the API with its own ledger identity
and its own listening socket."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from console.servers import server_command
from tests.support.processes import start_gateway

pytestmark = pytest.mark.django_db


def test_the_command_asks_for_its_processes(settings):
    one = server_command("python", host="127.0.0.1", port=1)
    assert one[:3] == ["python", "-m", "uvicorn"]
    assert "--no-access-log" in one
    assert "--backlog" in one
    settings.GATEWAY_PROCESSES = 3
    command = server_command("python", host="127.0.0.1", port=1)
    assert command[:3] == ["python", "-m", "console.gateway"]
    assert command[command.index("--processes") + 1] == "3"
    assert "--processes" not in server_command("python", host="127.0.0.1", port=1, server="daphne")


def _serving(root: psutil.Process) -> list[psutil.Process]:
    """The gateway's serving processes (a dead one, not yet reaped, is not one)."""
    found = []
    for child in root.children():
        try:
            if "--one" in child.cmdline():
                found.append(child)
        except psutil.Error:
            continue
    return found


def test_two_processes_serve_one_port_and_stop_together(tmp_path, api_key):
    gateway = start_gateway(tmp_path, processes=2)
    try:
        root = psutil.Process(gateway.process.pid)
        deadline = time.monotonic() + 30
        while len(serving := _serving(root)) < 2:
            assert time.monotonic() < deadline, [p.cmdline() for p in root.children()]
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {api_key.secret}"}
        clients = [httpx.Client(base_url=gateway.base_url, headers=headers, timeout=10) for _ in range(20)]
        try:
            # Twenty connections, kept open: the kernel spreads them over the processes' own
            # sockets (all twenty on one of two: a chance of one in half a million).
            assert all(c.get("/v1/models").status_code == 200 for c in clients)
            port = int(gateway.base_url.rsplit(":", 1)[1])
            held = [
                sum(1 for c in p.net_connections("tcp") if c.laddr.port == port and c.status == "ESTABLISHED")
                for p in serving
            ]
            assert sum(held) == 20, held
            assert min(held) > 0, held
        finally:
            for c in clients:
                c.close()
        # A process that dies is started again; the port keeps answering meanwhile.
        serving[0].kill()
        deadline = time.monotonic() + 30
        while len(again := [p for p in _serving(root) if p.pid != serving[0].pid]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert httpx.get(f"{gateway.base_url}/healthz", timeout=10).status_code == 200
        serving = again
    finally:
        gateway.stop()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in serving)
