"""Celery's queues apart: every task goes to a queue a worker reads, each beat entry expires
within its period, and a mail server that hangs holds up neither usage persistence nor a
canary's rollback (real workers and beat, started with runplatform's command lines)."""

from __future__ import annotations

import contextlib
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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from celery.exceptions import QueueNotFound
from celery.schedules import crontab
from django.conf import settings
from django.db import connection, transaction

from accounts.models import ApiKey, Organization
from accounts.services import api_key_create, organization_create
from billing.ledger import UsageEvent
from billing.models import BudgetAlert, UsageRecord
from console.celery import app
from console.management.commands.runplatform import celery_commands
from core import keys
from core.redis import sync_redis
from registry.models import AuditEntry, Deployment, Model, ModelVersion
from rollout.canary import canary_create
from rollout.models import Canary
from tests.support.processes import child_env, start_process

T = TypeVar("T")
QUEUES = {queue.name for queue in settings.CELERY_TASK_QUEUES}
# The workers' EMAIL_TIMEOUT: how long one send to a server that never answers holds the slow
# worker (longer than the checks made meanwhile).
EMAIL_TIMEOUT = 15.0


def app_tasks() -> set[str]:
    app.loader.import_default_modules()  # every app's tasks module, as a worker loads them
    return {name for name in app.tasks if not name.startswith("celery.")}


def queue_of(task: str) -> str:
    return str(app.amqp.router.route({}, task)["queue"].name)


class TestRouting:
    def test_every_task_is_routed_by_name_to_a_queue_a_worker_reads(self):
        tasks = app_tasks()
        assert tasks, "no task was discovered"
        # Named, not left to the default queue: whoever adds a task decides where it runs.
        assert set(settings.CELERY_TASK_ROUTES) == tasks
        read = {
            command[command.index("--queues") + 1]
            for name, command in celery_commands("python", beat_schedule=Path("schedule")).items()
            if name != "beat"
        }
        assert read == QUEUES
        assert {task: queue_of(task) for task in tasks} == {
            task: route["queue"] for task, route in settings.CELERY_TASK_ROUTES.items()
        }
        assert {queue_of(task) for task in tasks} <= QUEUES
        assert settings.CELERY_TASK_DEFAULT_QUEUE in QUEUES

    def test_metering_and_control_hold_only_the_short_loops(self):
        by_queue: dict[str, set[str]] = {}
        for task in app_tasks():
            by_queue.setdefault(queue_of(task), set()).add(task)
        assert by_queue["metering"] == {
            "billing.tasks.usage_persist", "billing.tasks.budget_alerts_persist", "serving.tasks.usage_sweep_lost",
        }  # fmt: skip
        assert by_queue["control"] == {"rollout.tasks.canary_tick", "rollout.tasks.autoscale_tick"}
        assert {
            "registry.tasks.bundled_models_import", "billing.tasks.invoice_email", "billing.tasks.budget_alerts_email",
            "billing.tasks.invoices_draft_due",
        } <= by_queue["slow"]  # fmt: skip

    def test_every_beat_entry_is_a_routed_task_that_expires_within_its_period(self):
        tasks = app_tasks()
        for name, entry in settings.CELERY_BEAT_SCHEDULE.items():
            assert entry["task"] in tasks, name
            assert queue_of(entry["task"]) in QUEUES, name
            expires = entry["options"]["expires"]
            if isinstance(entry["schedule"], crontab):
                assert 0 < expires <= 86400, name
            else:
                assert 0 < expires <= entry["schedule"], name

    def test_every_task_has_a_hard_time_limit(self):
        for task in app_tasks():
            assert app.tasks[task].time_limit, task

    def test_an_unknown_queue_is_refused_when_sent(self):
        with pytest.raises(QueueNotFound):
            app.amqp.router.route({"queue": "no-such-queue"}, "billing.tasks.usage_persist")


# --- Real workers ---------------------------------------------------------------------------


