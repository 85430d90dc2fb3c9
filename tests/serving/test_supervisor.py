"""runworkers' supervisor, driven step by step with the fake engine as the launched program.

One test runs ``manage.py runworkers`` itself, behind a TCP proxy to the test database that
it cuts for 30 s; ``runplatform``'s restarting of its children is tested on small programs.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from django.db import OperationalError, connection
from django.utils import timezone

from console.management.commands.runplatform import AlreadyRunning, ChildProcesses, claim_platform
from registry.artifacts import ArtifactUnavailable, LocalArtifactStore
from registry.models import AuditEntry, Deployment, HostLease, Model, ModelVersion, Replica
from registry.replica_keys import replica_api_key
from registry.services import (
    deployment_adapters_set,
    deployment_create,
    deployment_transition,
    host_lease_take,
    replica_restart_request,
)
from serving.gateway.engine_kinds import PREDICT, VLLM
from serving.supervisor.engines import DATABASE_MARKER, HOST_MARKER, REPLICA_MARKER, marked_engines, warm_up
from serving.supervisor.host import Supervisor
from serving.supervisor.lease import HostLeaseHeld
from serving.supervisor.weights import Weights
from tests.support import processes
from tests.support.gateway import committed
from tests.support.processes import child_env, free_port
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.django_db

FAKE_LAUNCHER = f"{sys.executable} -m tests.support.fake_engine"


@pytest.fixture
def fake_launcher(settings, tmp_path):
    settings.WORKER_ENGINE_LAUNCHER = FAKE_LAUNCHER
    settings.WORKER_HEARTBEAT_SECONDS = 0.2
    settings.WORKER_DRAIN_TIMEOUT = 5
    settings.WORKER_MAX_BACKOFF = 1
    return tmp_path


# The models of this module's deployments: its supervisors serve only these. Other tests commit
# deployments that stay serving meanwhile (a session's real engines); a supervisor that claimed
# them would hold slots and spend its passes on engines no test here waits for.
OURS: set[str] = set()


def create_deployment(name: str = "tiny-chat", replicas: int = 1, max_adapters: int = 0) -> Deployment:
    OURS.add(name)
    model = Model.objects.create(name=name, task="chat")
    version = ModelVersion.objects.create(
        model=model, version="1", framework="fake", artifact_uri=f"local://{name}/1", artifact_sha256="0" * 64,
        artifact_size=1, config={"max_seq_len": 512},
    )  # fmt: skip
    return deployment_create(
        version=version, replicas=replicas, max_replicas=max(2, replicas), max_adapters=max_adapters
    )


@pytest.fixture
def deployment() -> Deployment:
    return create_deployment()


def unique_host() -> str:
    # Engines are found by a host marker in their environment: a host name of its own keeps
    # a test (or another test run on this machine) from ever killing another's engines.
    return f"test-host-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_supervisor(fake_launcher) -> Iterator[Callable[..., Supervisor]]:
    """Supervisors on hosts of their own; every engine they started is killed afterwards."""
    made: list[Supervisor] = []

    def make(**kwargs: Any) -> Supervisor:
        options: dict[str, Any] = {"host": unique_host(), "slots": ["0", "1"], "log_dir": fake_launcher,
                                   "report": lambda m: None, "models": cast(frozenset[str], OURS)}  # fmt: skip
        sup = Supervisor(**{**options, **kwargs})
        made.append(sup)
        return sup

    yield make
    for sup in made:
        sup.close()


@pytest.fixture
def supervisor(make_supervisor) -> Supervisor:
    return make_supervisor()


def step_until(sup: Supervisor, condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sup.step()
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached")


def wait_for(condition, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def ready_replicas(deployment: Deployment) -> list[Replica]:
    return list(Replica.objects.filter(deployment=deployment, state="ready"))


def control(replica: Replica, **state: Any) -> None:
    httpx.post(f"{replica.endpoint}/_control", json=state, timeout=5).raise_for_status()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class TestSupervisor:
    def test_it_starts_a_replica_and_marks_everything_live(self, supervisor, deployment):
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        assert replica.host == supervisor.host
        assert replica.endpoint.startswith("http://127.0.0.1:")
        assert replica.pid == supervisor.engines[replica.pk].popen.pid
        assert replica.last_heartbeat is not None
        deployment.refresh_from_db()
        deployment.version.refresh_from_db()
        assert (deployment.status, deployment.version.status) == ("running", "active")

    def test_it_never_claims_more_than_wanted(self, supervisor, deployment):
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        for _ in range(5):
            supervisor.step()
        assert Replica.objects.filter(deployment=deployment).count() == 1

    def test_it_heartbeats_ready_replicas(self, supervisor, deployment):
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        first = ready_replicas(deployment)[0].last_heartbeat
        time.sleep(0.3)
        step_until(supervisor, lambda: ready_replicas(deployment)[0].last_heartbeat > first)

    def test_a_crashed_replica_is_restarted(self, supervisor, deployment):
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        os.killpg(replica.pid, signal.SIGKILL)
        step_until(supervisor, lambda: Replica.objects.get(pk=replica.pk).state == "failed")
        step_until(supervisor, lambda: Replica.objects.get(pk=replica.pk).state == "ready")
        restarted = Replica.objects.get(pk=replica.pk)
        assert restarted.pid != replica.pid
        assert Replica.objects.filter(deployment=deployment).count() == 1

    def test_a_stopped_deployment_is_drained_then_stopped(self, supervisor, deployment):
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        deployment_transition(deployment=deployment, status="draining")
        step_until(supervisor, lambda: Replica.objects.get(pk=replica.pk).state == "stopped")
        assert supervisor.engines == {}
        with pytest.raises(ProcessLookupError):
            os.kill(replica.pid, 0)

    def test_scaling_down_drains_the_surplus(self, supervisor, deployment):
        Deployment.objects.filter(pk=deployment.pk).update(replicas=2)
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 2)
        Deployment.objects.filter(pk=deployment.pk).update(replicas=1)
        step_until(supervisor, lambda: Replica.objects.filter(deployment=deployment, state="stopped").count() == 1)
        assert len(ready_replicas(deployment)) == 1

    def test_it_only_uses_its_slots(self, supervisor, deployment):
        Deployment.objects.filter(pk=deployment.pk).update(replicas=2, max_replicas=3)
        other = deployment_create(version=deployment.version, replicas=1)
        step_until(supervisor, lambda: len(supervisor.engines) == 2)
        for _ in range(5):
            supervisor.step()
        assert len(supervisor.engines) == 2
        assert {e.slot for e in supervisor.engines.values()} == {"0", "1"}
        assert Replica.objects.filter(deployment__in=[deployment, other]).count() == 2

    def test_a_restarted_supervisor_releases_what_its_predecessor_left(self, fake_launcher, deployment, monkeypatch):
        # run() recycles stale connections each loop; inside the test transaction it must not.
        monkeypatch.setattr("serving.supervisor.host.close_old_connections", lambda: None)
        host = unique_host()
        Replica.objects.create(deployment=deployment, host=host, state="ready", endpoint="http://x")
        sup = Supervisor(host=host, slots=["0"], log_dir=fake_launcher, report=lambda m: None)
        sup.stopping = True  # run() releases, then finds nothing to stop
        sup.run(once=True)
        assert set(Replica.objects.filter(deployment=deployment).values_list("state", flat=True)) == {"stopped"}


class TestRestartOnRequest:
    def test_a_requested_restart_drains_stops_and_starts_the_same_replica_again(self, make_supervisor, deployment):
        from registry.models import AuditEntry

        messages: list[str] = []
        supervisor = make_supervisor(report=messages.append)
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        first = supervisor.engines[replica.pk].popen
        replica_restart_request(actor=None, replica=replica)
        states: list[str] = []

        def restarted() -> bool:
            row = Replica.objects.get(pk=replica.pk)
            if not states or states[-1] != row.state:
                states.append(row.state)
            return row.state == "ready" and row.pid != replica.pid

        step_until(supervisor, restarted)
        # Drained (no new requests routed), stopped with SIGTERM, started again: a new process.
        assert states == ["draining", "starting", "ready"], states
        assert first.returncode == -signal.SIGTERM
        row = Replica.objects.get(pk=replica.pk)
        assert row.pid == supervisor.engines[replica.pk].popen.pid != first.pid
        assert row.restart_requested_at is None
        # The same replica came back: none was claimed in its place, and the restart was no failure.
        assert Replica.objects.filter(deployment=deployment).count() == 1
        assert supervisor.engines[replica.pk].restarts == 0
        assert AuditEntry.objects.filter(action="replica.ready", target=str(replica.pk)).count() == 2
        assert any(f"replica {replica.pk}: restart requested" in m for m in messages), messages
        assert any(f"replica {replica.pk} stopped for its restart" in m for m in messages), messages
        # Done: later passes leave it alone.
        for _ in range(3):
            supervisor.step()
        assert Replica.objects.get(pk=replica.pk).pid == row.pid

    def test_a_replica_asked_to_restart_whose_deployment_stops_meanwhile_stays_stopped(self, supervisor, deployment):
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        replica_restart_request(actor=None, replica=replica)
        supervisor.step()  # the restart begins: draining
        assert supervisor.engines[replica.pk].restart_requested
        deployment_transition(deployment=deployment, status="draining")
        step_until(supervisor, lambda: Replica.objects.get(pk=replica.pk).state == "stopped")
        assert supervisor.engines == {}
        assert Replica.objects.get(pk=replica.pk).restart_requested_at is None
        assert not alive(replica.pid)


def command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def max_loras(pid: int) -> str:
    command = command_line(pid)
    return command[command.index("--max-loras") + 1] if "--max-loras" in command else "none"


class TestAdaptersRoll:
    """A deployment's ``max_adapters`` set after deploy (``deployment_adapters_set``) rolls out
    to its running engines: one replica restarted at a time, each with the new value."""

    def test_a_new_value_restarts_one_engine_at_a_time_and_each_takes_it(self, make_supervisor):
        messages: list[str] = []
        supervisor = make_supervisor(report=messages.append)
        deployment = create_deployment("roll-base", replicas=2, max_adapters=2)
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 2)
        first = {r.pk: r.pid for r in ready_replicas(deployment)}
        assert {max_loras(pid) for pid in first.values()} == {"2"}
        for _ in range(5):  # its value is the deployment's: nothing restarts
            supervisor.step()
        assert {r.pk: r.pid for r in ready_replicas(deployment)} == first

        deployment_adapters_set(actor=None, deployment=deployment, max_adapters=4)
        deadline = time.monotonic() + 60
        most_unsettled = 0
        while True:
            supervisor.step()
            engines = [e for e in supervisor.engines.values() if e.deployment_id == deployment.pk]
            unsettled = sum(1 for e in engines if e.phase != "ready" or e.restart_requested)
            rows = Replica.objects.filter(deployment=deployment)
            unsettled_rows = sum(1 for r in rows if r.state != "ready" or r.restart_requested_at is not None)
            most_unsettled = max(most_unsettled, unsettled, unsettled_rows)
            assert max(unsettled, unsettled_rows) <= 1, [(e.replica_id, e.phase) for e in engines]
            now = {r.pk: r.pid for r in rows if r.state == "ready"}
            if now.keys() == first.keys() and all(now[pk] != first[pk] for pk in first):
                break
            assert time.monotonic() < deadline, "not rolled within 60 s"
            time.sleep(0.05)
        assert most_unsettled == 1
        for replica in ready_replicas(deployment):
            assert max_loras(replica.pid) == "4"
            assert supervisor.engines[replica.pk].max_adapters == 4
        restarts = AuditEntry.objects.filter(action="replica.restart", target__in=[str(pk) for pk in first])
        assert sorted((e.actor_name, e.after["max_adapters"]) for e in restarts) == [("engine supervisor", 4)] * 2
        assert sum("restarting for its deployment's max_adapters (2 → 4)" in m for m in messages) == 2, messages
        # Rolled: each engine has the value now, and nothing restarts again.
        rolled = {r.pk: r.pid for r in ready_replicas(deployment)}
        for _ in range(5):
            supervisor.step()
        assert {r.pk: r.pid for r in ready_replicas(deployment)} == rolled

    def test_lora_turned_off_restarts_the_engine_without_it(self, supervisor):
        deployment = create_deployment("roll-off", replicas=1, max_adapters=2)
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        assert "--enable-lora" in command_line(replica.pid)
        deployment_adapters_set(actor=None, deployment=deployment, max_adapters=0)
        step_until(supervisor, lambda: {r.pid for r in ready_replicas(deployment)} - {replica.pid, None}, 30)
        restarted = ready_replicas(deployment)[0]
        assert restarted.pk == replica.pk  # the same replica, restarted: none claimed in its place
        assert "--enable-lora" not in command_line(restarted.pid)
        assert supervisor.engines[replica.pk].max_adapters == 0


class TestLoadTimesAndModels:
    def test_each_replicas_load_time_is_logged_audited_and_exported(self, make_supervisor, deployment):
        from registry.models import AuditEntry
        from serving.gateway.metrics import REPLICA_LOAD_SECONDS

        messages: list[str] = []
        supervisor = make_supervisor(report=messages.append)
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        entry = AuditEntry.objects.get(action="replica.ready", target=str(replica.pk))
        seconds = entry.after["load_seconds"]
        assert 0 < seconds < 20
        assert entry.after == {"load_seconds": seconds, "host": supervisor.host, "deployment": deployment.pk,
                               "model": "tiny-chat", "version": "1"}  # fmt: skip
        assert any(f"replica {replica.pk} (tiny-chat:1) ready" in m and "loaded in" in m for m in messages), messages
        gauge = REPLICA_LOAD_SECONDS.labels("tiny-chat", "1", str(replica.pk))._value.get()
        assert gauge == pytest.approx(seconds, abs=0.001)

    def test_a_supervisor_for_some_models_serves_only_theirs(self, make_supervisor, deployment):
        other = create_deployment("other-chat")
        supervisor = make_supervisor(models=frozenset({"other-chat"}))
        step_until(supervisor, lambda: len(ready_replicas(other)) == 1)
        for _ in range(3):
            supervisor.step()
        assert Replica.objects.filter(deployment=deployment).count() == 0
        assert {engine.deployment_id for engine in supervisor.engines.values()} == {other.pk}


class TestDatabaseOutages:
    def test_a_database_error_in_a_pass_is_survived_and_the_pending_work_done_after(
        self, supervisor, deployment, monkeypatch
    ):
        messages: list[str] = []
        supervisor.report = messages.append
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]

        def database_down(**kwargs: Any) -> Any:
            raise OperationalError("connection refused")

        # The first query of every pass, and a later one: any of them may be the one that fails.
        monkeypatch.setattr("serving.supervisor.host.replica_release_host", database_down)
        monkeypatch.setattr("serving.supervisor.host.replica_heartbeats", database_down)
        os.killpg(replica.pid, signal.SIGKILL)  # and the engine crashes meanwhile
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            supervisor.step()
            time.sleep(0.05)
        assert supervisor.engines[replica.pk].phase == "backoff"
        assert Replica.objects.get(pk=replica.pk).state == "ready"  # nothing written meanwhile
        assert sum("database unavailable" in m for m in messages) == 1

        monkeypatch.undo()
        step_until(supervisor, lambda: Replica.objects.get(pk=replica.pk).pid != replica.pid, timeout=30)
        step_until(supervisor, lambda: Replica.objects.get(pk=replica.pk).state == "ready")
        assert sum("database reachable again" in m for m in messages) == 1
        assert supervisor.engines[replica.pk].popen.pid == Replica.objects.get(pk=replica.pk).pid

    def test_runworkers_keeps_its_engines_through_a_30_s_outage(self, django_db_blocker, tmp_path):
        host = unique_host()
        name = f"outage-{uuid.uuid4().hex[:8]}"
        deployment_id = committed(django_db_blocker, lambda: create_deployment(name).pk)
        database = connection.settings_dict
        proxy = TcpProxy(int(database["PORT"]), database["HOST"]).start()
        direct = f"@{database['HOST']}:{database['PORT']}/"
        url = processes.test_database_url().replace(direct, f"@127.0.0.1:{proxy.port}/")
        assert str(proxy.port) in url
        log_path = tmp_path / "runworkers.log"
        env = child_env(
            DATABASE_URL=url, WORKER_HOST=host, WORKER_SLOTS="0,1", WORKER_LOG_DIR=str(tmp_path),
            WORKER_ENGINE_LAUNCHER=FAKE_LAUNCHER, WORKER_HEARTBEAT_SECONDS="0.5", WORKER_DRAIN_TIMEOUT="5",
            # Longer than the outage: a host cut off for longer than its lease is judged lost by
            # the supervisors still connected (another test run's, here), and its replicas released.
            WORKER_HOST_LEASE_SECONDS="90",
        )  # fmt: skip

        def replica() -> Replica | None:
            return committed(
                django_db_blocker, lambda: Replica.objects.filter(deployment_id=deployment_id, state="ready").first()
            )

        process: subprocess.Popen[bytes] | None = None
        try:
            with open(log_path, "wb") as log:
                process = processes.start_runworkers([], env=env, stdout=log)
            before = wait_for(replica, 60, "a ready replica")
            pid = before.pid
            proxy.cut()
            cut_at = timezone.now()
            outage_started = time.monotonic()
            while time.monotonic() - outage_started < 30:
                assert process.poll() is None, log_path.read_text()
                assert alive(pid), "the engine died during the outage"
                time.sleep(1)
            during = replica()
            # The proxy really kept the supervisor away: no heartbeat got through.
            assert during.last_heartbeat < cut_at + timedelta(seconds=1)
            proxy.restore()
            restored_at = time.monotonic()
            after = wait_for(
                lambda: (r := replica()) and r.last_heartbeat > during.last_heartbeat and r,
                30,
                "a heartbeat after the database came back",
            )
            print(f"heartbeat resumed {time.monotonic() - restored_at:.1f} s after the database came back")
            assert after.pid == pid
            assert alive(pid)
            assert process.poll() is None
            # The recovery line is written at the end of the pass that wrote the heartbeat.
            wait_for(lambda: "database reachable again" in log_path.read_text(), 10, "no recovery line in the log")
            text = log_path.read_text()
            assert text.count("database unavailable") == 1, text
            assert text.count("database reachable again") == 1, text
        finally:
            proxy.restore()
            if process is not None:
                processes.stop_process(process, grace=30)
            for pid, _ in marked_engines(host, database["NAME"]):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
            proxy.close()

            def drop() -> None:
                Deployment.objects.filter(pk=deployment_id).delete()
                ModelVersion.objects.filter(model__name=name).delete()
                Model.objects.filter(name=name).delete()

            committed(django_db_blocker, drop)


class TestRowsAndStrays:
    @pytest.mark.parametrize("deleted", ["replica", "deployment"])
    def test_a_deleted_row_stops_its_engine_and_the_supervisor_goes_on(self, supervisor, deployment, deleted):
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        popen = supervisor.engines[replica.pk].popen
        if deleted == "replica":
            Replica.objects.filter(pk=replica.pk).delete()
        else:
            Deployment.objects.filter(pk=deployment.pk).delete()
        step_until(supervisor, lambda: replica.pk not in supervisor.engines and popen.poll() is not None)
        if deleted == "replica":  # the deployment still wants one: a new replica takes its place
            step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
            assert ready_replicas(deployment)[0].pk != replica.pk
        else:
            for _ in range(3):
                supervisor.step()
            assert supervisor.engines == {}

    def test_an_untracked_engine_of_this_host_is_killed_on_start(self, fake_launcher, monkeypatch):
        monkeypatch.setattr("serving.supervisor.host.close_old_connections", lambda: None)
        host = unique_host()

        def start(marked_host: str) -> subprocess.Popen[bytes]:
            port = free_port()
            env = dict(os.environ)
            env.update({HOST_MARKER: marked_host, DATABASE_MARKER: connection.settings_dict["NAME"],
                        REPLICA_MARKER: "999999"})  # fmt: skip
            process = processes.start_process(
                [sys.executable, "-m", "tests.support.fake_engine", "--port", str(port)], env=env
            )

            def up() -> bool:
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(up, 20, "the stray engine")  # exec'd: its environment is its own
            return process

        # Started by a supervisor that crashed before it recorded the pid: only the marker knows.
        stray, strangers = start(host), start(unique_host())
        try:
            messages: list[str] = []
            sup = Supervisor(host=host, slots=["0"], log_dir=fake_launcher, report=messages.append)
            sup.stopping = True  # run() only does its start-up work
            sup.run(once=True)
            assert stray.wait(5) == -signal.SIGKILL
            assert strangers.poll() is None  # another host's engine is not ours to kill
            assert any("no supervisor tracks" in m for m in messages)
        finally:
            for process in (stray, strangers):
                process.kill()
                process.wait(5)


class TestEngineContract:
    def test_the_engine_requires_its_replicas_key_and_never_shows_it(self, supervisor, deployment):
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        url = f"{replica.endpoint}/v1/chat/completions"
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}
        refused = httpx.post(url, json=body, timeout=5)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        wrong = {"Authorization": f"Bearer {replica_api_key(replica.pk + 1)}"}
        assert httpx.post(url, json=body, headers=wrong, timeout=5).status_code == 401
        right = {"Authorization": f"Bearer {replica_api_key(replica.pk)}"}
        assert httpx.post(url, json=body, headers=right, timeout=5).status_code == 200
        # What the supervisor needs stays open.
        assert httpx.get(f"{replica.endpoint}/health", timeout=5).status_code == 200
        assert httpx.get(f"{replica.endpoint}/metrics", timeout=5).status_code == 200
        # Given in the environment, not on the (world-readable) command line.
        with open(f"/proc/{replica.pid}/cmdline", "rb") as cmdline:
            assert replica_api_key(replica.pk).encode() not in cmdline.read()

    def test_the_engine_gets_only_an_allow_listed_environment(self, supervisor, deployment, monkeypatch):
        platform = {
            "PROMETHEUS_MULTIPROC_DIR": "/tmp/prom",
            "DATABASE_URL": "postgresql://secret@db/x",
            "SECRET_KEY": "s3cret",
            "REDIS_URL": "redis://r/0",
            "BOOTSTRAP_CREDENTIALS": "/tmp/c.json",
        }
        for name, value in platform.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # would open vLLM's unguarded debug routes
        monkeypatch.setenv("HF_HOME", "/tmp/hf")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        names = set(httpx.get(f"{replica.endpoint}/_env", timeout=5).json()["names"])
        assert not names & {*platform, "DJANGO_SETTINGS_MODULE", "TEST_SESSION", "VLLM_SERVER_DEV_MODE"}
        assert {"PATH", "HF_HOME", "OMP_NUM_THREADS", "VLLM_API_KEY", "VLLM_CPU_OMP_THREADS_BIND", HOST_MARKER,
                REPLICA_MARKER} <= names  # fmt: skip


class TestTiming:
    def test_a_hung_or_deaf_engine_never_delays_another_replicas_heartbeat(self, make_supervisor, deployment):
        supervisor = make_supervisor(slots=["0", "1", "2"], stop_grace=2.0)
        messages: list[str] = []
        supervisor.report = messages.append
        Deployment.objects.filter(pk=deployment.pk).update(replicas=3, max_replicas=3)
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 3)
        hung, healthy, deaf = sorted(ready_replicas(deployment), key=lambda r: r.pk)
        control(hung, health="hang")
        control(deaf, ignore_sigterm=True)
        # Scaling down drains the newest replica, the one that ignores SIGTERM.
        Deployment.objects.filter(pk=deployment.pk).update(replicas=2)
        first_beat = Replica.objects.get(pk=healthy.pk).last_heartbeat
        slowest = 0.0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            started = time.monotonic()
            supervisor.step()
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.05)
        assert slowest < 2.0, f"one step took {slowest:.1f} s"
        assert Replica.objects.get(pk=healthy.pk).last_heartbeat > first_beat
        # The deaf engine got SIGTERM, ignored it, and was killed after the grace period…
        assert any(f"replica {deaf.pk} ignored SIGTERM" in m for m in messages), messages
        step_until(supervisor, lambda: Replica.objects.get(pk=deaf.pk).state == "stopped")
        assert not alive(deaf.pid)
        # …and the one whose /health hangs was found out and restarted.
        assert any(f"replica {hung.pk} failed (/health failed 3 times)" in m for m in messages), messages


class TestLeavingRouting:
    def test_a_replica_whose_health_check_fails_leaves_routing_within_10_s(self, make_supervisor, deployment, settings):
        from core import keys
        from core.redis import sync_redis
        from serving.gateway.routing import Router, load_routing_table

        settings.WORKER_HEARTBEAT_SECONDS = 3.0  # the production cadence (the fixture's is 0.2 s)
        supervisor = make_supervisor()
        Deployment.objects.filter(pk=deployment.pk).update(replicas=2, max_replicas=2)
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 2)
        sick, well = sorted(ready_replicas(deployment), key=lambda r: r.pk)
        router = Router()

        def routed() -> set[int]:
            """What a gateway that has just reloaded would route to."""
            route = load_routing_table().models[deployment.version.model.name]
            return {replica.id for v in route.versions for replica in router.routable(v)}

        assert routed() == {sick.pk, well.pk}
        announcements = sync_redis().pubsub(ignore_subscribe_messages=True)
        announcements.subscribe(keys.routing_invalidation_channel())
        try:
            control(sick, health="hang")  # alive, but /health never answers: the slowest case to detect
            broke = time.monotonic()
            while sick.pk in routed():
                assert time.monotonic() - broke < 10, "the sick replica is still routed to after 10 s"
                supervisor.step()
                time.sleep(0.1)
            assert routed() == {well.pk}
            # …and every gateway was told at once, instead of at its next refresh.
            deadline = time.monotonic() + 2
            message = None
            while message is None and time.monotonic() < deadline:
                message = announcements.get_message(timeout=0.2)
            assert message is not None
            assert message["data"] == b"replica"
        finally:
            announcements.close()


class TestChildProcesses:
    def test_a_crashed_child_is_restarted_and_the_others_keep_running(self, tmp_path):
        messages: list[str] = []
        children = ChildProcesses(
            {
                "steady": [sys.executable, "-c", "import time; time.sleep(60)"],
                "crashy": [sys.executable, "-c", "raise SystemExit(3)"],
            },
            cwd=tmp_path, env=dict(os.environ), log_dir=tmp_path, report=messages.append, first_backoff=0.1,
            max_backoff=0.2,
        )  # fmt: skip
        try:
            children.start()
            steady = children.children["steady"].popen
            first_crashy = children.children["crashy"].popen.pid
            deadline = time.monotonic() + 20
            while children.children["crashy"].restarts < 3 and time.monotonic() < deadline:
                children.watch()
                time.sleep(0.05)
            assert children.children["crashy"].restarts >= 3
            assert children.children["crashy"].popen.pid != first_crashy
            assert any(m.startswith("crashy exited with code 3; restarting in") for m in messages), messages
            assert children.children["steady"].popen is steady
            assert steady.poll() is None
        finally:
            children.stop(("crashy", "steady"), timeout=5)
        assert steady.poll() == -signal.SIGTERM
        children.watch()  # stopping: nothing comes back
        assert children.children["steady"].popen is steady


class TestOneSupervisorPerHost:
    def test_a_second_runworkers_of_the_same_host_refuses_and_the_first_keeps_its_replicas(
        self, django_db_blocker, tmp_path
    ):
        host = unique_host()
        name = f"lease-{uuid.uuid4().hex[:8]}"
        deployment_id = committed(django_db_blocker, lambda: create_deployment(name).pk)
        env = child_env(
            WORKER_HOST=host, WORKER_SLOTS="0,1", WORKER_LOG_DIR=str(tmp_path), WORKER_ENGINE_LAUNCHER=FAKE_LAUNCHER,
            WORKER_HEARTBEAT_SECONDS="0.5", WORKER_DRAIN_TIMEOUT="5",
        )  # fmt: skip

        def replicas() -> list[Replica]:
            return committed(django_db_blocker, lambda: list(Replica.objects.filter(deployment_id=deployment_id)))

        def start(log_name: str) -> subprocess.Popen[bytes]:
            with open(tmp_path / log_name, "wb") as log:
                return processes.start_runworkers(["--models", name], env=env, stdout=log)

        first = second = None
        try:
            first = start("first.log")
            # Started while the first is still loading its engine (the audit's second `make run`).
            [claimed] = wait_for(replicas, 60, "the first supervisor's claim")
            second = start("second.log")
            deadline = time.monotonic() + 30
            while second.poll() is None and time.monotonic() < deadline:
                assert "by another process" not in (tmp_path / "first.log").read_text(), "the two supervisors fight"
                time.sleep(0.2)
            refusal = (tmp_path / "second.log").read_text()
            assert second.poll() is not None, f"the second runworkers did not refuse to start:\n{refusal}"
            assert second.returncode != 0
            # One sentence naming the host, the holder (pid and machine) and the lease's end.
            assert f"host {host} is already supervised by pid {first.pid} on {socket.gethostname()}" in refusal
            assert "lease runs until" in refusal
            assert "starting on slot" not in refusal  # it started no engine
            # The first never noticed: the replica it claimed became ready, and is the only one.
            wait_for(lambda: [r.state for r in replicas()] == ["ready"], 30, "the first's replica ready")
            assert [r.pk for r in replicas()] == [claimed.pk]
            assert first.poll() is None
            assert "by another process" not in (tmp_path / "first.log").read_text()
        finally:
            for process in (second, first):
                if process is not None and process.poll() is None:
                    process.kill()  # its lease is of a host no other test uses
                    process.wait(5)
            for pid, _ in marked_engines(host, connection.settings_dict["NAME"]):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(os.getpgid(pid), signal.SIGKILL)

            def drop() -> None:
                Deployment.objects.filter(pk=deployment_id).delete()
                ModelVersion.objects.filter(model__name=name).delete()
                Model.objects.filter(name=name).delete()
                HostLease.objects.filter(host=host).delete()

            committed(django_db_blocker, drop)

    def test_an_expired_lease_is_taken_over_and_the_loser_stops_its_engines_without_a_write(
        self, make_supervisor, deployment, settings
    ):
        settings.WORKER_HOST_LEASE_SECONDS = 3.0
        messages: list[str] = []
        first = make_supervisor(report=messages.append)
        step_until(first, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        engine = first.engines[replica.pk].popen
        second = make_supervisor(host=first.host)
        first.step()  # renewed just now: held for the lease's 3 s, however loaded the machine
        with pytest.raises(HostLeaseHeld):
            second.step()
        assert second.engines == {}
        time.sleep(3.2)  # the first makes no pass (killed, or cut off) for longer than its lease
        second.step()  # takes the host over, and releases the replica no engine of its own serves
        assert HostLease.objects.get(host=first.host).holder == second.holder
        assert Replica.objects.get(pk=replica.pk).state == "stopped"
        rows = list(Replica.objects.order_by("pk").values())

        first.step()  # finds its lease gone
        assert first.lease_lost
        assert first.stopping
        assert any(m.startswith(f"LEASE LOST: host {first.host} was taken over") for m in messages), messages
        step_until(first, lambda: engine.poll() is not None)
        assert first._shutdown_step()  # run() would exit now (runworkers with status 1)
        assert list(Replica.objects.order_by("pk").values()) == rows  # not one write of the loser's
        first.close()  # gives up no lease of the second's
        assert HostLease.objects.get(host=first.host).holder == second.holder

    def test_a_supervisor_that_stops_cleanly_gives_its_host_up_at_once(self, make_supervisor, monkeypatch):
        monkeypatch.setattr("serving.supervisor.host.close_old_connections", lambda: None)
        first = make_supervisor()
        first.stopping = True
        first.run(once=True)  # takes the lease, has nothing to stop, releases the lease
        assert not HostLease.objects.filter(host=first.host).exists()
        second = make_supervisor(host=first.host)
        second.step()
        assert HostLease.objects.get(host=first.host).holder == second.holder

    def test_of_two_supervisors_taking_an_expired_lease_at_once_exactly_one_wins(self, django_db_blocker):
        host = unique_host()

        def expired(holder: str) -> None:
            HostLease.objects.update_or_create(host=host, defaults={
                "holder": holder, "taken_at": timezone.now(), "expires_at": timezone.now() - timedelta(seconds=1),
            })  # fmt: skip

        def take(holder: str, barrier: threading.Barrier) -> bool:
            """On a connection of its own, both takers' statements as close together as can be."""
            try:
                connection.ensure_connection()
                barrier.wait()
                return host_lease_take(host=host, holder=holder, seconds=60)
            finally:
                connection.close()

        try:
            for round_ in range(10):
                committed(django_db_blocker, lambda: expired("1@dead/0"))
                barrier = threading.Barrier(2)
                with django_db_blocker.unblock(), ThreadPoolExecutor(max_workers=2) as pool:
                    won = list(pool.map(take, [f"{round_}@a/1", f"{round_}@b/2"], [barrier, barrier]))
                assert sorted(won) == [False, True], won
        finally:
            committed(django_db_blocker, lambda: HostLease.objects.filter(host=host).delete())


