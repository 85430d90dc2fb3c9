"""Real platform processes for end-to-end tests: gateways (the server `make run` uses,
``console.servers``) on the test database."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from django.conf import settings
from django.db import connection

from console.servers import server_command

BASE_DIR = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_database_url() -> str:
    """The URL of the database pytest-django created, for child processes."""
    db = connection.settings_dict
    user = db.get("USER") or "postgres"
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    return f"postgresql://{user}{password}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DATABASE_URL": test_database_url(),
            "TEST_REDIS_URL": settings.REDIS_URL,
            "ARTIFACT_ROOT": str(settings.ARTIFACT_STORE["OPTIONS"]["root"]),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra)
    return env


@dataclass
class Gateway:
    """One gateway process (uvicorn, or daphne with ASGI_SERVER=daphne) serving the whole ASGI app."""

    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    base_url: str = field(init=False)

    def __post_init__(self) -> None:
        self.base_url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def start_gateway(log_dir: Path, *, processes: int | None = None, **env: str) -> Gateway:
    """A gateway (``console.servers``) on a free port, healthy; ``processes``: uvicorn's."""
    port = free_port()
    log_path = log_dir / f"gateway-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            server_command(sys.executable, host="127.0.0.1", port=port, processes=processes),
            cwd=BASE_DIR,
            env=child_env(**env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    gateway = Gateway(port=port, process=process, log_path=log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.returncode}:\n{gateway.log()}")
        try:
            if httpx.get(f"{gateway.base_url}/healthz", timeout=1).status_code == 200:
                return gateway
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    gateway.stop()
    raise RuntimeError(f"the gateway did not become healthy in 60 s:\n{gateway.log()}")
