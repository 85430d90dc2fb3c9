"""An engine process as the supervisor sees it (``EngineProcess``: its phase, deadlines and
probe), the environment it starts with (an allow-list, its key, the markers that let a later
supervisor find it in /proc without the database), and the probes run beside the loop: health
and idle, by the replica's engine kind (``serving.gateway.engine_kinds``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path

import httpx
from django.conf import settings
from django.db import connections

from registry.models import Replica
from registry.replica_keys import replica_api_key
from registry.upstreams import UpstreamTarget
from serving.gateway.engine_kinds import VLLM, EngineKind

# Every engine process carries these in its environment, so a supervisor finds the engines
# of its host in /proc without the database: one that crashed between starting an engine
# and recording its pid leaves nothing the next one cannot find.
HOST_MARKER = "PLATFORM_WORKER_HOST"
DATABASE_MARKER = "PLATFORM_WORKER_DATABASE"
REPLICA_MARKER = "PLATFORM_REPLICA_ID"


# What an engine inherits from the supervisor's environment; nothing else (no
# PROMETHEUS_MULTIPROC_DIR, which would mix its metrics into the gateway's, no
# DATABASE_URL, SECRET_KEY, REDIS_URL or any other platform variable).
ENGINE_ENV_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TMPDIR", "TZ", "PYTHONPATH", "PYTHONUNBUFFERED",
     "LD_LIBRARY_PATH", "LD_PRELOAD", "XDG_CACHE_HOME"}
)  # fmt: skip


# LD_PRELOAD: vLLM's CPU guide preloads tcmalloc / libiomp. OPENBLAS_/NVPL_ tune the math
# libraries like OMP_/MKL_ do (some CPUs need OPENBLAS_CORETYPE); the torch, triton and
# NCCL families tune kernels and caches on GPU hosts.
ENGINE_ENV_PREFIXES = (
    "LC_", "HF_", "TRANSFORMERS_", "VLLM_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "NVPL_", "CUDA_", "NVIDIA_",
    "NCCL_", "TORCH_", "TORCHINDUCTOR_", "TRITON_",
)  # fmt: skip


# Never inherited though allow-listed: it opens vLLM's debug routes (/collective_rpc,
# /sleep, …), which its API key does not guard.
ENGINE_ENV_DENIED = frozenset({"VLLM_SERVER_DEV_MODE"})


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class EngineProcess:
    """One replica's engine process, as this supervisor sees it."""

    replica_id: int
    deployment_id: int
    slot: str
    model: str = ""  # the public name and version, for logs and metrics
    kind: EngineKind = VLLM  # what runs: its command line, probes and busy metrics
    artifact: str = ""  # its version's artifact URI (held on this host while the engine is ours)
    version: str = ""
    version_id: int = 0
    max_adapters: int = 0  # LoRA adapters it runs in a batch (its deployment's); 0: none (supervisor.adapters)
    port: int = 0
    popen: subprocess.Popen[bytes] | None = None
    # starting | ready | draining | stopping (SIGTERM sent) | backoff (waiting to restart)
    # | stopped (process gone, its row still to be recorded)
    phase: str = "starting"
    started_at: float = 0.0
    ready_at: float = 0.0
    load_seconds: float = 0.0  # started_at → first good /health, of the latest start
    last_check: float = 0.0
    failed_checks: int = 0
    restarts: int = 0
    restart_at: float = 0.0
    drain_deadline: float = 0.0
    term_deadline: float = 0.0
    kill_sent: bool = False
    log_path: Path | None = None
    # The replica row's state this engine calls for, and whether the row has it yet (with
    # the pid and endpoint that go with it).
    want: str = Replica.State.STARTING
    recorded: bool = False
    row_gone: bool = False  # deleted (or stopped) under us: stop the engine, write nothing
    beat_due: bool = False  # /health answered since the last heartbeat written
    probe: tuple[str, Future[bool]] | None = None  # ("health" | "warm" | "idle", result)
    # Draining for a restart asked for: once the process has exited it is started again.
    restart_requested: bool = False
    # A kind with no process (an external upstream): where it is, and whether this supervisor
    # holds it now (from its start until it is stopped or failed: what "alive" means for it).
    upstream: UpstreamTarget | None = None
    attached: bool = False

    def start_probe(self, kind: str, pool: Executor, http: httpx.Client) -> None:
        """Run a probe of this kind ("health", "warm", "idle") in ``pool``, beside the loop."""
        if kind == "health":
            probe = pool.submit(healthy, http, self.endpoint, self.kind, self.upstream)
        elif kind == "warm":
            probe = pool.submit(warm_up, http, self.endpoint, self.kind, self.model, self.replica_id)
        else:
            probe = pool.submit(idle, http, self.endpoint, self.kind)
        self.probe = (kind, probe)

    def probe_result(self, kind: str) -> bool | None:
        """The answer of its finished probe of this kind; None while none has finished."""
        if self.probe is None or not self.probe[1].done():
            return None
        probe_kind, future = self.probe
        self.probe = None
        if probe_kind != kind:  # asked for before the engine changed phase: stale
            return None
        return bool(future.result())

    @property
    def endpoint(self) -> str:
        if self.upstream is not None:
            return self.upstream.url
        return f"http://{settings.WORKER_ENGINE_HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def alive(self) -> bool:
        if not self.kind.runs_process:
            return self.attached
        return self.popen is not None and self.popen.poll() is None

    def starting(self) -> None:
        """Started now (a process spawned, or an upstream attached): health-checked from here."""
        self.phase = "starting"
        self.started_at = time.monotonic()
        self.failed_checks = 0
        self.restart_requested = False
        self.kill_sent = False
        self.probe = None
        self.want, self.recorded = Replica.State.STARTING, False

    def end(self, sig: int) -> None:
        """Signal the engine's process group (``signal_group``); a replica with no process is
        let go at once, whatever the signal."""
        self.attached = False
        signal_group(self.pid, sig)