class TestLostHosts:
    def test_a_host_whose_lease_expired_is_released_replaced_elsewhere_and_not_doubled_when_it_rejoins(
        self, make_supervisor, settings
    ):
        settings.WORKER_HOST_LEASE_SECONDS = 1.0
        deployment = create_deployment("lost-host-chat", replicas=2)
        lost = make_supervisor(slots=["0"])
        step_until(lost, lambda: len(ready_replicas(deployment)) == 1)
        (gone,) = ready_replicas(deployment)
        engine = lost.engines[gone.pk].popen
        survivor = make_supervisor(slots=["0", "1"])

        def both_ready() -> bool:
            lost.step()  # it renews its lease meanwhile: supervisors of other tests judge hosts too
            return len(ready_replicas(deployment)) == 2

        step_until(survivor, both_ready)
        assert {r.host for r in ready_replicas(deployment)} == {lost.host, survivor.host}

        # The lost host's supervisor makes no pass from now on (dead, or cut off from the
        # database): once its lease has expired, its replica is released (by this survivor, or
        # any other supervisor connected to the database) and replaced on the survivor's free slot.
        step_until(survivor, lambda: Replica.objects.get(pk=gone.pk).state == "stopped", timeout=10)
        entry = AuditEntry.objects.get(action="host.lost", target=lost.host)
        assert entry.after["replicas"] == [gone.pk]
        assert entry.actor_name == "engine supervisor"
        step_until(survivor, lambda: len(ready_replicas(deployment)) == 2)
        assert {r.host for r in ready_replicas(deployment)} == {survivor.host}

        # It rejoins: it renews its own lease, finds its replica released, stops its engine, and
        # claims nothing (the deployment holds what it wants).
        step_until(lost, lambda: engine.poll() is not None)
        for _ in range(5):
            lost.step()
            survivor.step()
        live = Replica.objects.filter(deployment=deployment).exclude(state="stopped")
        assert live.count() == 2
        assert {r.host for r in live} == {survivor.host}
        assert lost.engines == {}
        assert not lost.lease_lost
        assert HostLease.objects.get(host=lost.host).holder == lost.holder

    def test_only_a_supervisor_connected_for_a_whole_lease_judges_other_hosts(self, make_supervisor, monkeypatch):
        calls: list[str] = []

        def release(*, exclude: str, by: str) -> dict[str, int]:
            calls.append(exclude)
            return {}

        monkeypatch.setattr("serving.supervisor.lease.replica_release_lost_hosts", release)
        sup = make_supervisor(lease_seconds=5.0)
        now = time.monotonic()
        sup._db_reachable_since = None  # cut off from the database
        sup._release_lost_hosts(now)
        sup._db_reachable_since = now - 4.9  # back, but for less than a lease
        sup._lost_hosts_checked_at = float("-inf")
        sup._release_lost_hosts(now)
        assert calls == []
        sup._db_reachable_since = now - 5.1  # connected for a whole lease
        sup._lost_hosts_checked_at = float("-inf")
        sup._release_lost_hosts(now)
        assert calls == [sup.host]
        sup._release_lost_hosts(now + 0.5)  # at most once a second
        assert calls == [sup.host]

    def test_a_host_renewing_its_lease_is_never_taken_as_lost(self, make_supervisor, settings):
        settings.WORKER_HOST_LEASE_SECONDS = 1.0
        deployment = create_deployment("kept-host-chat", replicas=2)
        first, second = make_supervisor(slots=["0"]), make_supervisor(slots=["0"])
        step_until(first, lambda: len(ready_replicas(deployment)) == 1)

        def both_ready() -> bool:
            first.step()  # it renews its lease meanwhile, or the second (or any) supervisor rightly judges it lost
            return len(ready_replicas(deployment)) == 2

        step_until(second, both_ready)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            first.step()
            second.step()
            time.sleep(0.1)
        assert len(ready_replicas(deployment)) == 2
        assert not AuditEntry.objects.filter(action="host.lost", target__in=[first.host, second.host]).exists()


