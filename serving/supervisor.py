"""The per-host worker supervisor behind ``manage.py runworkers``.

It keeps this host's share of every serving deployment running as vLLM OpenAI server
processes, one per replica, each pinned to a slot (a CPU core, or a GPU):

- claims a replica when a deployment wants more and a slot is free, starts the engine,
  waits for /health, then marks the replica ready with its endpoint;
- heart-beats ready replicas after checking /health (routers ignore stale heartbeats);
- restarts a crashed or unhealthy replica with exponential backoff;
- drains a replica that is no longer wanted (no new requests are routed to it; in-flight
  ones finish or the drain timeout passes), then stops it;
- on SIGTERM/SIGINT drains and stops everything it started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from registry.artifacts import get_artifact_store
from registry.models import Deployment, Replica
from registry.selectors import serving_deployments
from registry.services import (
    IllegalTransition,
    replica_claim,
    replica_mark_ready,
    replica_release_host,
    replica_surplus,
    replica_transition,
)
from serving.routing import served_context_length

logger = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class EngineProcess:
    """One replica's engine process, as this supervisor sees it."""

    replica_id: int
    deployment_id: int
    slot: str
    port: int = 0
    popen: subprocess.Popen[bytes] | None = None
    phase: str = "starting"  # starting | ready | draining | backoff
    started_at: float = 0.0
    ready_at: float = 0.0
    last_check: float = 0.0
    failed_checks: int = 0
    restarts: int = 0
    restart_at: float = 0.0
    drain_deadline: float = 0.0
    log_path: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{settings.WORKER_ENGINE_HOST}:{self.port}"

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def engine_command(deployment: Deployment, port: int) -> list[str]:
    version = deployment.version
    model = version.model
    path = get_artifact_store().local_path(version.artifact_uri)
    launcher = shlex.split(settings.WORKER_ENGINE_LAUNCHER) or [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    command = [
        *launcher,
        "--model", str(path),
        "--served-model-name", model.name,
        "--host", settings.WORKER_ENGINE_HOST,
        "--port", str(port),
        "--max-model-len", str(served_context_length(version.config)),
        "--uvicorn-log-level", "warning",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if model.task == "embedding":
        command += ["--runner", "pooling"]
    if settings.WORKER_DEVICE == "cpu":
        # Eager mode starts in ~35 s instead of ~3 min and serves about as fast on CPU.
        command += ["--enforce-eager"]
    else:
        command += ["--gpu-memory-utilization", str(settings.VLLM_GPU_MEMORY_UTILIZATION)]
    return command + shlex.split(settings.ENGINE_EXTRA_ARGS)


def engine_env(slot: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    if settings.WORKER_DEVICE == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.VLLM_CPU_KVCACHE_SPACE)
        env["VLLM_CPU_OMP_THREADS_BIND"] = slot
    else:
        env["CUDA_VISIBLE_DEVICES"] = slot
    return env


@dataclass
class Supervisor:
    host: str = field(default_factory=lambda: settings.WORKER_HOST)
    slots: list[str] = field(default_factory=lambda: list(settings.WORKER_SLOTS))
    log_dir: Path = field(default_factory=lambda: Path(settings.WORKER_LOG_DIR))
    engines: dict[int, EngineProcess] = field(default_factory=dict)  # by replica id
    stopping: bool = False
    stop_announced: bool = False
    report: Callable[[str], None] = field(default=lambda message: logger.info(message))
    _http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=2.0))

    # --- lifecycle ------------------------------------------------------------------

    def run(self, *, once: bool = False) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._kill_orphans()
        released = replica_release_host(host=self.host)
        if released:
            self.report(f"released {released} replica(s) left on {self.host} by an earlier supervisor")
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        self.report(f"supervising engines on {self.host} (slots {', '.join(self.slots)})")
        try:
            while True:
                close_old_connections()
                if self.stopping:
                    if self._shutdown_step():
                        break
                else:
                    self.step()
                if once:
                    break
                time.sleep(0.5)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.report("all engines stopped")

    def _kill_orphans(self) -> None:
        """Engines an earlier supervisor of this host started and left running (it was killed)."""
        recorded = Replica.objects.filter(host=self.host, pid__isnull=False).exclude(state=Replica.State.STOPPED)
        for pid in recorded.values_list("pid", flat=True):
            if pid is None:
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue  # gone already
            if b"--served-model-name" in cmdline:  # ours: never kill a reused pid's stranger
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                self.report(f"killed engine pid {pid} left by an earlier supervisor")

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Only flags: the loop does the work. A handler that touched the database could
        # re-enter a query the main thread is in the middle of.
        if self.stopping:  # a second signal: stop now
            for engine in self.engines.values():
                if engine.popen is not None and engine.popen.poll() is None:
                    os.killpg(engine.popen.pid, signal.SIGKILL)
            raise SystemExit(1)
        self.stopping = True

    def step(self) -> None:
        now = time.monotonic()
        self._claim_wanted()
        for engine in list(self.engines.values()):
            self._tend(engine, now)

    def _shutdown_step(self) -> bool:
        if not self.stop_announced:
            self.stop_announced = True
            self.report("stopping: draining all replicas")
        now = time.monotonic()
        for engine in list(self.engines.values()):
            if engine.phase != "draining":
                self._begin_drain(engine)
            self._tend(engine, now)
        return not self.engines

    # --- claiming and surplus ---------------------------------------------------------

    def _free_slots(self) -> list[str]:
        used = {engine.slot for engine in self.engines.values()}
        return [slot for slot in self.slots if slot not in used]

    def _claim_wanted(self) -> None:
        deployments = list(serving_deployments())
        wanted_ids = {d.id for d in deployments}
        for engine in list(self.engines.values()):
            if engine.deployment_id not in wanted_ids and engine.phase != "draining":
                self._begin_drain(engine)
        for deployment in deployments:
            mine = [e for e in self.engines.values() if e.deployment_id == deployment.id and e.phase != "draining"]
            if mine and replica_surplus(deployment=deployment) > 0:
                self._begin_drain(max(mine, key=lambda e: e.replica_id))
                continue
            free = self._free_slots()
            if not free:
                continue
            replica = replica_claim(deployment=deployment, host=self.host)
            if replica is not None:
                engine = EngineProcess(replica_id=replica.id, deployment_id=deployment.id, slot=free[0])
                self.engines[replica.id] = engine
                self._spawn(engine, deployment)

    # --- one engine ---------------------------------------------------------------------

    def _spawn(self, engine: EngineProcess, deployment: Deployment | None = None) -> None:
        if deployment is None:
            deployment = Deployment.objects.select_related("version__model").get(pk=engine.deployment_id)
        engine.port = _free_port(settings.WORKER_ENGINE_HOST)
        engine.log_path = self.log_dir / f"replica-{engine.replica_id}.log"
        command = engine_command(deployment, engine.port)
        with open(engine.log_path, "ab") as log:
            log.write(f"\n=== {timezone.now().isoformat()} starting: {shlex.join(command)}\n".encode())
            log.flush()
            engine.popen = subprocess.Popen(
                command, env=engine_env(engine.slot), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        engine.phase = "starting"
        engine.started_at = time.monotonic()
        engine.failed_checks = 0
        Replica.objects.filter(pk=engine.replica_id).update(pid=engine.popen.pid)
        self.report(
            f"replica {engine.replica_id} ({deployment.version}) starting on slot {engine.slot}, "
            f"port {engine.port}, pid {engine.popen.pid}"
        )

    def _healthy(self, engine: EngineProcess) -> bool:
        try:
            return self._http.get(f"{engine.endpoint}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _tend(self, engine: EngineProcess, now: float) -> None:
        if engine.phase == "backoff":
            if not self.stopping and now >= engine.restart_at:
                replica = Replica.objects.get(pk=engine.replica_id)
                if replica_surplus(deployment=replica.deployment) > 0 or replica.deployment.status not in (
                    Deployment.Status.PENDING,
                    Deployment.Status.RUNNING,
                ):
                    self._retire(engine)
                    return
                replica_transition(replica=replica, state=Replica.State.STARTING)
                self._spawn(engine)
            elif self.stopping:
                self._retire(engine)
            return
        if not engine.alive():
            if engine.phase == "draining":
                self._retire(engine)
            else:
                code = engine.popen.returncode if engine.popen else None
                self._fail(engine, f"engine exited with code {code}")
            return
        if engine.phase == "starting":
            if self._healthy(engine):
                replica = Replica.objects.get(pk=engine.replica_id)
                assert engine.popen is not None
                replica_mark_ready(replica=replica, endpoint=engine.endpoint, pid=engine.popen.pid)
                engine.phase = "ready"
                engine.ready_at = engine.last_check = now
                self.report(
                    f"replica {engine.replica_id} ready at {engine.endpoint} after {now - engine.started_at:.0f} s"
                )
            elif now - engine.started_at > settings.WORKER_STARTUP_TIMEOUT:
                self._kill(engine)
                self._fail(engine, f"not healthy within {settings.WORKER_STARTUP_TIMEOUT:.0f} s")
            return
        if engine.phase == "ready" and now - engine.last_check >= settings.WORKER_HEARTBEAT_SECONDS:
            engine.last_check = now
            if self._healthy(engine):
                engine.failed_checks = 0
                Replica.objects.filter(pk=engine.replica_id).update(last_heartbeat=timezone.now())
                if now - engine.ready_at > 60:
                    engine.restarts = 0  # stable again: the next crash restarts quickly
            else:
                engine.failed_checks += 1
                if engine.failed_checks >= 3:
                    self._kill(engine)
                    self._fail(engine, "/health failed 3 times")
            return
        if engine.phase == "draining" and (now >= engine.drain_deadline or self._idle(engine)):
            self._terminate(engine)

    def _idle(self, engine: EngineProcess) -> bool:
        """No request running or waiting in the engine (from vLLM's own metrics)."""
        try:
            text = self._http.get(f"{engine.endpoint}/metrics").text
        except httpx.HTTPError:
            return True
        busy = 0.0
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                busy += float(line.rsplit(" ", 1)[-1])
        return busy == 0

    def _begin_drain(self, engine: EngineProcess) -> None:
        if engine.phase == "draining":
            return
        if engine.phase == "backoff":
            self._retire(engine)
            return
        try:
            replica = Replica.objects.get(pk=engine.replica_id)
            if replica.state == Replica.State.STARTING:
                replica_transition(replica=replica, state=Replica.State.STOPPED)
                self._kill(engine)
                self.engines.pop(engine.replica_id, None)
                self.report(f"replica {engine.replica_id} stopped before it was ready")
                return
            replica_transition(replica=replica, state=Replica.State.DRAINING)
        except IllegalTransition as exc:
            logger.warning("drain of replica %s: %s", engine.replica_id, exc)
        engine.phase = "draining"
        engine.drain_deadline = time.monotonic() + settings.WORKER_DRAIN_TIMEOUT
        self.report(f"replica {engine.replica_id} draining (up to {settings.WORKER_DRAIN_TIMEOUT:.0f} s)")

    def _terminate(self, engine: EngineProcess) -> None:
        if engine.alive():
            assert engine.popen is not None
            os.killpg(engine.popen.pid, signal.SIGTERM)
            try:
                engine.popen.wait(15)
            except subprocess.TimeoutExpired:
                self._kill(engine)
        self._retire(engine)

    def _kill(self, engine: EngineProcess) -> None:
        if engine.popen is not None and engine.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine.popen.pid, signal.SIGKILL)
            engine.popen.wait(10)

    def _retire(self, engine: EngineProcess) -> None:
        """The replica is gone for good from this host."""
        replica = Replica.objects.filter(pk=engine.replica_id).first()
        if replica is not None and replica.state != Replica.State.STOPPED:
            if replica.state in (Replica.State.STARTING, Replica.State.READY):
                replica_transition(replica=replica, state=Replica.State.FAILED)
            replica_transition(replica=replica, state=Replica.State.STOPPED)
        self.engines.pop(engine.replica_id, None)
        self.report(f"replica {engine.replica_id} stopped")

    def _fail(self, engine: EngineProcess, reason: str) -> None:
        replica = Replica.objects.get(pk=engine.replica_id)
        if replica.state in (Replica.State.STARTING, Replica.State.READY, Replica.State.DRAINING):
            replica_transition(replica=replica, state=Replica.State.FAILED)
        delay = min(settings.WORKER_MAX_BACKOFF, 2.0**engine.restarts)
        engine.restarts += 1
        engine.phase = "backoff"
        engine.restart_at = time.monotonic() + delay
        self.report(
            f"replica {engine.replica_id} failed ({reason}); restarting in {delay:.0f} s (log: {engine.log_path})"
        )
