"""A real batch worker for tests (``celery worker -Q batch``, as runplatform starts it) and the
openai SDK calls the batch tests make: wait for a batch, read its files, count its usage."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import orjson

from tests.support.processes import Gateway, child_env, start_process, stop_process

WORKER_ENV = {
    "BATCH_WORK_SECONDS": "3",
    "BATCH_LEASE_SECONDS": "3",
    "BATCH_SLOTS_PER_REPLICA": "4",
    "REPLICA_STALE_AFTER": "86400",
    "ROUTING_REFRESH_SECONDS": "0.2",
    "ENGINE_REQUEST_TIMEOUT": "10",
    "ENGINE_FIRST_TOKEN_TIMEOUT": "5",
    "CIRCUIT_COOLDOWN_SECONDS": "0.5",
}


class BatchWorker:
    """``celery worker -Q batch``, as runplatform starts it, kept busy by sending it batch_work."""

    def __init__(self, log_dir: Path, **env: str) -> None:
        self.log_path = log_dir / f"batch-worker-{uuid.uuid4().hex[:6]}.log"
        command = [sys.executable, "-m", "celery", "-A", "console", "worker", "--queues", "batch", "--concurrency",
                   "1", "--pool", "solo", "--loglevel", "WARNING", "--without-mingle", "--without-gossip",
                   "--hostname", f"batch-{uuid.uuid4().hex[:6]}@%h"]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.process = start_process(command, env=child_env(**{**WORKER_ENV, **env}), stdout=log,
                                         stderr=subprocess.STDOUT)  # fmt: skip

    def poke(self) -> None:
        from console.celery import app

        app.send_task("serving.tasks.batch_work", expires=2)

    def kill(self) -> None:
        stop_process(self.process, grace=0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def sdk_client(gateway: Gateway, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0, timeout=30)


def wait_for(client: openai.OpenAI, batch_id: str, worker: BatchWorker, *, until: set[str], timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        worker.poke()
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} stayed {batch.status}:\n{worker.log()[-3000:]}")


def results_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(line) for line in client.files.content(file_id).read().splitlines()]


def usage_of(batch_public_id: str, lines: int, attempts: int = 5) -> list[Any]:
    """The usage records of a batch's lines (any attempt), after persisting the stream."""
    from billing.models import UsageRecord
    from billing.usage import persist_usage_stream
    from serving.batches.services import line_request_id

    persist_usage_stream()
    ids = [line_request_id(batch_public_id, i, a) for i in range(lines) for a in range(1, attempts + 1)]
    return list(UsageRecord.objects.filter(request_id__in=ids))


def inflight_of(batch_public_id: str, lines: int, attempts: int = 5) -> int:
    from core import keys
    from core.redis import sync_redis
    from serving.batches.services import line_request_id

    ids = {str(line_request_id(batch_public_id, i, a)) for i in range(lines) for a in range(1, attempts + 1)}
    held = {k.decode() for k in sync_redis().hkeys(keys.inflight_requests())}
    return len(ids & held)
