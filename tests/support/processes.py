"""The processes tests start, and how: ``start_process`` for every long-lived one (each in a
process group of its own, bound to the test run, so that a run killed with SIGKILL leaves none
behind; ``stop_process`` ends its whole group); real platform processes on the test database:
gateways (the server `make run` uses, ``console.servers``) and engine supervisors
(``runworkers``); and the supervisors an earlier, killed test run left behind, found and stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
from django.conf import settings
from django.db import connection

from console.servers import server_command
from tests.support.parent_bound import start_time

BASE_DIR = Path(__file__).resolve().parents[2]
PARENT_BOUND = str(Path(__file__).with_name("parent_bound.py"))

# --- Processes bound to the test run --------------------------------------------------------------

_reaper: subprocess.Popen[str] | None = None
_reaper_lock = threading.Lock()
_started: dict[int, str | None] = {}  # pid -> its start time, to tell it from a later process of the same pid


def _tell_reaper(line: str) -> None:
    """Send the run's reaper (``tests/support/parent_bound.py --reaper``) one line, starting it
    first if needed. It is a session of its own (a Ctrl-C in the terminal leaves it to do its
    work), and holds none of the run's output open (a ``pytest | tee`` ends with the run)."""
    global _reaper
    with _reaper_lock:
        if _reaper is None or _reaper.poll() is not None:
            _reaper = subprocess.Popen(
                [sys.executable, PARENT_BOUND, "--reaper", str(os.getpid())], stdin=subprocess.PIPE, text=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        assert _reaper.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            _reaper.stdin.write(line + "\n")
            _reaper.stdin.flush()


def start_process(
    command: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | str = BASE_DIR,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
    stdin: IO[Any] | int | None = subprocess.DEVNULL,
    text: bool = False,
    grace: float = 10.0,
) -> subprocess.Popen[Any]:
    """Start ``command``: every long-lived process a test starts goes through here.

    The child leads a process group (a session) of its own, so ``stop_process`` ends it with
    whatever it started in that group. It is bound to this test run twice over: started from
    the main thread, it gets SIGTERM as soon as the run ends, however it ends, even by SIGKILL
    (``tests/support/parent_bound.py``: the parent-death signal, set before ``exec``, so the pid
    is the command's); and the run's reaper, which sees the run end when its pipe closes, sends
    the whole group SIGTERM, waits up to ``grace`` seconds (long enough for a ``runworkers`` to
    drain), then SIGKILL. The ``Popen`` is the command itself: ``pid``, signals, ``wait``.
    """
    bound = [sys.executable, PARENT_BOUND, str(os.getpid()), *command]
    in_main_thread = threading.current_thread() is threading.main_thread()
    process = subprocess.Popen(
        bound if in_main_thread else command, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
        text=text, start_new_session=True,
    )  # fmt: skip
    _started[process.pid] = start_time(process.pid)
    _tell_reaper(f"+{process.pid} {grace} {_started[process.pid]}")
    return process


def stop_process(process: subprocess.Popen[Any], *, grace: float = 10.0) -> int | None:
    """End the process's whole group: SIGTERM, up to ``grace`` seconds for the process to end,
    then SIGKILL to every process left in the group (``grace=0``: SIGKILL at once). Its exit
    status (None if even SIGKILL did not end it within 5 s)."""
    now = start_time(process.pid)
    if now is not None and now != _started.get(process.pid, now):  # it ended long ago; the pid is another's
        _tell_reaper(f"-{process.pid}")
        _started.pop(process.pid, None)
        return process.returncode
    if grace > 0:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
    _tell_reaper(f"-{process.pid}")
    _started.pop(process.pid, None)
    return process.returncode


# --- Platform processes --------------------------------------------------------------------------


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
    """``manage.py runworkers`` with ``args`` (stderr with stdout), bound to this test run
    (``start_process``): it gets SIGTERM (drains, gives its host's lease up) when the run ends,
    even killed with SIGKILL before its teardown, and 60 s to drain before SIGKILL. Call from
    the main thread."""
    command = [sys.executable, "manage.py", "runworkers", *args]
    return start_process(command, env=env, stdout=stdout, stderr=subprocess.STDOUT, grace=60)


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
    killed before its teardown, and before its processes were bound to it: ``start_process``): its ``runworkers``
    (SIGTERM, so it drains and gives its host's lease up; SIGKILL after ``timeout``), then any
    engine marked with the test ``database``. Call before this run starts any. Their pids."""
    from serving.supervisor.engines import DATABASE_MARKER

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
        stop_process(self.process)


def start_gateway(log_dir: Path, *, processes: int | None = None, **env: str) -> Gateway:
    """A gateway (``console.servers``) on a free port, healthy; ``processes``: uvicorn's."""
    port = free_port()
    log_path = log_dir / f"gateway-{port}.log"
    with open(log_path, "wb") as log:
        process = start_process(
            server_command(sys.executable, host="127.0.0.1", port=port, processes=processes),
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
