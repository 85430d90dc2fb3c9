"""Run the whole platform on this machine: the ASGI server (console.servers), Celery and runworkers.

What ``make run`` ends with. It waits until /readyz says every default model has a
ready replica, prints where everything is, and on Ctrl-C (or SIGTERM) stops the
processes in order, letting runworkers drain its engines. A process that exits on its
own is restarted (after 1, 2, 4 … up to 30 s) while the others keep running.

It starts nothing when the platform already runs here (``claim_platform``): a second
``make run`` beside the first would start a second supervisor of the same host and a second
gateway on a taken port, and wipe the first one's metrics.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from argparse import ArgumentParser
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, InterfaceError
from django.utils import timezone
from prometheus_client import multiprocess

from console.servers import server_command
from core.embedded import VAR_DIR
from registry.selectors import host_lease_held


def celery_commands(python: str, *, beat_schedule: Path) -> dict[str, list[str]]:
    """The Celery processes: one worker per queue of ``settings.CELERY_TASK_QUEUES`` (one task
    at a time each, so that a slow task only ever waits in front of its own queue) and the
    beat on its own, each restarted without the others."""
    worker = [python, "-m", "celery", "-A", "console", "worker", "--concurrency", "1", "--loglevel", "WARNING",
              # Nothing here revokes tasks by hand or reads the cluster's events: no start-up
              # sync with the other workers, no broadcasts between them.
              "--without-mingle", "--without-gossip"]  # fmt: skip
    commands = {
        f"celery-{queue.name}": [*worker, "--queues", queue.name, "--hostname", f"{queue.name}@%h"]
        for queue in settings.CELERY_TASK_QUEUES
    }
    commands["beat"] = [python, "-m", "celery", "-A", "console", "beat", "--loglevel", "WARNING",
                        "--schedule", str(beat_schedule)]  # fmt: skip
    return commands


class AlreadyRunning(Exception):
    """The platform (or something in its place) already runs here; the message says what."""


def claim_platform(*, lock_path: Path, host: str, port: int, worker_host: str) -> IO[str]:
    """Make sure this is the only platform here before anything starts, or raise AlreadyRunning.

    Three checks: the lock of this checkout's runplatform (``flock`` on ``lock_path``; the
    kernel drops it when its holder ends, even by SIGKILL); the lease of ``worker_host`` (a
    supervisor of this host runs on this database: a runplatform's child that outlived it,
    or a runworkers started by hand); and the port (taken by our own gateway, or by anything
    else). Returns the lock's file: keep it open while the platform runs.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = open(lock_path, "a+")  # noqa: SIM115  held open until this process ends
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise AlreadyRunning(
            f"runplatform pid {holder} serves this checkout (it holds {lock_path}); stop it (Ctrl-C) first"
        ) from None
    try:
        _check_host_and_port(host=host, port=port, worker_host=worker_host)
    except AlreadyRunning:
        lock.close()
        raise
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _check_host_and_port(*, host: str, port: int, worker_host: str) -> None:
    try:
        lease = host_lease_held(host=worker_host)
    except (DatabaseError, InterfaceError):
        lease = None  # no database yet: its children say so; runworkers still checks the lease
    if lease is not None:
        until = timezone.localtime(lease.expires_at).strftime("%H:%M:%S")
        raise AlreadyRunning(
            f"the engines of host {worker_host} are supervised by pid {lease.holder_pid} on "
            f"{lease.holder_machine} (lease until {until}); stop that platform or runworkers first, "
            "or set WORKER_HOST"
        )
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no obstacle
        try:
            probe.bind((host, port))
            return
        except OSError:
            pass
    ours = False
    with contextlib.suppress(httpx.HTTPError):
        ours = httpx.get(f"http://{host}:{port}/healthz", timeout=2).status_code == 200
    if ours:
        raise AlreadyRunning(f"a gateway already answers at http://{host}:{port}; stop that platform first")
    raise AlreadyRunning(f"port {port} on {host} is taken by another program; choose another one (make run PORT=…)")