class StuckMailServer:
    """A mail server that accepts connections and never says a word (no 220 greeting)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = int(self.listener.getsockname()[1])
        self.accepted: list[float] = []  # monotonic times
        self.closed: list[float] = []  # when a client hung up
        self.connections: list[socket.socket] = []
        self.stopping = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopping:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections.append(conn)
            self.accepted.append(time.monotonic())
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        try:
            while conn.recv(4096):
                pass
        except OSError:
            return
        self.closed.append(time.monotonic())

    def close(self) -> None:
        self.stopping = True
        self.listener.close()
        for conn in self.connections:
            conn.close()


@dataclass
class CeleryProcesses:
    """The workers and beat, each in its own process group (its pool child goes with it)."""

    log_dir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, commands: dict[str, list[str]], env: dict[str, str]) -> None:
        for name, command in commands.items():
            with open(self.log_dir / f"{name}.log", "wb") as log:
                self.processes[name] = start_process(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}:\n{(self.log_dir / f'{name}.log').read_text(errors='replace')[-3000:]}"
            for name in self.processes
        )

    def check_alive(self) -> None:
        dead = {name: p.returncode for name, p in self.processes.items() if p.poll() is not None}
        assert not dead, f"exited: {dead}\n{self.logs()}"

    def stop(self) -> None:
        for process in self.processes.values():  # the beat first: nothing new is queued
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # a pool child left behind
            process.wait(5)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, processes: CeleryProcesses) -> float:
    """Poll ``predicate`` until it is true; the seconds it took."""
    started = time.monotonic()
    while not predicate():
        processes.check_alive()
        assert time.monotonic() - started < timeout, f"{what}: not within {timeout} s\n{processes.logs()}"
        time.sleep(0.1)
    return time.monotonic() - started


@dataclass
class Tenant:
    key: ApiKey
    model: Model
    canary_id: int


def committed(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a transaction on a connection of its own and commit, so that the workers
    see its writes (the test's own connection is in a transaction rolled back at the end)."""

    def run() -> T:
        try:
            with transaction.atomic():
                return fn()
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


@pytest.fixture
def tenant(db: None) -> Iterator[Tenant]:
    """Committed: an organisation with a billing address and a key, and a chat model whose v2
    is a canary at 50 %, judged every second on at least 20 requests an arm. Removed after."""
    tag = uuid.uuid4().hex[:8]

    def create() -> Tenant:
        org = organization_create(name=f"Queues {tag}")
        org.billing_email = "ap@queues.example"
        org.save()
        key = api_key_create(organization=org, name="traffic").api_key
        model = Model.objects.create(name=f"chat-{tag}", task="chat")
        for version, weight in (("v1", 100), ("v2", 0)):
            found = ModelVersion.objects.create(
                model=model, version=version, framework="fake", artifact_uri=f"local://{model.name}/{version}",
                artifact_sha256="0" * 64, artifact_size=1, status="active",
            )  # fmt: skip
            Deployment.objects.create(version=found, status="running", traffic_weight=weight)
        canary = canary_create(
            actor=None, model=model, base_version="v1", canary_version="v2", steps=[50, 100],
            interval_seconds=1, min_samples=20,
        )  # fmt: skip
        return Tenant(key=key, model=model, canary_id=canary.pk)

    tenant = committed(create)
    yield tenant
    committed(lambda: remove(tenant))


def remove(tenant: Tenant) -> None:
    key, model, org = tenant.key, tenant.model, tenant.key.organization_id
    UsageRecord.objects.filter(api_key=key).delete()
    Canary.objects.filter(model=model).delete()
    Deployment.objects.filter(version__model=model).delete()
    ModelVersion.objects.filter(model=model).delete()
    Model.objects.filter(pk=model.pk).delete()
    AuditEntry.objects.filter(target=model.name).delete()  # the canary's and its split's
    BudgetAlert.objects.filter(organization_id=org).delete()
    ApiKey.objects.filter(organization_id=org).delete()
    Organization.objects.filter(pk=org).delete()