def database_name() -> str:
    return str(connections["default"].settings_dict.get("NAME") or "")


def engine_env(slot: str, *, replica_id: int, host: str) -> dict[str, str]:
    """The whole environment of one replica's engine: an allow-list of ours, plus its own settings."""
    env = {
        name: value
        for name, value in os.environ.items()
        if (name in ENGINE_ENV_NAMES or name.startswith(ENGINE_ENV_PREFIXES)) and name not in ENGINE_ENV_DENIED
    }
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (behind its API key, like every
    # /v1 route): how the supervisor puts adapters into a running engine (supervisor.adapters).
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    # vLLM reads its --api-key from here: in the environment it is readable only by this
    # user, where the command line is world-readable (ps).
    env["VLLM_API_KEY"] = env["WORKER_API_KEY"] = replica_api_key(replica_id)
    if settings.WORKER_DEVICE == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.VLLM_CPU_KVCACHE_SPACE)
        env["VLLM_CPU_OMP_THREADS_BIND"] = slot
    else:
        env["CUDA_VISIBLE_DEVICES"] = slot
    env[HOST_MARKER] = host
    env[DATABASE_MARKER] = database_name()
    env[REPLICA_MARKER] = str(replica_id)
    return env


def marked_engines(host: str, database: str) -> Iterator[tuple[int, str]]:
    """(pid, replica id) of every process whose environment marks it as an engine of this host.

    The database is part of the mark: two platforms (or two test runs) that share a machine
    and a host name never touch each other's engines.
    """
    with contextlib.suppress(OSError):  # no /proc: nothing to find
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                variables = (entry / "environ").read_bytes().split(b"\0")
            except OSError:  # gone, or another user's
                continue
            if f"{HOST_MARKER}={host}".encode() in variables and f"{DATABASE_MARKER}={database}".encode() in variables:
                prefix = f"{REPLICA_MARKER}=".encode()
                replica = next((v[len(prefix) :].decode() for v in variables if v.startswith(prefix)), "?")
                yield int(entry.name), replica


def signal_group(pid: int | None, sig: int) -> None:
    """Signal an engine's whole process group (vLLM runs its engine core in child processes).

    Safe after the leader was reaped: Linux never reuses a pid while a process group of
    that number still has members.
    """
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)