@dataclass
class Child:
    name: str
    command: list[str]
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    restart_at: float | None = None  # exited: when to start it again

    @property
    def log_name(self) -> str:
        return f"{self.name}.log"


class ChildProcesses:
    """The platform's processes on this machine, each restarted with backoff when it exits.

    One that dies (a crash, the database gone at its start) is started again while the
    others keep serving; only ``stop()`` ends them, in the order given.
    """

    def __init__(
        self,
        commands: dict[str, list[str]],
        *,
        cwd: Path,
        env: dict[str, str],
        log_dir: Path,
        report: Callable[[str], None],
        on_exit: Callable[[int], None] = lambda pid: None,
        first_backoff: float = 1.0,
        max_backoff: float = 30.0,
        stable_after: float = 60.0,
    ) -> None:
        self.children = {name: Child(name, command) for name, command in commands.items()}
        self.cwd, self.env, self.log_dir, self.report, self.on_exit = cwd, env, log_dir, report, on_exit
        self.first_backoff, self.max_backoff, self.stable_after = first_backoff, max_backoff, stable_after
        self.stopping = False

    def start(self) -> None:
        for child in self.children.values():
            self._start(child)
            self.report(f"started {child.name:15s} pid {self._pid(child):<7d} log {self.log_dir / child.log_name}")

    def _start(self, child: Child) -> None:
        # The child holds its own copy of the log's descriptor; ours closes at once.
        with open(self.log_dir / child.log_name, "ab") as log:
            child.popen = subprocess.Popen(
                child.command, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        child.started_at = time.monotonic()
        child.restart_at = None

    @staticmethod
    def _pid(child: Child) -> int:
        return child.popen.pid if child.popen is not None else 0

    def watch(self) -> None:
        """Restart the children that exited, once their backoff has passed. Call it every second or so."""
        if self.stopping:
            return
        now = time.monotonic()
        for child in self.children.values():
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._start(child)
                    self.report(f"restarted {child.name} (pid {self._pid(child)}, restart {child.restarts})")
                continue
            assert child.popen is not None
            code = child.popen.poll()
            if code is None:
                if child.restarts and now - child.started_at > self.stable_after:
                    child.restarts = 0  # stable again: the next crash restarts quickly
                continue
            self.on_exit(child.popen.pid)
            delay = min(self.max_backoff, self.first_backoff * 2**child.restarts)
            child.restarts += 1
            child.restart_at = now + delay
            self.report(
                f"{child.name} exited with code {code}; restarting in {delay:.0f} s "
                f"(log: {self.log_dir / child.log_name})"
            )

    def stop(self, order: Sequence[str], timeout: float) -> None:
        """SIGTERM each child in ``order``, waiting up to ``timeout`` for each (runworkers drains)."""
        self.stopping = True
        for name in order:
            process = self.children[name].popen
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


class Command(BaseCommand):
    help = "Run the ASGI server, Celery (a worker per queue, and beat) and the engine supervisor until interrupted."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--ready-timeout", type=float, default=900.0)

    def handle(self, *args: Any, **options: Any) -> None:
        host, port = options["host"], options["port"]
        base = f"http://{host}:{port}"
        try:
            # Before anything is touched: the metrics folder below belongs to a running platform.
            # Held (open) as long as this command runs.
            self.platform_lock = claim_platform(
                lock_path=VAR_DIR / "runplatform.lock", host=host, port=port, worker_host=settings.WORKER_HOST
            )
        except AlreadyRunning as exc:
            raise CommandError(f"already running: {exc}") from None
        metrics_dir = VAR_DIR / "prometheus"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        log_dir = VAR_DIR / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir), PYTHONUNBUFFERED="1")
        python = sys.executable
        celery = celery_commands(python, beat_schedule=VAR_DIR / "celerybeat-schedule")
        commands = {
            "engines": [python, "manage.py", "runworkers"],
            **celery,
            "web": server_command(python, host=host, port=port),
            "grpc": [python, "manage.py", "rungrpc", "--host", host, "--port", str(settings.GRPC_PORT)],
        }
        # The beat before the workers: no tick is queued for a worker on its way out.
        stop_order = ("web", "grpc", "beat", *(name for name in celery if name != "beat"), "engines")

        def report(message: str) -> None:
            self.stdout.write(message)
            self.stdout.flush()

        def forget_metrics(pid: int) -> None:
            # A dead process's live gauges (requests in flight) must not count in /metrics.
            multiprocess.mark_process_dead(pid, str(metrics_dir))  # type: ignore[no-untyped-call]

        children = ChildProcesses(
            commands, cwd=Path(settings.BASE_DIR), env=env, log_dir=log_dir, report=report, on_exit=forget_metrics
        )
        interrupted = False

        def on_signal(signum: int, _frame: object) -> None:
            # Only a flag: the loop below stops the children in order.
            nonlocal interrupted
            interrupted = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

        def stop() -> None:
            self.stdout.write(f"\nstopping: {', '.join(stop_order[:-1])}, then engines (draining)…")
            children.stop(stop_order, timeout=settings.WORKER_DRAIN_TIMEOUT + 30)
            self.stdout.write("stopped. (PostgreSQL and Redis keep running: `make stop` stops them.)")

        children.start()
        self.stdout.write(f"waiting for {base}/readyz (engines take ~1 min to load)…")
        deadline = time.monotonic() + options["ready_timeout"]
        last: str = ""
        while not interrupted:
            children.watch()
            try:
                response = httpx.get(f"{base}/readyz", timeout=5)
                if response.status_code == 200:
                    break
                last = json.dumps(response.json().get("checks", {}))
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            if time.monotonic() > deadline:
                stop()
                raise CommandError(f"not ready after {options['ready_timeout']:.0f} s: {last}")
            time.sleep(2)
        if not interrupted:
            self._announce(base)
        while not interrupted:
            children.watch()
            time.sleep(1)
        stop()

    def _announce(self, base: str) -> None:
        credentials_path = Path(os.environ.get("BOOTSTRAP_CREDENTIALS", VAR_DIR / "bootstrap.json"))
        credentials = json.loads(credentials_path.read_text()) if credentials_path.exists() else {}
        key = credentials.get("demo_key", "(run manage.py create_api_key)")
        self.stdout.write(self.style.SUCCESS("\nThe inference platform is up."))
        self.stdout.write(f"  console   {base}/   login {credentials.get('admin_username', 'admin')} / "
                          f"{credentials.get('admin_password', '(see PLATFORM_ADMIN_PASSWORD)')}")  # fmt: skip
        self.stdout.write(f"  admin     {base}/admin/")
        self.stdout.write(f"  API       {base}/v1   (OpenAI-compatible; WebSocket at {base.replace('http', 'ws')}"
                          "/ws/v1/chat/completions)")  # fmt: skip
        self.stdout.write(f"  v2 / gRPC {base}/v2 and {base.split('://')[1].rsplit(':', 1)[0]}:{settings.GRPC_PORT}"
                          "   (Open Inference Protocol: tritonclient, KServe; small models)")  # fmt: skip
        self.stdout.write(f"  demo key  {key}")
        self.stdout.write(f"  metrics   {base}/metrics")
        self.stdout.write("  try:")
        self.stdout.write(f"    curl {base}/v1/chat/completions -H 'Authorization: Bearer {key}' \\")
        body = json.dumps(
            {
                "model": "smollm2-135m-instruct",
                "messages": [{"role": "user", "content": "What is the capital of Japan?"}],
            }
        )
        self.stdout.write(f"      -H 'Content-Type: application/json' -d '{body}'")
        self.stdout.write("Ctrl-C stops it.")