def usage_event(key: ApiKey, model: Model, version: str, status_code: int) -> dict[str, str]:
    return UsageEvent(
        request_id=uuid.uuid4(), api_key_id=key.pk, organization_id=key.organization_id, model=model.name,
        model_version=version, endpoint="chat", prompt_tokens=12, completion_tokens=10 if status_code == 200 else 0,
        cached_tokens=0, latency_ms=100, ttft_ms=None, status_code=status_code, created_at=datetime.now(UTC),
        finish_reason="stop" if status_code == 200 else "",
    ).to_fields()  # fmt: skip


@pytest.mark.django_db
def test_a_stuck_mail_server_holds_up_neither_usage_nor_a_rollback(tenant, tmp_path):
    redis = sync_redis()
    # This session's broker and streams start empty: no message or entry of another test.
    app.control.purge()
    redis.delete("unacked", "unacked_index")
    redis.delete(keys.usage_stream(), keys.usage_dead_letters(), keys.budget_alerts(), keys.budget_alert_dead_letters())
    mail = StuckMailServer()
    processes = CeleryProcesses(tmp_path)
    env = child_env(
        EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend",
        EMAIL_HOST="127.0.0.1",
        EMAIL_PORT=str(mail.port),
        EMAIL_TIMEOUT=str(EMAIL_TIMEOUT),
    )
    commands = celery_commands(sys.executable, beat_schedule=tmp_path / "celerybeat-schedule")
    try:
        processes.start({"beat": commands.pop("beat"), **commands}, env)
        # The limiter raises a budget alert: the metering worker stores it and queues its
        # e-mail, which the slow worker sends to a server that never answers.
        key = tenant.key
        redis.xadd(
            keys.budget_alerts(),
            {"scope": "org", "id": str(key.organization_id), "org": str(key.organization_id), "budget": "tokens",
             "month": datetime.now(UTC).strftime("%Y-%m"), "threshold": "80", "limit": "1000", "used": "800"},
        )  # fmt: skip
        wait_for(lambda: mail.accepted, 60, "the slow worker connects to the mail server", processes)
        stuck_since = mail.accepted[0]

        # Meanwhile: 100 requests to v1, all answered; 40 to the canary v2, half of them 502.
        events = [usage_event(key, tenant.model, "v1", 200) for _ in range(100)]
        events += [usage_event(key, tenant.model, "v2", 502 if i % 2 else 200) for i in range(40)]
        pipe = redis.pipeline(transaction=False)
        for fields in events:
            pipe.xadd(keys.usage_stream(), fields)
        pipe.execute()
        request_ids = {uuid.UUID(fields["request_id"]) for fields in events}

        # Read on the test's connection: each statement sees what the workers committed.
        def persisted() -> bool:
            return UsageRecord.objects.filter(request_id__in=request_ids).count() == len(request_ids)

        def rolled_back() -> bool:
            return Canary.objects.get(pk=tenant.canary_id).status == Canary.Status.ROLLED_BACK

        persist_seconds = wait_for(persisted, 5, "usage persisted", processes)
        rollback_seconds = persist_seconds + wait_for(rolled_back, 8, "the canary rolled back", processes)

        # All of it while the slow worker was still stuck in the one send.
        assert len(mail.accepted) == 1
        assert mail.closed == [], f"the send ended before the check\n{processes.logs()}"
        alert = BudgetAlert.objects.get(organization_id=key.organization_id)
        assert alert.notified_at is None
        canary = Canary.objects.get(pk=tenant.canary_id)
        reasons = canary.decisions.order_by("-at", "-id").values_list("reasons", flat=True).first()
        assert any("error_rate worse" in reason for reason in reasons or []), reasons
        # EMAIL_TIMEOUT applies in the worker: it hangs up, and the alert stays unsent (retried later).
        wait_for(lambda: mail.closed, EMAIL_TIMEOUT + 10, "the slow worker gives up the send", processes)
        assert mail.closed[0] - stuck_since == pytest.approx(EMAIL_TIMEOUT, abs=3)
        alert.refresh_from_db()
        assert alert.notified_at is None
        print(f"usage persisted in {persist_seconds:.1f} s, rolled back in {rollback_seconds:.1f} s")
    finally:
        mail.close()
        processes.stop()