def healthy(http: httpx.Client, endpoint: str, kind: EngineKind, upstream: UpstreamTarget | None = None) -> bool:
    """The replica answers its health probe. Runs in a probe thread: touches neither the
    engine's state nor the database. An external upstream is asked with its key, and is
    healthy only when its model list has the model it serves for us (a wrong key, URL or
    name never looks ready)."""
    try:
        response = http.get(f"{endpoint}{kind.health_path}", headers=upstream.auth_headers if upstream else None)
    except httpx.HTTPError:
        return False
    if response.status_code != 200:
        return False
    if upstream is None:
        return True
    try:
        listed = response.json().get("data")
        return any(isinstance(m, dict) and m.get("id") == upstream.served_model for m in listed)
    except (ValueError, AttributeError, TypeError):
        return False


# Marks the warm-up request (a test's fake engine leaves it out of what it counts).
WARM_UP_HEADER = "X-Platform-Warm-Up"
WARM_UP_TIMEOUT = 60.0


def warm_up(http: httpx.Client, endpoint: str, kind: EngineKind, model: str, replica_id: int) -> bool:
    """One small request through a healthy replica before it is routed (``EngineKind.warm_up``),
    with its key: True when one was answered. Runs in a probe thread."""
    headers = {"Authorization": f"Bearer {replica_api_key(replica_id)}", WARM_UP_HEADER: "1"}
    for path, body in kind.warm_up:
        try:
            response = http.post(
                f"{endpoint}{path}", json={"model": model, **body}, headers=headers, timeout=WARM_UP_TIMEOUT
            )
        except httpx.HTTPError:
            return False
        if response.status_code == 200:
            return True
        if response.status_code not in (400, 404):
            return False
    return False


def idle(http: httpx.Client, endpoint: str, kind: EngineKind) -> bool:
    """No request running or waiting in the replica (from its own metrics). Runs in a probe thread.
    A kind without busy metrics (an external upstream) is idle at once: stopping it stops nothing."""
    if not kind.busy_metrics:
        return True
    try:
        text = http.get(f"{endpoint}{kind.metrics_path}").text
    except httpx.HTTPError:
        return True
    busy = 0.0
    for line in text.splitlines():
        if line.startswith(kind.busy_metrics):
            with contextlib.suppress(ValueError):
                busy += float(line.rsplit(" ", 1)[-1])
    return busy == 0


def row_route(current: str, target: str) -> list[str] | None:
    """The states a row passes through from ``current`` to ``target`` (legal moves only).

    Through ``failed`` where no direct move exists (ready → stopped, ready → starting), or
    through ``starting`` (failed → ready, when an engine restarted and became ready while
    the database was away). None: no such route.
    """
    if current == target:
        return []
    moves = Replica.TRANSITIONS
    if target in moves.get(current, frozenset()):
        return [target]
    for via in (Replica.State.FAILED, Replica.State.STARTING):
        if via in moves.get(current, frozenset()) and target in moves.get(via, frozenset()):
            return [via, target]
    return None


def free_slots(kind: EngineKind, engines: Iterable[EngineProcess], slots: list[str]) -> list[str]:
    """Slots of ``slots`` a new replica of ``kind`` may take beside ``engines`` (``EngineKind.slot_use``):
    a vLLM engine needs one no other vLLM engine holds; a predict worker shares a slot with up
    to WORKER_PREDICT_PER_SLOT - 1 others (and with a vLLM engine), least shared first; an
    external upstream takes none (its one "slot" is the empty name)."""
    if kind.slot_use == "none":
        return [""]
    same = [e for e in engines if e.kind.slot_use == kind.slot_use]
    if kind.slot_use == "own":
        used = {e.slot for e in same}
        return [slot for slot in slots if slot not in used]
    sharing = {slot: sum(1 for e in same if e.slot == slot) for slot in slots}
    open_slots = [slot for slot in slots if sharing[slot] < settings.WORKER_PREDICT_PER_SLOT]
    return sorted(open_slots, key=lambda slot: sharing[slot])


def kill_marked_strangers(host: str, engines: Iterable[EngineProcess], report: Callable[[str], None]) -> None:
    """Kill the engines of ``host`` (by their marker) that are not among ``engines``: a predecessor's."""
    spared = {engine.pid for engine in engines} | {os.getpgrp()}
    for pid, replica in marked_engines(host, database_name()):
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            continue
        if group in spared or pid == os.getpid():
            continue  # ours, or already killed with its group (vLLM's engine core shares the mark)
        spared.add(group)
        signal_group(group, signal.SIGKILL)
        report(f"killed engine pid {pid} (replica {replica}) that no supervisor tracks")
