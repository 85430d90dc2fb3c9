"""Helpers of the tests that drive gateways and engines: data committed for other processes
to see, engines started and fake ones registered as replicas, prices, what a request left
behind (its usage record, an engine's counters), and ``chat``, the request most tests send."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from core import keys
from core.redis import sync_redis
from tests.support.processes import Gateway, child_env, free_port, start_process, start_runworkers, stop_process

ENGINE_READY_TIMEOUT = 600


@dataclass
class ApiKeyFixture:
    secret: str
    key_id: int
    organization_id: int


def committed(django_db_blocker: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a connection of its own and commit, so other processes see its writes.

    Inside a ``django_db`` test the test's connection is in a transaction that is rolled
    back, which a gateway process would never see. One transaction: a gateway reloading its
    routing table meanwhile sees all of ``fn``'s writes or none (a model whose replica row
    was not yet written answered 503).
    """
    from django.db import connection, transaction

    def run() -> Any:
        try:
            with transaction.atomic():
                return fn()
        finally:
            connection.close()

    with django_db_blocker.unblock(), ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


@dataclass
class Engines:
    process: subprocess.Popen[bytes]
    log_dir: Path
    replica_ids: dict[str, int]

    def endpoint(self, model: str, django_db_blocker: Any) -> str:
        from registry.models import Replica

        return committed(django_db_blocker, lambda: Replica.objects.get(pk=self.replica_ids[model]).endpoint)

    def key(self, model: str) -> str:
        """The replica's own API key (engines refuse /v1 without it)."""
        from registry.replica_keys import replica_api_key

        return replica_api_key(self.replica_ids[model])

    def direct(self, model: str, django_db_blocker: Any) -> openai.OpenAI:
        """An SDK client talking to the replica itself, bypassing the gateway."""
        return openai.OpenAI(
            base_url=f"{self.endpoint(model, django_db_blocker)}/v1",
            api_key=self.key(model),
            max_retries=0,
            timeout=120,
        )


def wait_for_ready_replicas(django_db_blocker: Any, deployment_ids: list[int], timeout: float) -> dict[int, int]:
    from registry.models import Replica

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = committed(
            django_db_blocker,
            lambda: dict(
                Replica.objects.filter(deployment_id__in=deployment_ids, state="ready").values_list(
                    "deployment_id", "id"
                )
            ),
        )
        if len(ready) == len(deployment_ids):
            return ready
        time.sleep(1)
    raise TimeoutError(f"replicas not ready within {timeout} s")


# LoRA adapters the session's chat engine (SmolLM2) runs in a batch: its engine starts with LoRA
# on, so tests/serving/test_adapters_real.py can load adapters into it while it runs.
SESSION_MAX_ADAPTERS = 2


def run_engines(bundled_models, django_db_blocker, tmp_path_factory) -> Iterator[Engines]:
    """The session's real engines (the ``engines`` fixture, defined in tests/conftest.py so that
    every directory shares one: a second instance would be a second supervisor of the same host,
    and the two would release each other's replicas)."""
    from registry.adapters import is_adapter_framework
    from registry.models import Deployment
    from registry.services import deployment_create

    # A bundled LoRA adapter has no engine of its own (a test deploys it onto SmolLM2's, whose
    # engine takes adapters: SESSION_MAX_ADAPTERS).
    versions = {n: v for n, v in bundled_models["versions"].items() if not is_adapter_framework(v.framework)}

    def deployments() -> dict[str, int]:
        out = {}
        for name, version in versions.items():
            existing = Deployment.objects.filter(version=version).first()
            adapters = SESSION_MAX_ADAPTERS if version.model.task == "chat" else 0
            out[name] = (existing or deployment_create(version=version, max_adapters=adapters)).pk
        return out

    deployment_ids = committed(django_db_blocker, deployments)
    log_dir = tmp_path_factory.mktemp("engines")
    with open(log_dir / "runworkers.log", "wb") as log:
        # Bound to this run: killed before its teardown, the run still leaves no supervisor
        # holding test-engines (the next run's would refuse to start beside it).
        process = start_runworkers(
            [], env=child_env(WORKER_HOST="test-engines", WORKER_LOG_DIR=str(log_dir), WORKER_SLOTS="0,1"), stdout=log
        )
    try:
        ready = wait_for_ready_replicas(django_db_blocker, list(deployment_ids.values()), ENGINE_READY_TIMEOUT)
    except TimeoutError:
        stop_process(process, grace=60)
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(log_dir.glob("*.log")))
        pytest.fail(f"engines did not start:\n{logs}")
    yield Engines(process, log_dir, {name: ready[dep] for name, dep in deployment_ids.items()})
    stop_process(process, grace=90)
    # Never leave an engine behind, even if runworkers died without draining.
    from registry.models import Replica

    pids = committed(
        django_db_blocker, lambda: list(Replica.objects.filter(host="test-engines").values_list("pid", flat=True))
    )
    for pid in pids:
        if pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


