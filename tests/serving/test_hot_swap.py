"""Hot-swap of a deployment's version: the steps (supervisor driven step by step, fake
engines), a swap under continuous streaming load through a real gateway with ``runworkers``
on fake engines, and the same with the real SmolLM2 (``engine``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from core.errors import InvalidInput
from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica
from registry.replica_keys import replica_api_key
from registry.services import deployment_create
from rollout.hotswap import (
    SWAP_DRAIN,
    SWAP_SHIFT,
    deployment_swap_cancel,
    deployment_swap_version,
    drain_delay,
    open_swaps,
    swap_get,
    swap_step,
)
from serving.supervisor.engines import marked_engines
from serving.supervisor.host import Supervisor
from tests.support.gateway import committed, persisted, request_id_of
from tests.support.processes import child_env, start_runworkers, stop_process

pytestmark = pytest.mark.django_db

BUSY_LAUNCHER = f"{sys.executable} -m tests.support.busy_engine"


def fake_model(name: str, *, versions: tuple[str, ...] = ("1", "2"), replicas: int = 1) -> Deployment:
    """A model with these versions (fake artifacts), the first deployed."""
    model = Model.objects.create(name=name, task="chat")
    first = None
    for label in versions:
        version = ModelVersion.objects.create(
            model=model, version=label, framework="fake", artifact_uri=f"local://{name}/{label}",
            artifact_sha256="0" * 64, artifact_size=1, config={"max_seq_len": 512},
        )  # fmt: skip
        first = first or version
    assert first is not None
    return deployment_create(version=first, replicas=replicas, max_replicas=max(2, replicas))


def version_of(deployment: Deployment, label: str) -> ModelVersion:
    return ModelVersion.objects.get(model=deployment.version.model, version=label)


def ready(deployment_id: int) -> int:
    return Replica.objects.filter(deployment_id=deployment_id, state="ready").count()


def steps_of(old: Deployment) -> list[str]:
    """``swap_step()``, and what it did to the swap of ``old`` (other tests' swaps may be open)."""
    return [message for message in swap_step() if message.startswith(f"swap {open_or_last_swap(old.pk)} ")]


@pytest.fixture
def make_supervisor(settings, tmp_path) -> Iterator[Callable[..., Supervisor]]:
    settings.WORKER_ENGINE_LAUNCHER = BUSY_LAUNCHER
    settings.WORKER_HEARTBEAT_SECONDS = 0.2
    settings.WORKER_DRAIN_TIMEOUT = 10
    settings.WORKER_MAX_BACKOFF = 1
    settings.ROUTING_REFRESH_SECONDS = 0.2  # the drain waits 2 * this + 1 s after the shift
    made: list[Supervisor] = []

    def make(**kwargs: Any) -> Supervisor:
        options: dict[str, Any] = {"host": f"swap-{uuid.uuid4().hex[:8]}", "slots": ["0", "1", "2", "3"],
                                   "log_dir": tmp_path, "report": lambda m: None}  # fmt: skip
        supervisor = Supervisor(**{**options, **kwargs})
        made.append(supervisor)
        return supervisor

    yield make
    for supervisor in made:
        supervisor.close()


def step_until(supervisor: Supervisor, condition: Callable[[], Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        supervisor.step()
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


class TestSwapService:
    def test_it_creates_the_replacement_at_weight_0_with_the_same_shape(self):
        old = fake_model("swap-shape", replicas=2)
        Deployment.objects.filter(pk=old.pk).update(autoscale={"enabled": True}, gpu_type="L4")
        old.refresh_from_db()
        new = deployment_swap_version(actor=None, deployment=old, version=version_of(old, "2"))
        assert (new.version.version, new.traffic_weight, new.status) == ("2", 0, "pending")
        assert (new.replicas, new.min_replicas, new.max_replicas) == (2, old.min_replicas, old.max_replicas)
        assert (new.gpu_type, new.autoscale) == ("L4", {"enabled": True})
        [swap] = [s for s in open_swaps() if s.old_id == old.pk]
        assert (swap.new_id, swap.from_version, swap.to_version, swap.phase) == (new.pk, "1", "2", "starting")
        entry = AuditEntry.objects.get(action="deployment.swap", target=str(old.pk))
        assert entry.before["version"] == "1"

    def test_it_refuses_what_is_no_swap(self):
        old = fake_model("swap-refusals")
        other = fake_model("swap-other")
        with pytest.raises(InvalidInput) as exc:
            deployment_swap_version(actor=None, deployment=old, version=other.version)
        assert exc.value.field == "version"
        with pytest.raises(InvalidInput) as exc:
            deployment_swap_version(actor=None, deployment=old, version=old.version)
        assert exc.value.field == "version"
        deployment_swap_version(actor=None, deployment=old, version=version_of(old, "2"))
        with pytest.raises(InvalidInput, match="under way"):
            deployment_swap_version(actor=None, deployment=old, version=version_of(old, "2"))

    def test_traffic_stays_until_every_new_replica_is_ready(self):
        old = fake_model("swap-waits", replicas=2)
        Deployment.objects.filter(pk=old.pk).update(status="running")
        new = deployment_swap_version(actor=None, deployment=old, version=version_of(old, "2"))
        Replica.objects.create(
            deployment=new, host="h", state="ready", endpoint="http://x", last_heartbeat=timezone.now()
        )
        Replica.objects.create(deployment=new, host="h", state="starting")
        assert steps_of(old) == []
        old.refresh_from_db()
        assert old.traffic_weight == 100
        # Ready but silent for too long is not routable either.
        Replica.objects.filter(deployment=new, state="starting").update(
            state="ready", endpoint="http://y", last_heartbeat=timezone.now() - timedelta(minutes=5)
        )
        assert steps_of(old) == []
        Replica.objects.filter(deployment=new).update(last_heartbeat=timezone.now())
        [message] = steps_of(old)
        assert "traffic moved" in message
        old.refresh_from_db()
        new.refresh_from_db()
        assert (old.traffic_weight, new.traffic_weight, old.status) == (0, 100, "running")
        assert steps_of(old) == []  # idempotent: moved once

    def test_a_cancelled_swap_stops_the_new_deployment_and_keeps_the_old(self):
        old = fake_model("swap-cancel")
        new = deployment_swap_version(actor=None, deployment=old, version=version_of(old, "2"))
        [swap] = [s for s in open_swaps() if s.old_id == old.pk]
        deployment_swap_cancel(actor=None, swap=swap.entry)
        new.refresh_from_db()
        old.refresh_from_db()
        assert (new.status, old.status, old.traffic_weight) == ("stopped", "pending", 100)
        assert swap_get(swap_id=swap.entry.pk).outcome == "cancelled"
        assert all(s.old_id != old.pk for s in open_swaps())

    def test_a_new_deployment_stopped_by_hand_aborts_the_swap(self):
        old = fake_model("swap-abort")
        new = deployment_swap_version(actor=None, deployment=old, version=version_of(old, "2"))
        Deployment.objects.filter(pk=new.pk).update(status="stopped")
        [message] = steps_of(old)
        assert "aborted" in message
        old.refresh_from_db()
        assert old.traffic_weight == 100

    def test_the_command_starts_cancels_and_refuses_what_it_cannot_tell(self):
        old = fake_model("swap-command")
        out: list[str] = []

        class Out:
            def write(self, text: str) -> None:
                out.append(text)

            def flush(self) -> None:
                pass

        call_command("swap_version", "swap-command", "2", "--no-wait", stdout=Out())
        assert any("started" in line for line in out), out
        assert [s.old_id for s in open_swaps() if s.model == "swap-command"] == [old.pk]
        with pytest.raises(CommandError, match="no version"):
            call_command("swap_version", "swap-command", "9", "--no-wait", stdout=Out())
        call_command("swap_version", "swap-command", "--cancel", stdout=Out())
        assert not [s for s in open_swaps() if s.model == "swap-command"]
        deployment_create(version=old.version, replicas=1)  # a second deployment of version 1
        with pytest.raises(CommandError, match="Choose the deployment"):
            call_command("swap_version", "swap-command", "2", "--no-wait", stdout=Out())


class TestSwapWithTheSupervisor:
    def test_new_replicas_ready_then_traffic_then_old_drained_after_the_gateways_reloaded(self, make_supervisor):
        # Only this test's model: other tests may have committed deployments that want replicas.
        supervisor = make_supervisor(models=frozenset({"swap-steps"}))
        old = fake_model("swap-steps", replicas=2)
        step_until(supervisor, lambda: ready(old.pk) == 2)
        old_replicas = list(Replica.objects.filter(deployment=old))
        new = deployment_swap_version(actor=None, deployment=old, version=version_of(old, "2"))
        step_until(supervisor, lambda: Deployment.objects.get(pk=new.pk).traffic_weight == 100)
        assert ready(new.pk) == 2
        assert ready(old.pk) == 2  # still serving what was routed before the gateways reloaded
        step_until(supervisor, lambda: swap_get(swap_id=open_or_last_swap(old.pk)).outcome == "completed")
        old.refresh_from_db()
        assert old.status == "stopped"
        assert set(Replica.objects.filter(pk__in=[r.pk for r in old_replicas]).values_list("state", flat=True)) == {
            "stopped"
        }
        assert ready(new.pk) == 2
        shift = AuditEntry.objects.get(action=SWAP_SHIFT, target=str(old.pk))
        drain = AuditEntry.objects.get(action=SWAP_DRAIN, target=str(old.pk))
        assert (drain.created_at - shift.created_at).total_seconds() >= drain_delay()
        # Each new replica's load time is on record.
        new_replicas = [str(pk) for pk in Replica.objects.filter(deployment=new).values_list("pk", flat=True)]
        loads = AuditEntry.objects.filter(action="replica.ready", target__in=new_replicas)
        assert loads.count() == 2
        assert all(0 < entry.after["load_seconds"] < 30 for entry in loads)

    def test_the_drain_waits_for_a_stream_in_flight(self, make_supervisor, settings):
        supervisor = make_supervisor(models=frozenset({"swap-inflight"}))
        old = fake_model("swap-inflight")
        step_until(supervisor, lambda: ready(old.pk) == 1)
        replica = Replica.objects.get(deployment=old)
        httpx.post(f"{replica.endpoint}/_control", json={"tokens": 40, "delay": 0.1}, timeout=5)
        chunks: list[str] = []

        def stream() -> None:
            with httpx.stream(
                "POST", f"{replica.endpoint}/v1/chat/completions",
                json={"model": "swap-inflight", "stream": True, "messages": []},
                headers={"Authorization": f"Bearer {replica_api_key(replica.pk)}"}, timeout=30,
            ) as response:  # fmt: skip
                chunks.extend(line for line in response.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(0.3)  # under way: 4 s of tokens to come
        new = deployment_swap_version(actor=None, deployment=old, version=version_of(old, "2"))
        step_until(supervisor, lambda: Replica.objects.get(pk=replica.pk).state == "stopped")
        reader.join(10)
        assert chunks[-1] == "data: [DONE]"  # the old replica stopped only after finishing it
        assert len(chunks) == 40 + 2
        assert ready(new.pk) == 1


def open_or_last_swap(old_id: int) -> int:
    return AuditEntry.objects.filter(action="deployment.swap", target=str(old_id)).latest("id").pk


# --- under load, through a real gateway ---------------------------------------------------


@dataclass
class Outcome:
    ok: bool
    version: str | None
    request_id: str | None
    detail: str


def stream_once(client: httpx.Client, gateway_url: str, key: str, model: str, max_tokens: int) -> Outcome:
    body = {"model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Count from one to ten."}]}  # fmt: skip
    try:
        with client.stream(
            "POST", f"{gateway_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response:
            version = response.headers.get("x-model-version")
            if response.status_code != 200:
                return Outcome(False, version, None, f"HTTP {response.status_code}: {response.read()[:300]!r}")
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        return Outcome(False, None, None, f"{type(exc).__name__}: {exc}")
    if not events or events[-1] != "[DONE]":
        return Outcome(False, version, None, f"no [DONE]: {events[-2:]}")
    chunks = [json.loads(event) for event in events[:-1]]
    errors = [chunk for chunk in chunks if "error" in chunk]
    if errors:
        return Outcome(False, version, None, f"error event: {errors[0]}")
    return Outcome(True, version, request_id_of(chunks[0]["id"]), "")


class Load:
    """``workers`` clients streaming completions back to back until stopped."""

    def __init__(self, gateway_url: str, key: str, model: str, *, workers: int, max_tokens: int) -> None:
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(gateway_url, key, model, max_tokens), daemon=True)
            for _ in range(workers)
        ]

    def _run(self, gateway_url: str, key: str, model: str, max_tokens: int) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                outcome = stream_once(client, gateway_url, key, model, max_tokens)
                with self._lock:
                    self.outcomes.append(outcome)

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)
        return self.outcomes

    def served(self) -> int:
        with self._lock:
            return len(self.outcomes)


