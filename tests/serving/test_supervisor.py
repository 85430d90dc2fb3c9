"""runworkers' supervisor, driven step by step with the fake engine as the launched program."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from registry.models import Deployment, Model, ModelVersion, Replica
from registry.services import deployment_create, deployment_transition
from serving.supervisor import Supervisor

pytestmark = pytest.mark.django_db


@pytest.fixture
def fake_launcher(settings, tmp_path):
    settings.WORKER_ENGINE_LAUNCHER = f"{sys.executable} -m tests.fake_engine"
    settings.WORKER_HEARTBEAT_SECONDS = 0.2
    settings.WORKER_DRAIN_TIMEOUT = 5
    settings.WORKER_MAX_BACKOFF = 1
    return tmp_path


@pytest.fixture
def deployment() -> Deployment:
    model = Model.objects.create(name="tiny-chat", task="chat")
    version = ModelVersion.objects.create(
        model=model, version="1", framework="fake", artifact_uri="local://tiny-chat/1", artifact_sha256="0" * 64,
        artifact_size=1, config={"max_seq_len": 512},
    )  # fmt: skip
    return deployment_create(version=version, replicas=1, max_replicas=2)


@pytest.fixture
def supervisor(fake_launcher):
    sup = Supervisor(host="test-host", slots=["0", "1"], log_dir=fake_launcher, report=lambda m: None)
    yield sup
    for engine in list(sup.engines.values()):
        sup._kill(engine)


def step_until(sup: Supervisor, condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sup.step()
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached")


def ready_replicas(deployment: Deployment) -> list[Replica]:
    return list(Replica.objects.filter(deployment=deployment, state="ready"))


class TestSupervisor:
    def test_it_starts_a_replica_and_marks_everything_live(self, supervisor, deployment):
        step_until(supervisor, lambda: len(ready_replicas(deployment)) == 1)
        replica = ready_replicas(deployment)[0]
        assert replica.host == "test-host"
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
        monkeypatch.setattr("serving.supervisor.close_old_connections", lambda: None)
        Replica.objects.create(deployment=deployment, host="test-host", state="ready", endpoint="http://x")
        sup = Supervisor(host="test-host", slots=["0"], log_dir=fake_launcher, report=lambda m: None)
        sup.stopping = True  # run() releases, then finds nothing to stop
        sup.run(once=True)
        assert set(Replica.objects.filter(deployment=deployment).values_list("state", flat=True)) == {"stopped"}
