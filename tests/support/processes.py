"""Real platform processes for end-to-end tests: gateways (the server `make run` uses,
``console.servers``) and engine supervisors (``runworkers``) on the test database; and the
supervisors an earlier, killed test run left behind, found and stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
from django.conf import settings
from django.db import connection

from console.servers import server_command

BASE_DIR = Path(__file__).resolve().parents[2]


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


def start_runworkers(args: list[str], *, env: dict[str, str], stdout: IO[bytes] | int) -> subprocess.Popen[bytes]:
    """``manage.py runworkers`` with ``args`` (stderr with stdout), bound to this test run: it
    gets SIGTERM (drains, gives its host's lease up) when the run ends, even killed with
    SIGKILL before its teardown (``tests.support.parent_bound``). Call from the main thread."""
    command = [sys.executable, "-m", "tests.support.parent_bound", str(os.getpid()),
               sys.executable, "manage.py", "runworkers", *args]  # fmt: skip
    return subprocess.Popen(command, cwd=BASE_DIR, env=env, stdout=stdout, stderr=subprocess.STDOUT)


def _processes() -> Iterator[tuple[int, list[bytes], dict[bytes, bytes]]]:
    """(pid, command line, environment) of every process of this checkout (its working folder)
    that this user may read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(entry / "cwd") != str(BASE_DIR):
                continue
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            variables = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        yield int(entry.name), cmdline, dict(v.split(b"=", 1) for v in variables if b"=" in v)


def process_ended(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped yet (a stranger's, which is not ours to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def stop_leftover_supervisors(*, session: str, database: str, timeout: float = 30.0) -> list[int]:
    """Stop what an earlier test run of this checkout and ``TEST_SESSION`` left running (it was
    killed before its teardown, and before ``tests.support.parent_bound`` existed): its ``runworkers``
    (SIGTERM, so it drains and gives its host's lease up; SIGKILL after ``timeout``), then any
    engine marked with the test ``database``. Call before this run starts any. Their pids."""
    from serving.supervisor.host import DATABASE_MARKER

    supervisors = [
        pid
        for pid, cmdline, env in _processes()
        if b"runworkers" in cmdline
        and env.get(b"DJANGO_SETTINGS_MODULE") == b"tests.settings"
        and (env.get(b"TEST_SESSION") or b"0").decode() == session
    ]
    for pid in supervisors:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while not all(process_ended(pid) for pid in supervisors) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in supervisors:
        if not process_ended(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    engines = [pid for pid, _, env in _processes() if env.get(DATABASE_MARKER.encode()) == database.encode()]
    for pid in engines:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    return supervisors + engines


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