@dataclass
class FakeModel:
    name: str
    endpoint: str
    process: subprocess.Popen[bytes]
    replica_id: int

    def control(self, **state: Any) -> None:
        httpx.post(f"{self.endpoint}/_control", json=state, timeout=5).raise_for_status()

    def requests(self) -> int:
        return int(httpx.get(f"{self.endpoint}/_stats", timeout=5).json()["requests"])


def start_fake_engine(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    """A fake engine process and its URL; ``args``: more of its command line (``--api-key K``)."""
    port = free_port()
    process = start_process(
        [sys.executable, "-m", "tests.support.fake_engine", "--port", str(port), *args], env=dict(os.environ)
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{endpoint}/health", timeout=1).status_code == 200:
                return process, endpoint
        except httpx.HTTPError:
            time.sleep(0.1)
    stop_process(process, grace=0)
    raise RuntimeError("fake engine did not start")


def register_fake_replica(
    name: str,
    endpoint: str,
    *,
    task: str = "chat",
    max_seq_len: int = 1024,
    version: str = "1",
    artifact_uri: str | None = None,
    weight: int = 100,
) -> int:
    """A committed model → version → running deployment → ready replica at ``endpoint``.

    ``artifact_uri``: a real artifact (e.g. the bundled SmolLM2's) gives the gateway its
    tokenizer, so prompts are counted exactly; a second call with another ``version``
    adds a version to the same model.
    """
    from django.utils import timezone

    from registry.models import Deployment, Model, ModelVersion, Replica

    model, _ = Model.objects.get_or_create(name=name, defaults={"task": task})
    model_version = ModelVersion.objects.create(
        model=model, version=version, framework="fake", artifact_uri=artifact_uri or f"local://fake/{name}",
        artifact_sha256="0" * 64, artifact_size=0, config={"max_seq_len": max_seq_len}, status="active",
    )  # fmt: skip
    deployment = Deployment.objects.create(version=model_version, status="running", traffic_weight=weight)
    replica = Replica.objects.create(
        deployment=deployment, host="fake", endpoint=endpoint, state="ready", last_heartbeat=timezone.now()
    )
    return replica.pk


def price_model(name: str, *, input_per_million: str, output_per_million: str, **more: Any) -> Any:
    """Price a registered model from now on (call through ``committed`` so gateways see it)."""
    from billing.services import price_set
    from registry.models import Model

    return price_set(
        model=Model.objects.get(name=name),
        input_per_million=input_per_million,
        output_per_million=output_per_million,
        **more,
    )


def persisted(request_ids: list[str]) -> dict[str, Any]:
    """Flush the usage stream into the database; the records of these requests by id."""
    from billing.models import UsageRecord
    from billing.usage import persist_usage_stream

    deadline = time.monotonic() + 10
    records: dict[str, Any] = {}
    while time.monotonic() < deadline:
        persist_usage_stream()
        records = {str(r.request_id): r for r in UsageRecord.objects.filter(request_id__in=request_ids)}
        if len(records) == len(set(request_ids)):
            break
        time.sleep(0.2)
    return records


def request_id_of(chunk_id: str) -> str:
    """Our chunk ids are ``<prefix>-<request uuid hex>``."""
    return str(uuid.UUID(chunk_id.rsplit("-", 1)[1]))


def engine_counter(endpoint: str, metric: str) -> float:
    text = httpx.get(f"{endpoint}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(metric))


HELLO = [{"role": "user", "content": "hello"}]


def chat(gateway: Gateway, key: Any, model: str, *, stream: bool = False, timeout: float = 30, **body: Any) -> Any:
    """POST /v1/chat/completions through ``gateway`` with ``key`` (an object with ``secret``,
    or the secret itself); ``messages`` defaults to HELLO, ``body`` adds or overrides fields."""
    secret = key if isinstance(key, str) else key.secret
    return httpx.post(
        f"{gateway.base_url}/v1/chat/completions", timeout=timeout,
        json={"model": model, "messages": HELLO, "stream": stream, **body},
        headers={"Authorization": f"Bearer {secret}"},
    )  # fmt: skip


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition not reached") -> Any:
    """``condition()``'s first true value, polled every 50 ms; an AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def in_flight_of(key_id: int) -> list[dict[str, str]]:
    entries = [json.loads(raw) for raw in sync_redis().hvals(keys.inflight_requests())]
    return [e for e in entries if e.get("api_key_id") == str(key_id)]


def replica_in_flight(gateway, replica_id: int) -> float:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=5).text
    prefix = f'inference_replica_in_flight{{replica="{replica_id}"}}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


@dataclass
class CountedModel:
    """A fake engine behind a model whose prompts the gateway counts exactly (SmolLM2's tokenizer)."""

    name: str
    endpoint: str

    def control(self, **state: Any) -> None:
        httpx.post(f"{self.endpoint}/_control", json=state, timeout=5).raise_for_status()

    def requests(self) -> int:
        return int(httpx.get(f"{self.endpoint}/_stats", timeout=5).json()["requests"])