@contextlib.contextmanager
def runworkers(log_dir: Path, host: str, model: str, slots: str, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """``manage.py runworkers`` for one model's deployments only; its engines are killed afterwards."""
    log = open(log_dir / "runworkers.log", "wb")  # noqa: SIM115  closed below, after the process
    process = start_runworkers(
        ["--models", model], env=child_env(WORKER_HOST=host, WORKER_SLOTS=slots, WORKER_LOG_DIR=str(log_dir), **env),
        stdout=log,
    )  # fmt: skip
    try:
        yield process
    finally:
        stop_process(process, grace=60)
        log.close()
        for pid, _ in marked_engines(host, connection.settings_dict["NAME"]):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)


def wait_for(condition: Callable[[], Any], timeout: float, what: str, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{tail}")


def swap_under_load(
    django_db_blocker: Any,
    *,
    gateway_url: str,
    key: str,
    model: str,
    old_id: int,
    to_version: str,
    workers: int,
    max_tokens: int,
    timeout: float,
    log: Path,
) -> tuple[list[Outcome], int]:
    """Stream through the gateway, swap the deployment's version meanwhile, stream on a little
    after it completed; every outcome, and the new deployment's id."""
    load = Load(gateway_url, key, model, workers=workers, max_tokens=max_tokens).start()
    try:
        wait_for(lambda: load.served() >= workers * 2, 120, "requests before the swap")

        def swap() -> int:
            old = Deployment.objects.select_related("version__model").get(pk=old_id)
            version = ModelVersion.objects.get(model=old.version.model, version=to_version)
            return deployment_swap_version(actor=None, deployment=old, version=version).pk

        new_id = committed(django_db_blocker, swap)
        swap_id = committed(django_db_blocker, lambda: open_or_last_swap(old_id))
        wait_for(
            lambda: committed(django_db_blocker, lambda: swap_get(swap_id=swap_id).outcome), timeout, "the swap", log
        )
        served = load.served()
        wait_for(lambda: load.served() >= served + workers * 2, 120, "requests after the swap")
    finally:
        outcomes = load.stop()
    return outcomes, new_id


def check_swap(
    django_db_blocker: Any, outcomes: list[Outcome], *, old_id: int, new_id: int, versions: set[str]
) -> None:
    failed = [o for o in outcomes if not o.ok]
    assert not failed, f"{len(failed)} of {len(outcomes)} failed: {[o.detail for o in failed[:5]]}"
    assert {o.version for o in outcomes} == versions
    # Every request is metered with the version that served it (the one its answer named).
    records = persisted([o.request_id for o in outcomes if o.request_id])
    assert len(records) == len(outcomes)
    for outcome in outcomes:
        record = records[outcome.request_id]
        assert (record.model_version, record.status_code) == (outcome.version, 200)

    def states() -> tuple[str, str, set[str], set[str], dict[str, Any]]:
        old, new = Deployment.objects.get(pk=old_id), Deployment.objects.get(pk=new_id)
        swap = swap_get(swap_id=open_or_last_swap(old_id))
        return (
            old.status,
            new.status,
            set(Replica.objects.filter(deployment=old).values_list("state", flat=True)),
            set(Replica.objects.filter(deployment=new).values_list("state", flat=True)),
            {"outcome": swap.outcome, "weights": (old.traffic_weight, new.traffic_weight)},
        )

    old_status, new_status, old_states, new_states, swap = committed(django_db_blocker, states)
    assert (old_status, old_states) == ("stopped", {"stopped"})
    assert (new_status, new_states) == ("running", {"ready"})
    assert swap == {"outcome": "completed", "weights": (0, 100)}


@pytest.fixture
def dropped_after(django_db_blocker) -> Iterator[list[str]]:
    """Names of models committed by the test: dropped with their deployments afterwards, so
    no later test's supervisor finds a deployment that still wants replicas."""
    names: list[str] = []
    yield names

    def drop() -> None:
        Deployment.objects.filter(version__model__name__in=names).delete()
        ModelVersion.objects.filter(model__name__in=names).delete()
        Model.objects.filter(name__in=names).delete()

    committed(django_db_blocker, drop)


class TestSwapUnderLoad:
    def test_a_swap_under_streaming_load_fails_no_request(
        self, django_db_blocker, make_api_key, spawn_gateway, tmp_path, dropped_after
    ):
        name = f"swap-load-{uuid.uuid4().hex[:6]}"
        dropped_after.append(name)
        old_id = committed(django_db_blocker, lambda: fake_model(name, replicas=2).pk)
        key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
        env = {"WORKER_ENGINE_LAUNCHER": BUSY_LAUNCHER, "ENGINE_EXTRA_ARGS": "--fake-tokens 10 --fake-delay 0.05",
               "WORKER_HEARTBEAT_SECONDS": "0.5", "WORKER_DRAIN_TIMEOUT": "20"}  # fmt: skip
        host = f"swap-load-{uuid.uuid4().hex[:6]}"
        with runworkers(tmp_path, host, name, "0,1,2,3", **env):
            log = tmp_path / "runworkers.log"
            wait_for(lambda: committed(django_db_blocker, lambda: ready(old_id) == 2), 60, "old replicas", log)
            gateway = spawn_gateway()
            outcomes, new_id = swap_under_load(
                django_db_blocker, gateway_url=gateway.base_url, key=key.secret, model=name, old_id=old_id,
                to_version="2", workers=6, max_tokens=10, timeout=60, log=log,
            )  # fmt: skip
            # check_swap reads the swap's outcome from the database: any supervisor may drive a
            # swap (the session's engines' one too), so this one's log need not show the steps.
            check_swap(django_db_blocker, outcomes, old_id=old_id, new_id=new_id, versions={"1", "2"})
        print(f"{len(outcomes)} streamed requests across the swap, none failed")


@pytest.mark.engine
class TestRealSwap:
    def test_smollm2_swapped_under_streaming_load_fails_no_request_and_meters_each_version(
        self, bundled_models, django_db_blocker, make_api_key, spawn_gateway, tmp_path, dropped_after
    ):
        smollm2 = bundled_models["versions"]["smollm2-135m-instruct"]
        name = f"smollm2-swap-{uuid.uuid4().hex[:6]}"
        dropped_after.append(name)

        def register() -> int:
            # The bundled artifact twice: a second version, as a retrained model would be.
            model = Model.objects.create(name=name, task="chat")
            first = None
            for label in ("a", "b"):
                version = ModelVersion.objects.create(
                    model=model, version=label, framework=smollm2.framework, artifact_uri=smollm2.artifact_uri,
                    artifact_sha256=smollm2.artifact_sha256, artifact_size=smollm2.artifact_size,
                    config=smollm2.config,
                )  # fmt: skip
                first = first or version
            assert first is not None
            return deployment_create(version=first, replicas=1).pk

        old_id = committed(django_db_blocker, register)
        key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
        host = f"swap-real-{uuid.uuid4().hex[:6]}"
        started = time.monotonic()
        with runworkers(tmp_path, host, name, "0,1", WORKER_DRAIN_TIMEOUT="60"):
            log = tmp_path / "runworkers.log"
            wait_for(lambda: committed(django_db_blocker, lambda: ready(old_id) == 1), 600, "version a", log)
            gateway = spawn_gateway()
            outcomes, new_id = swap_under_load(
                django_db_blocker, gateway_url=gateway.base_url, key=key.secret, model=name, old_id=old_id,
                to_version="b", workers=3, max_tokens=8, timeout=600, log=log,
            )  # fmt: skip
            check_swap(django_db_blocker, outcomes, old_id=old_id, new_id=new_id, versions={"a", "b"})

            def load_times() -> list[float]:
                replicas = Replica.objects.filter(deployment_id__in=[old_id, new_id]).values_list("pk", flat=True)
                entries = AuditEntry.objects.filter(action="replica.ready", target__in=[str(pk) for pk in replicas])
                return [entry.after["load_seconds"] for entry in entries]

            loads = committed(django_db_blocker, load_times)
        assert len(loads) == 2
        print(
            f"{len(outcomes)} streamed requests across the swap, none failed; load times {loads} s; "
            f"{time.monotonic() - started:.0f} s in all"
        )