class TestWarmUp:
    def test_a_replica_answers_one_warm_up_request_before_it_is_routed(self, supervisor, deployment):
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        (replica,) = ready_replicas(deployment)
        stats = httpx.get(f"{replica.endpoint}/_stats", timeout=5).json()
        assert stats["warm_ups"] == ["/v1/completions"]
        assert stats["requests"] == 0  # not a customer's request

    def test_the_warm_up_tries_each_request_of_its_kind_and_gives_up_on_an_error(self):
        asked: list[tuple[str, dict[str, Any], str]] = []

        def answer(status: dict[str, int]) -> httpx.Client:
            def handle(request: httpx.Request) -> httpx.Response:
                asked.append((request.url.path, json.loads(request.content), request.headers["authorization"]))
                return httpx.Response(status.get(request.url.path, 200), json={})

            return httpx.Client(transport=httpx.MockTransport(handle))

        endpoint = "http://engine:8000"
        # A pooling (embedding) model refuses completions: its warm-up is an embedding.
        assert warm_up(answer({"/v1/completions": 404}), endpoint, VLLM, "embedder", 7)
        assert [(path, body["model"]) for path, body, _ in asked] == [
            ("/v1/completions", "embedder"), ("/v1/embeddings", "embedder")
        ]  # fmt: skip
        assert asked[0][2] == f"Bearer {replica_api_key(7)}"
        asked.clear()
        assert not warm_up(answer({"/v1/completions": 500}), endpoint, VLLM, "broken", 7)
        assert len(asked) == 1  # an engine error is not "unsupported": no second try
        assert not warm_up(answer({}), endpoint, PREDICT, "classifier", 7)  # a kind with no warm-up


