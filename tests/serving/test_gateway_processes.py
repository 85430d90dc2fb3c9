"""The gateway's server command (console.servers): GATEWAY_PROCESSES runs several uvicorn
processes on one port, each serving the API with its own ledger identity."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from console.servers import server_command
from tests.processes import start_gateway

pytestmark = pytest.mark.django_db


def test_the_command_asks_uvicorn_for_its_processes(settings):
    assert "--workers" not in server_command("python", host="127.0.0.1", port=1)
    settings.GATEWAY_PROCESSES = 3
    command = server_command("python", host="127.0.0.1", port=1)
    assert command[command.index("--workers") + 1] == "3"
    assert "--workers" not in server_command("python", host="127.0.0.1", port=1, server="daphne")


def test_two_processes_serve_one_port_and_stop_together(tmp_path, api_key):
    gateway = start_gateway(tmp_path, processes=2)
    try:
        root = psutil.Process(gateway.process.pid)
        deadline = time.monotonic() + 30
        while len(serving := [p for p in root.children() if "spawn" in " ".join(p.cmdline())]) < 2:
            assert time.monotonic() < deadline, [p.cmdline() for p in root.children()]
            time.sleep(0.2)
        with httpx.Client(base_url=gateway.base_url, timeout=10) as client:
            # New connections are spread over the processes by the kernel; every one answers.
            answers = [
                httpx.get(f"{gateway.base_url}/v1/models", headers={"Authorization": f"Bearer {api_key.secret}"})
                for _ in range(20)
            ]
            assert client.get("/healthz").status_code == 200
        assert all(a.status_code == 200 for a in answers)
    finally:
        gateway.stop()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in serving)