class SlowStore(LocalArtifactStore):
    """A store whose artifacts are not on this host until ``arrive`` is set: ``local_path``
    waits for it, as a first download from an object store would (minutes for a large model)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root=root)
        self.arrive = threading.Event()
        self.fetched: set[str] = set()
        self.failures = 0  # the next downloads that fail
        self.released: list[str] = []

    def has_local_copy(self, uri: str) -> bool:
        return uri in self.fetched

    def local_path(self, uri: str) -> Path:
        if uri not in self.fetched:
            if self.failures:
                self.failures -= 1
                raise ArtifactUnavailable("the store did not answer")
            assert self.arrive.wait(30)
            self.fetched.add(uri)
        return super().local_path(uri)

    def release(self, uri: str) -> None:
        self.released.append(uri)


class TestWeightsFetchedBesideTheLoop:
    @pytest.fixture
    def slow_store(self, supervisor, tmp_path, monkeypatch) -> SlowStore:
        monkeypatch.setattr("serving.supervisor.weights.FETCH_RETRY_SECONDS", 0.3)
        store = SlowStore(tmp_path / "store")
        supervisor.weights = Weights(supervisor.report, store=store)
        return store

    def test_a_download_holds_up_no_heartbeat_and_the_replica_is_claimed_once_it_is_here(self, supervisor, slow_store):
        serving = create_deployment("fetched-first")
        slow_store.fetched.add(serving.version.artifact_uri)  # on this host already
        step_until(supervisor, lambda: len(ready_replicas(serving)) == 1)
        (running,) = ready_replicas(serving)

        waiting = create_deployment("fetched-later")
        beats = []
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the download does not end meanwhile
            supervisor.step()
            beats.append(Replica.objects.get(pk=running.pk).last_heartbeat)
            time.sleep(0.1)
        assert len(set(beats)) > 3, "the ready replica's heartbeat stopped during the download"
        assert not Replica.objects.filter(deployment=waiting).exists(), "claimed before its weights were here"

        slow_store.arrive.set()
        step_until(supervisor, lambda: len(ready_replicas(waiting)) == 1)
        engine = next(e for e in supervisor.engines.values() if e.deployment_id == waiting.pk)
        assert engine.artifact == waiting.version.artifact_uri
        assert slow_store.released == []  # both artifacts are used by an engine of this host

        deployment_transition(deployment=waiting, status=Deployment.Status.DRAINING)
        step_until(supervisor, lambda: engine.replica_id not in supervisor.engines)
        step_until(supervisor, lambda: slow_store.released == [waiting.version.artifact_uri])

    def test_a_failed_download_is_reported_claims_nothing_and_is_tried_again(self, supervisor, slow_store):
        reports: list[str] = []
        supervisor.report = supervisor.weights.report = reports.append
        slow_store.failures = 1
        slow_store.arrive.set()
        deployment = create_deployment("fetch-fails-once")
        step_until(supervisor, lambda: any("could not fetch" in r for r in reports))
        assert not Replica.objects.filter(deployment=deployment).exists()
        assert "the store did not answer" in next(r for r in reports if "could not fetch" in r)
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)  # tried again
        assert sum("fetching" in r for r in reports) == 2

    def test_nothing_is_fetched_for_a_deployment_that_holds_what_it_wants(self, supervisor, slow_store):
        deployment = create_deployment("held-elsewhere")
        Replica.objects.create(deployment=deployment, host="another-host", state=Replica.State.STARTING)
        for _ in range(5):
            supervisor.step()
        assert supervisor.weights._fetching == {}
        assert Replica.objects.filter(deployment=deployment).count() == 1


class TestOnePlatform:
    def test_runplatform_refuses_a_second_start_of_this_checkout(self, tmp_path):
        where = {"lock_path": tmp_path / "runplatform.lock", "host": "127.0.0.1", "port": free_port(),
                 "worker_host": unique_host()}  # fmt: skip
        first = claim_platform(**where)
        try:
            with pytest.raises(AlreadyRunning, match=f"runplatform pid {os.getpid()} serves this checkout"):
                claim_platform(**where)
        finally:
            first.close()  # as when the first ends, even killed: the kernel drops its lock
        claim_platform(**where).close()

    def test_runplatform_refuses_while_its_host_is_supervised_or_its_port_taken(self, make_supervisor, tmp_path):
        supervisor = make_supervisor()
        supervisor.take_lease()  # a runworkers of this host runs (a first platform's, or one by hand)
        with pytest.raises(AlreadyRunning, match=f"host {supervisor.host} are supervised by pid {os.getpid()} on "):
            claim_platform(lock_path=tmp_path / "1.lock", host="127.0.0.1", port=free_port(),
                           worker_host=supervisor.host)  # fmt: skip

        class Healthy(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/healthz" else 404)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        with http.server.HTTPServer(("127.0.0.1", 0), Healthy) as gateway:
            threading.Thread(target=gateway.serve_forever, daemon=True).start()
            try:
                with pytest.raises(
                    AlreadyRunning, match=f"a gateway already answers at http://127.0.0.1:{gateway.server_port}; "
                ):
                    claim_platform(lock_path=tmp_path / "2.lock", host="127.0.0.1", port=gateway.server_port,
                                   worker_host=unique_host())  # fmt: skip
            finally:
                gateway.shutdown()
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(AlreadyRunning, match="is taken by another program"):
                claim_platform(lock_path=tmp_path / "3.lock", host="127.0.0.1", port=taken.getsockname()[1],
                               worker_host=unique_host())  # fmt: skip


# --- LoRA adapters loaded into running engines (serving.supervisor.adapters) ----------------------


@pytest.fixture
def adapter_store(settings, tmp_path):
    """A throw-away artifact store: each adapter's folder (an adapter_config.json) lives there.
    Asked for before the supervisor, which takes the store there is when it is made."""
    from registry import artifacts

    settings.ARTIFACT_STORE = {
        "BACKEND": "registry.artifacts.LocalArtifactStore",
        "OPTIONS": {"root": str(tmp_path / "store")},
    }
    artifacts.get_artifact_store.cache_clear()
    yield artifacts.get_artifact_store()
    artifacts.get_artifact_store.cache_clear()


def create_adapter(store, base: ModelVersion, name: str, *, valid: bool = True) -> tuple[ModelVersion, Deployment]:
    """An adapter version on ``base`` (its files in ``store``) and its deployment."""
    from registry.models import Adapter

    OURS.add(name)
    source = Path(store.root) / ".." / f"src-{name}"
    source.mkdir(parents=True)
    (source / ("adapter_config.json" if valid else "config.json")).write_text('{"peft_type": "LORA", "r": 8}')
    stored = store.put_directory(source=source, key=f"{name}/1")
    model = Model.objects.create(name=name, task="chat")
    version = ModelVersion.objects.create(
        model=model, version="1", framework="lora", artifact_uri=stored.uri, artifact_sha256=stored.sha256,
        artifact_size=stored.size, config={},
    )  # fmt: skip
    Adapter.objects.create(version=version, base=base, rank=8)
    return version, deployment_create(version=version)


def loaded_on(replica: Replica) -> list[str]:
    return httpx.get(f"{replica.endpoint}/_stats", timeout=5).json()["loras"]


class TestAdapters:
    @pytest.fixture
    def base(self) -> Deployment:
        OURS.add("lora-base")
        model = Model.objects.create(name="lora-base", task="chat")
        version = ModelVersion.objects.create(
            model=model, version="1", framework="fake", artifact_uri="local://lora-base/1", artifact_sha256="0" * 64,
            artifact_size=1, config={"max_seq_len": 512},
        )  # fmt: skip
        return deployment_create(version=version, max_adapters=2)

    def test_an_adapter_is_loaded_into_the_running_base_and_routed_there(self, adapter_store, supervisor, base):
        from registry.adapters import lora_name
        from registry.models import LoadedAdapter
        from registry.selectors import adapter_replicas

        step_until(supervisor, lambda: len(ready_replicas(base)) == 1)
        replica = ready_replicas(base)[0]
        version, deployment = create_adapter(adapter_store, base.version, "lora-pirate")
        assert (deployment.replicas, deployment.max_replicas) == (0, 0)  # no engine of its own
        step_until(supervisor, lambda: LoadedAdapter.objects.filter(replica=replica, version=version).exists())
        assert loaded_on(replica) == [lora_name(version)]
        assert Replica.objects.filter(deployment=deployment).count() == 0
        assert [(r.pk, name) for r, name in adapter_replicas(version_ids=[version.pk])[version.pk]] == [
            (replica.pk, lora_name(version))
        ]
        deployment.refresh_from_db()
        version.refresh_from_db()
        assert (deployment.status, version.status) == ("running", "active")
        assert supervisor.engines[replica.pk].popen.pid == replica.pid  # the same engine: never restarted

    def test_a_restarted_engine_is_given_its_adapters_again(self, adapter_store, supervisor, base):
        from registry.models import LoadedAdapter
        from registry.selectors import adapter_replicas

        step_until(supervisor, lambda: len(ready_replicas(base)) == 1)
        replica = ready_replicas(base)[0]
        version, _ = create_adapter(adapter_store, base.version, "lora-restart")
        step_until(supervisor, lambda: LoadedAdapter.objects.filter(replica=replica, version=version).exists())
        os.killpg(replica.pid, signal.SIGKILL)
        step_until(supervisor, lambda: Replica.objects.get(pk=replica.pk).state == "failed")
        assert version.pk not in adapter_replicas(version_ids=[version.pk])  # never routed to the empty engine
        step_until(supervisor, lambda: Replica.objects.get(pk=replica.pk).state == "ready")
        restarted = Replica.objects.get(pk=replica.pk)
        assert restarted.pid is not None
        assert restarted.pid != replica.pid
        step_until(supervisor, lambda: LoadedAdapter.objects.filter(replica=replica, pid=restarted.pid).exists())
        assert loaded_on(restarted) == ["lora-restart@1"]

    def test_an_adapter_no_deployment_wants_is_unloaded(self, adapter_store, supervisor, base):
        from registry.models import LoadedAdapter

        step_until(supervisor, lambda: len(ready_replicas(base)) == 1)
        replica = ready_replicas(base)[0]
        version, deployment = create_adapter(adapter_store, base.version, "lora-leaving")
        kept, _ = create_adapter(adapter_store, base.version, "lora-staying")
        step_until(supervisor, lambda: LoadedAdapter.objects.filter(replica=replica).count() == 2)
        deployment_transition(deployment=deployment, status="draining")
        step_until(supervisor, lambda: not LoadedAdapter.objects.filter(version=version).exists())
        assert loaded_on(replica) == ["lora-staying@1"]
        assert LoadedAdapter.objects.filter(version=kept, replica=replica).exists()

    def test_an_adapter_the_engine_refuses_is_reported_and_never_routed(
        self, adapter_store, make_supervisor, base, monkeypatch
    ):
        from registry.models import LoadedAdapter
        from serving.supervisor import adapters

        monkeypatch.setattr(adapters, "RETRY_SECONDS", 0.5)
        said: list[str] = []
        sup = make_supervisor(report=said.append)
        step_until(sup, lambda: len(ready_replicas(base)) == 1)
        version, _ = create_adapter(adapter_store, base.version, "lora-broken", valid=False)
        step_until(sup, lambda: sum("could not load adapter lora-broken@1" in m for m in said) >= 2)  # tried again
        assert not LoadedAdapter.objects.filter(version=version).exists()
        assert loaded_on(ready_replicas(base)[0]) == []

    def test_a_base_that_takes_no_adapters_is_never_asked(self, adapter_store, supervisor, deployment):
        from registry.models import LoadedAdapter

        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        create_adapter(adapter_store, deployment.version, "lora-nowhere")
        for _ in range(10):
            supervisor.step()
            time.sleep(0.05)
        assert not LoadedAdapter.objects.filter(replica=replica).exists()  # other tests commit rows of theirs
        assert "loras" not in httpx.get(f"{replica.endpoint}/_stats", timeout=5).json() or loaded_on(replica) == []
