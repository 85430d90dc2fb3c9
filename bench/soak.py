"""The soak of issue 18: N mixed requests against the fake engine; nothing may grow or be lost.

One gateway (uvicorn, as `make run` starts it) serves two models whose replicas are fake
vLLM servers (``tests/support/fake_engine.py``): ``soak-chat``, which counts prompts with the
bundled SmolLM2's tokenizer (so the semantic cache may answer it), and ``soak-embed``, the
cache's embedding model. A persister process moves the usage stream into PostgreSQL once a
second, as the Celery metering worker does (``billing.usage.persist_usage_stream``). An
async client keeps ``--concurrency`` requests in flight until ``--requests`` were made,
drawn at random (``--seed``) from this mix (``--mix`` changes it):

- ``json``: chat completions, one JSON answer;
- ``sse``: chat completions streamed, with the usage chunk;
- ``websocket``: chat completions over ``/ws/v1/chat/completions`` (each worker keeps a
  socket for ``--ws-requests-per-socket`` requests, then opens a new one);
- ``embeddings``: one or two inputs from a small set (so the exact-match cache answers some);
- ``cache``: the same few questions at temperature 0, JSON and streamed: after the first
  answer of each is stored, ``x-cache: hit``;
- ``throttled``: JSON chat completions with a second key limited to ``--throttled-rpm``
  requests a minute: most of them are refused with 429.

Every ``--sample-every`` seconds the gateway process is sampled: RSS, open file
descriptors, TCP connections (psutil), asyncio tasks (its ``gateway_asyncio_tasks`` gauge
at /metrics), PostgreSQL connections to the soak's database (``pg_stat_activity``) and
Redis connections on the soak's Redis database (``CLIENT LIST``), the soak's own client
connections left out of both. The steady state (median of the second tenth of the
samples, after warm-up) is compared with the end (median of the last tenth).

Then the metering is checked: every request the client saw admitted (a 200, a WebSocket
``usage`` frame) has exactly one ``UsageRecord``, no refused request has one, the gateway
handed exactly as many events to the stream as there are records, the persister stored
each once, nothing is left in flight or in the dead-letter stream.

It exits non-zero when a judged figure grows by ``--max-growth`` (10 %) or more (a connection
count one above its steady state is a pool taking one more, not growth), a request is lost or
metered twice, a request failed, or the gateway or the persister logged an error.

Isolation: its own database (``inference_soak``, created and migrated on first use) on the
same PostgreSQL server, Redis database 8 with the namespace ``ip-soak``, and its own
artifact store (``var/soak/artifacts``: SmolLM2 is converted into it once, about a
minute). Each run makes a new organisation, so nothing of an earlier run (cache entries,
usage) counts. A running platform and the tests are never touched.

    make soak                                                  # 100,000 requests
    make soak SOAK_ARGS="--requests 5000"
    .venv/bin/python bench/soak.py --requests 20000 --concurrency 16

Writes bench/results/soak-<time>.json and .md (git-ignored) and prints the tables; the
processes' logs stay in var/soak/run-<time>/. docs/reliability.md has a full run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import signal
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import httpx
import mock_suite
import orjson
import psutil
from mock_suite import ROOT, Server, django_setup, free_port, report_start, spawn, wait_http, write_report

logger = logging.getLogger("soak")

SOAK_DATABASE = "inference_soak"
SOAK_REDIS_DB = 8  # the platform uses 0, the test sessions 9 to 15
SOAK_NAMESPACE = "ip-soak"
CHAT_MODEL = "soak-chat"
EMBED_MODEL = "soak-embed"
SOAK_HOST = "soak"

DEFAULT_MIX = {"json": 30, "sse": 25, "websocket": 15, "embeddings": 10, "cache": 10, "throttled": 10}
# What the verdict is made of; the other sampled figures are shown for information.
JUDGED = ("rss_mib", "open_fds", "tcp_connections", "asyncio_tasks", "db_connections", "redis_connections")
LABELS = {
    "rss_mib": "RSS (MiB)", "open_fds": "open file descriptors", "tcp_connections": "TCP connections",
    "asyncio_tasks": "asyncio tasks", "db_connections": "PostgreSQL connections (pg_stat_activity)",
    "redis_connections": "Redis connections (CLIENT LIST)", "gateway_db_sockets": "gateway sockets to PostgreSQL",
    "gateway_redis_sockets": "gateway sockets to Redis", "threads": "threads",
}  # fmt: skip
CACHE_QUESTIONS = [
    "Why is the sky blue?",
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level?",
    "Who wrote Pride and Prejudice?",
    "What is the largest planet in the solar system?",
]
EMBEDDING_TEXTS = [f"soak sentence number {n} about {topic}" for n in range(40) for topic in ("cats", "rain")]
# An error a process logged: Django's and uvicorn's formats both name the level.
# A warning's traceback (a heartbeat that failed once) is not one.
ERROR_LINE = re.compile(r"^(\S+ \S+ )?(ERROR|CRITICAL)\b")


# --- isolation and setup -------------------------------------------------------------------


def isolate() -> None:
    """Point this process and every child at the soak's own database, Redis database,
    namespace and artifact store; call before Django is set up."""
    mock_suite.isolate(database=SOAK_DATABASE, redis_db=SOAK_REDIS_DB, namespace=SOAK_NAMESPACE,
                       artifacts="soak/artifacts")  # fmt: skip


def database_prepare() -> None:
    mock_suite.database_prepare(SOAK_DATABASE)


def serve_model(name: str, task: str, endpoint: str, artifact_uri: str) -> None:
    """``name`` version 1, running, with one ready replica at ``endpoint`` (re-pointed on every run)."""
    from django.utils import timezone

    from billing.models import Price
    from billing.services import price_set
    from registry.models import Deployment, Model, ModelVersion, Replica

    model, _ = Model.objects.get_or_create(name=name, defaults={"task": task, "owner": "soak"})
    version, _ = ModelVersion.objects.update_or_create(
        model=model, version="1",
        defaults={"framework": "fake", "artifact_uri": artifact_uri, "artifact_sha256": "0" * 64, "artifact_size": 0,
                  "config": {"max_seq_len": 2048}, "status": "active"},
    )  # fmt: skip
    deployment = Deployment.objects.filter(version=version).first() or Deployment(version=version)
    deployment.status, deployment.replicas, deployment.traffic_weight = "running", 1, 100
    deployment.save()
    replica = Replica.objects.filter(deployment=deployment, host=SOAK_HOST).first() or Replica(
        deployment=deployment, host=SOAK_HOST
    )
    replica.endpoint, replica.state, replica.last_heartbeat = endpoint, "ready", timezone.now()
    replica.save()
    if not Price.objects.filter(model=model).exists():
        price_set(model=model, input_per_million="0.10", output_per_million="0.30", cached_input_per_million="0.05")


def platform_setup(chat_endpoint: str, embed_endpoint: str, throttled_rpm: int) -> tuple[dict[str, str], list[int]]:
    """The two models, a new organisation and its two keys: ``main`` (limits far above the run)
    and ``throttled`` (``throttled_rpm`` requests a minute). Returns the secrets and the key ids."""
    from decimal import Decimal

    from accounts.services import api_key_create, organization_create
    from registry.bundled import BUNDLED_MODELS, SMOLLM2, import_bundled_model

    smollm2 = next(b for b in BUNDLED_MODELS if b.name == SMOLLM2)
    tokenizer = import_bundled_model(smollm2, progress=lambda line: print(f"  {line}", flush=True))
    serve_model(CHAT_MODEL, "chat", chat_endpoint, tokenizer.artifact_uri)
    serve_model(EMBED_MODEL, "embedding", embed_endpoint, f"local://soak/{EMBED_MODEL}")
    huge = 10**12
    limits: dict[str, Any] = {
        "rate_limit_rpm": huge, "rate_limit_tpm": huge, "max_concurrent": 100_000,
        "monthly_token_quota": huge * 1000, "monthly_spend_cap": Decimal("10000000"),
    }  # fmt: skip
    # The organisation's own limits are its plan: without them its keys are held to its
    # tier's Plan (10,000 requests a minute for paid), which the soak goes past.
    org = organization_create(name=f"Soak {time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}", **limits)
    main = api_key_create(organization=org, name="main", **limits)
    throttled = api_key_create(organization=org, name="throttled", rate_limit_rpm=throttled_rpm, rate_limit_tpm=huge)
    secrets = {"main": main.secret, "throttled": throttled.secret}
    return secrets, [main.api_key.pk, throttled.api_key.pk]


def retire_models() -> None:
    """Stop the soak's deployments: their replicas were the fake engines, gone with the run."""
    from registry.models import Deployment, Replica

    names = (CHAT_MODEL, EMBED_MODEL)
    Replica.objects.filter(deployment__version__model__name__in=names, host=SOAK_HOST).update(state="stopped")
    Deployment.objects.filter(version__model__name__in=names).update(status="stopped")


def start_fake_engine(workdir: Path, name: str, tokens: int) -> Server:
    port = free_port()
    log = workdir / f"{name}.log"
    proc = spawn([sys.executable, "-m", "tests.support.fake_engine", "--port", str(port)], log)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/health", proc, f"fake engine ({name})")
    httpx.post(f"{base}/_control", json={"tokens": tokens}, timeout=5).raise_for_status()
    return Server(name, base, "", name, proc, log)


def start_gateway(workdir: Path) -> Server:
    from console.servers import server_command

    port = free_port()
    env = {
        "REPLICA_STALE_AFTER": "86400",  # the fake engines have no supervisor sending heartbeats
        "SEMANTIC_CACHE_EMBEDDING_MODEL": EMBED_MODEL,
        # The fake engines have no queue to protect; the soak measures the path, not backpressure.
        "BACKPRESSURE_PAID_PER_REPLICA": "100000",
        "BACKPRESSURE_FREE_PER_REPLICA": "100000",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = server_command(sys.executable, host="127.0.0.1", port=port, server="uvicorn")
    log = workdir / "gateway.log"
    proc = spawn(cmd, log, env)
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, "gateway")
    return Server("gateway", f"http://127.0.0.1:{port}", "", CHAT_MODEL, proc, log)


def start_persister(workdir: Path) -> tuple[Server, Path]:
    status = workdir / "persister.json"
    log = workdir / "persister.log"
    proc = spawn([sys.executable, str(Path(__file__).resolve()), "--persister", str(status)], log)
    return Server("persister", "", "", "", proc, log), status


# --- the persister (a process of its own) --------------------------------------------------


def run_persister(status_path: Path) -> None:
    """What the Celery metering worker does with ``billing.tasks.usage_persist``: move the
    usage stream into UsageRecords once a second, until SIGTERM. Writes its totals (events
    handled, which counts an event already stored again too) to ``status_path``."""
    django_setup()
    from billing.usage import persist_usage_stream

    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    totals = {"handled": 0, "runs": 0, "failed_runs": 0}
    while not stopping:
        try:
            totals["handled"] += persist_usage_stream()
        except Exception:
            totals["failed_runs"] += 1
            logger.exception("persisting the usage stream failed")
        totals["runs"] += 1
        partial = status_path.with_suffix(".tmp")
        partial.write_text(json.dumps(totals))
        partial.replace(status_path)
        time.sleep(1.0)


# --- sampling ------------------------------------------------------------------------------


@dataclass
class Sampler:
    """Samples the gateway process and the soak's PostgreSQL and Redis connections."""

    gateway: Server
    pg_port: int
    redis_port: int
    _db: Any = None
    _redis: Any = None

    def _own_ports(self, service_port: int) -> set[int]:
        """Local ports of this process's own connections to a service, left out of its count.
        Only those: Linux gives one local port to several connections to different servers, so
        one of the client's sockets to the gateway may share a port with the gateway's to Redis."""
        conns = psutil.Process().net_connections(kind="tcp")
        return {c.laddr.port for c in conns if c.laddr and c.raddr and c.raddr.port == service_port}

    def services(self) -> dict[str, int]:
        import psycopg
        import redis

        if self._db is None:
            self._db = psycopg.connect(os.environ["DATABASE_URL"], autocommit=True)
            self._redis = redis.Redis.from_url(os.environ["REDIS_URL"])
        own_db, own_redis = self._own_ports(self.pg_port), self._own_ports(self.redis_port)
        ports = self._db.execute(
            "SELECT client_port FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'",
            [SOAK_DATABASE],
        ).fetchall()
        clients = self._redis.client_list()
        return {
            "db_connections": sum(1 for (port,) in ports if port not in own_db),
            "redis_connections": sum(
                1
                for c in clients
                if c["db"] == str(SOAK_REDIS_DB) and int(c["addr"].rsplit(":", 1)[1]) not in own_redis
            ),
        }

    def process(self) -> dict[str, float]:
        proc = psutil.Process(self.gateway.proc.pid)
        conns = proc.net_connections(kind="tcp")
        return {
            "rss_mib": proc.memory_info().rss / 2**20,
            "open_fds": proc.num_fds(),
            "tcp_connections": len(conns),
            "gateway_db_sockets": sum(1 for c in conns if c.raddr and c.raddr.port == self.pg_port),
            "gateway_redis_sockets": sum(1 for c in conns if c.raddr and c.raddr.port == self.redis_port),
            "threads": proc.num_threads(),
            "cpu_s": sum(proc.cpu_times()[:2]),
        }

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._redis.close()


async def gateway_metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """The gateway's own gauges and counters that the soak reads, from /metrics."""
    async with session.get(f"{base}/metrics") as response:
        text = await response.text()
    wanted: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("gateway_asyncio_tasks "):
            wanted["asyncio_tasks"] = float(line.split()[1])
        elif line.startswith("inference_usage_events_total{"):
            wanted["usage_events"] = wanted.get("usage_events", 0.0) + float(line.split()[-1])
    return wanted


# --- the load ------------------------------------------------------------------------------


class RequestFailed(Exception):
    """The gateway answered something a client of this mix must never see."""


@dataclass
class Tally:
    """What the client saw: per kind, outcomes and latencies; which request ids were admitted."""

    admitted: set[str] = field(default_factory=set)  # request ids that must have one UsageRecord
    refused: set[str] = field(default_factory=set)  # 429s: must have none
    failed_ids: set[str] = field(default_factory=set)
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the first few, for the report
    failure_count: int = 0
    done: int = 0

    def note(self, kind: str, outcome: str, seconds: float) -> None:
        self.outcomes.setdefault(kind, Counter())[outcome] += 1
        self.latencies.setdefault(kind, []).append(seconds)
        self.done += 1

    def fail(self, kind: str, what: str, request_id: str | None) -> None:
        self.failure_count += 1
        if len(self.failures) < 20:
            self.failures.append(f"{kind}: {what}")
        if request_id:
            self.failed_ids.add(request_id)


def request_id_of(value: str | None) -> str | None:
    return uuid.UUID(value).hex if value else None


class ChatSocket:
    """A worker's WebSocket, read all the time as a real client's is: aiohttp answers the
    server's pings only while something reads, and uvicorn closes a socket whose pings go
    unanswered for 40 s."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.used = 0
        self.frames: asyncio.Queue[aiohttp.WSMessage] = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            self.frames.put_nowait(message)
            if message.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                return

    @property
    def usable(self) -> bool:
        return not self.ws.closed and not self.reader.done()

    async def next_frame(self, within: float) -> dict[str, Any]:
        async with asyncio.timeout(within):
            message = await self.frames.get()
        if message.type != aiohttp.WSMsgType.TEXT:
            raise RequestFailed(f"the socket ended ({message.type!r}, {message.data!r}) before the usage frame")
        frame: dict[str, Any] = orjson.loads(message.data)
        return frame

    async def close(self) -> None:
        await self.ws.close()
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reader


@dataclass
class Load:
    base: str
    keys: dict[str, str]
    plan: list[str]
    ws_requests_per_socket: int
    tally: Tally = field(default_factory=Tally)
    next_index: int = 0

    def take(self) -> int | None:
        if self.next_index >= len(self.plan):
            return None
        self.next_index += 1
        return self.next_index - 1

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[key]}", "Content-Type": "application/json"}

    async def post(
        self, session: aiohttp.ClientSession, path: str, key: str, body: dict[str, Any]
    ) -> tuple[int, str | None, str | None, bytes]:
        """POST; returns the status, request id, x-cache and the whole body (a stream read to its end)."""
        async with session.post(f"{self.base}{path}", data=orjson.dumps(body), headers=self.headers(key)) as r:
            data = await r.read()
            return r.status, request_id_of(r.headers.get("x-request-id")), r.headers.get("x-cache"), data

    @staticmethod
    def check_answer(kind: str, stream: bool, data: bytes) -> None:
        if stream:
            if not data.rstrip().endswith(b"data: [DONE]") or b'data: {"error"' in data:
                raise RequestFailed(f"a stream that did not end well: {data[-300:]!r}")
        elif not orjson.loads(data).get("choices" if kind != "embeddings" else "data"):
            raise RequestFailed(f"an answer without choices: {data[:300]!r}")

    async def chat(self, session: aiohttp.ClientSession, kind: str, index: int) -> str:
        # Each cache question is asked both ways. Only the JSON answers are stored: the fake
        # engine's streams end with no finish_reason, and a stream is stored only when it has one.
        stream = kind == "sse" or (kind == "cache" and index % 2 == 1)
        body: dict[str, Any] = {"model": CHAT_MODEL, "max_tokens": 16}
        if kind == "cache":
            question = CACHE_QUESTIONS[index // 2 % len(CACHE_QUESTIONS)]
            body |= {"messages": [{"role": "user", "content": question}], "temperature": 0}
        else:  # a prompt of its own, at a temperature the cache never serves
            content = f"Say hello to soak request {index}, briefly please."
            body |= {"messages": [{"role": "user", "content": content}], "temperature": 1.0}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        key = "throttled" if kind == "throttled" else "main"
        status, request_id, cache, data = await self.post(session, "/v1/chat/completions", key, body)
        if status == 429 and kind == "throttled":
            if request_id:
                self.tally.refused.add(request_id)
            return "429"
        if status != 200 or request_id is None:
            raise RequestFailed(f"{status} (request {request_id}): {data[:300]!r}", request_id)
        self.check_answer(kind, stream, data)
        self.tally.admitted.add(request_id)
        return f"200 {cache}" if kind == "cache" else "200"

    async def embeddings(self, session: aiohttp.ClientSession, index: int) -> str:
        rng = random.Random(index)
        texts = rng.sample(EMBEDDING_TEXTS, 1 + index % 2)
        body = {"model": EMBED_MODEL, "input": texts[0] if len(texts) == 1 else texts}
        status, request_id, cache, data = await self.post(session, "/v1/embeddings", "main", body)
        if status != 200 or request_id is None:
            raise RequestFailed(f"{status} (request {request_id}): {data[:300]!r}", request_id)
        self.check_answer("embeddings", False, data)
        self.tally.admitted.add(request_id)
        return f"200 {cache}"

    async def websocket(self, socket: ChatSocket, index: int) -> str:
        client_id = f"r{index}"
        content = f"Say hello to soak socket request {index}, briefly please."
        body = {"model": CHAT_MODEL, "max_tokens": 16, "temperature": 1.0,
                "messages": [{"role": "user", "content": content}]}  # fmt: skip
        await socket.ws.send_str(orjson.dumps({"type": "chat.completion", "id": client_id, "body": body}).decode())
        chunks = 0
        while True:
            frame = await socket.next_frame(within=60)
            if frame.get("id") != client_id:
                raise RequestFailed(f"a frame of another request: {frame}")
            if frame["type"] == "chunk":
                chunks += 1
            elif frame["type"] == "error":
                # Refused before admission, it is the final frame; after admission a usage frame follows.
                with contextlib.suppress(TimeoutError, RequestFailed):
                    following = await socket.next_frame(within=5)
                    if following.get("type") == "usage":
                        frame["request_id"] = following["request_id"]
                        self.tally.admitted.add(uuid.UUID(following["request_id"]).hex)
                raise RequestFailed(f"error frame: {frame}", request_id_of(frame.get("request_id")))
            elif frame["type"] == "usage":
                request_id = uuid.UUID(frame["request_id"]).hex
                self.tally.admitted.add(request_id)
                if frame["status"] != "completed" or frame["status_code"] != 200 or not chunks:
                    raise RequestFailed(f"usage frame {frame} after {chunks} chunks", request_id)
                return "200"

    async def worker(self, session: aiohttp.ClientSession, sockets: aiohttp.ClientSession) -> None:
        """Requests one after another until the plan is done; WebSockets on ``sockets``, whose
        connections are apart from ``session``'s pool (an open socket holds its connection)."""
        socket: ChatSocket | None = None
        try:
            while (index := self.take()) is not None:
                kind = self.plan[index]
                started = time.perf_counter()
                try:
                    if kind == "websocket":
                        if socket is None or not socket.usable or socket.used >= self.ws_requests_per_socket:
                            if socket is not None:
                                await socket.close()
                            socket = ChatSocket(await sockets.ws_connect(
                                f"{self.base.replace('http', 'ws', 1)}/ws/v1/chat/completions",
                                headers={"Authorization": f"Bearer {self.keys['main']}"},
                            ))  # fmt: skip
                        socket.used += 1
                        outcome = await self.websocket(socket, index)
                    elif kind == "embeddings":
                        outcome = await self.embeddings(session, index)
                    else:
                        outcome = await self.chat(session, kind, index)
                except (RequestFailed, aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
                    request_id = exc.args[1] if isinstance(exc, RequestFailed) and len(exc.args) > 1 else None
                    self.tally.fail(kind, str(exc.args[0]) if exc.args else repr(exc), request_id)
                    outcome = "failed"
                    if kind == "websocket" and socket is not None:
                        await socket.close()  # its state is unknown: the next request gets a new socket
                        socket = None
                self.tally.note(kind, outcome, time.perf_counter() - started)
        finally:
            if socket is not None:
                await socket.close()


async def drive(
    load: Load, sampler: Sampler, concurrency: int, sample_every: float, progress_every: float
) -> tuple[list[dict[str, float]], float]:
    """Run the load with the sampler beside it; returns the samples and the load's duration."""
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sockets,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as scraper,
    ):
        workers = [asyncio.create_task(load.worker(session, sockets)) for _ in range(concurrency)]
        last_print = started
        while not all(w.done() for w in workers):
            await asyncio.wait(workers, timeout=sample_every)
            if all(w.done() for w in workers):
                break
            sample: dict[str, float] = {"t": time.monotonic() - started, "requests": load.tally.done}
            sample |= await asyncio.to_thread(sampler.process)
            sample |= await asyncio.to_thread(sampler.services)
            sample |= await gateway_metrics(scraper, load.base)
            samples.append(sample)
            if time.monotonic() - last_print >= progress_every:
                last_print = time.monotonic()
                rate = load.tally.done / (last_print - started)
                print(
                    f"  {load.tally.done:>7,} / {len(load.plan):,} requests  {rate:5.0f} req/s  "
                    f"RSS {sample['rss_mib']:.1f} MiB  fds {sample['open_fds']:.0f}  "
                    f"tcp {sample['tcp_connections']:.0f}  tasks {sample.get('asyncio_tasks', float('nan')):.0f}  "
                    f"pg {sample['db_connections']:.0f}  redis {sample['redis_connections']:.0f}  "
                    f"failed {load.tally.failure_count}",
                    flush=True,
                )
        for w in workers:
            w.result()  # a bug in the client itself surfaces here
    return samples, time.monotonic() - started


# --- the verdict ---------------------------------------------------------------------------


def growth_table(samples: list[dict[str, float]], max_growth: float) -> list[dict[str, Any]]:
    """Steady state (the second tenth of the samples, after warm-up) against the end (the last
    tenth): medians of the sampled figures; for the rates, over each window as a whole."""
    n = len(samples)
    tenth = max(1, n // 10)
    steady, end = samples[tenth : 2 * tenth] or samples[:1], samples[-tenth:]
    rows = []
    for metric in LABELS:
        before = [s[metric] for s in steady if metric in s]
        after = [s[metric] for s in end if metric in s]
        if not before or not after:
            continue
        rows.append(_row(metric, samples[0].get(metric), statistics.median(before), statistics.median(after)))
    # Whether each request costs the gateway more at the end (a structure that grows and is
    # walked): rates over the same windows, at least two samples each.
    if n >= 4:
        windows = (samples[tenth : max(2 * tenth, tenth + 2)], samples[-max(tenth, 2) :])
        for metric, label, per, scale in (("cpu_s", "gateway CPU per request (ms)", "requests", 1000),
                                          ("requests", "requests per second", "t", 1)):  # fmt: skip
            rates = [_window_rate(window, metric, per) * scale for window in windows]
            rows.append(_row(metric, None, rates[0], rates[1], label=label))
    for row in rows:
        # A count one above its steady state is a pool that took one more connection (each is
        # bounded), not a leak, which adds one per so many requests, all run long.
        row["grew"] = (
            row["judged"]
            and row["growth"] >= max_growth
            and (row["metric"] == "rss_mib" or row["end"] - row["steady"] > 1)
        )
    return rows


def _window_rate(window: list[dict[str, float]], metric: str, per: str) -> float:
    return (window[-1][metric] - window[0][metric]) / ((window[-1][per] - window[0][per]) or 1)


def _row(metric: str, first: float | None, steady: float, end: float, label: str | None = None) -> dict[str, Any]:
    growth = (end / steady - 1) if steady else (0.0 if end == 0 else float("inf"))
    return {"metric": metric, "label": label or LABELS[metric], "first": first, "steady": steady, "end": end,
            "growth": growth, "judged": metric in JUDGED}  # fmt: skip


def log_errors(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text(errors="replace").splitlines() if ERROR_LINE.search(line)]


def wait_for_drain(timeout: float = 60) -> dict[str, int]:
    """Wait until the usage stream is empty (the persister caught up); returns what is left where."""
    from billing.usage import GROUP
    from core import keys
    from core.redis import sync_redis

    client = sync_redis()
    deadline = time.monotonic() + timeout
    while True:
        left = {
            "usage_stream": int(client.xlen(keys.usage_stream())),
            "in_flight": int(client.hlen(keys.inflight_requests())),
            "model_queue": sum(int(client.zcard(keys.model_queue(m))) for m in (CHAT_MODEL, EMBED_MODEL)),
            "dead_letters": int(client.xlen(keys.usage_dead_letters())),
        }
        with contextlib.suppress(Exception):  # no group yet: nothing was ever read
            left["pending"] = int(client.xpending(keys.usage_stream(), GROUP)["pending"])
        if (left["usage_stream"] == 0 and left.get("pending", 0) == 0) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def metering_check(tally: Tally, key_ids: list[int]) -> dict[str, Any]:
    from billing.models import UsageRecord

    recorded = [rid.hex for rid in UsageRecord.objects.filter(api_key_id__in=key_ids).values_list(
        "request_id", flat=True)]  # fmt: skip
    recorded_set = set(recorded)
    by_cache = Counter(UsageRecord.objects.filter(api_key_id__in=key_ids).values_list("cache", flat=True))
    return {
        "admitted": len(tally.admitted),
        "refused": len(tally.refused),
        "records": len(recorded),
        "lost": sorted(tally.admitted - recorded_set)[:20],
        "lost_count": len(tally.admitted - recorded_set),
        "refused_but_metered": len(tally.refused & recorded_set),
        # Records of requests the client never saw admitted (a failed request's may be one).
        "unexpected_records": len(recorded_set - tally.admitted - tally.failed_ids),
        "records_by_cache": dict(by_cache),
    }


def mix_summary(tally: Tally, mix: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Per kind of request: how many, their outcomes, latency p50 and p99."""
    summary = {}
    for kind in mix:
        latencies = tally.latencies.get(kind, [])
        summary[kind] = {
            "requests": len(latencies),
            "outcomes": dict(tally.outcomes.get(kind, Counter())),
            "p50_ms": statistics.median(latencies) * 1000 if latencies else 0.0,
            "p99_ms": statistics.quantiles(latencies, n=100)[98] * 1000 if len(latencies) > 1 else 0.0,
        }
    return summary


def judge(report: dict[str, Any]) -> list[str]:
    """What went wrong in the run, if anything: each item fails it."""
    problems = [f"{row['label']} grew {row['growth'] * 100:+.1f} %" for row in report["growth"] if row["grew"]]
    if len(report["samples"]) < 10:
        problems.append(f"only {len(report['samples'])} samples: run longer for a verdict on growth")
    metering, left_over = report["metering"], report["left_over"]
    if metering["lost_count"]:
        problems.append(f"{metering['lost_count']} admitted requests have no usage record")
    if metering["duplicated"]:
        problems.append(f"{metering['duplicated']} usage events more than records (metered twice)")
    if metering["refused_but_metered"] or metering["unexpected_records"]:
        problems.append(f"{metering['refused_but_metered'] + metering['unexpected_records']} records of "
                        "requests that were refused or never answered")  # fmt: skip
    if any(left_over.get(k) for k in ("usage_stream", "pending", "in_flight", "model_queue", "dead_letters")):
        problems.append(f"left over after the run: {left_over}")
    if report["failed_requests"]:
        problems.append(f"{report['failed_requests']} requests failed")
    if report["persister"].get("failed_runs"):
        problems.append(f"{report['persister']['failed_runs']} persister runs failed")
    if report["log_error_count"]:
        problems.append(f"{report['log_error_count']} error lines in the gateway's and persister's logs")
    return problems


def markdown(report: dict[str, Any]) -> str:
    run = report["run"]
    lines = [
        f"Soak of {report['started']} on {report['machine']} ({report['cpus']} CPUs): `{report['command']}`",
        "",
        f"{run['requests']:,} requests at concurrency {run['concurrency']} in {run['duration_s']:.0f} s "
        f"({run['requests'] / run['duration_s']:.0f} requests/s), {len(report['samples'])} samples every "
        f"{run['sample_every']} s.",
        "",
        "| gateway | first sample | steady state | end | growth | |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["growth"]:
        verdict = ("GREW" if row["grew"] else "flat") if row["judged"] else "(shown, not judged)"
        first = "-" if row["first"] is None else f"{row['first']:.1f}"
        lines.append(f"| {row['label']} | {first} | {row['steady']:.1f} | {row['end']:.1f} | "
                     f"{row['growth'] * 100:+.1f} % | {verdict} |")  # fmt: skip
    lines += ["", "| kind | requests | outcomes | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for kind, row in report["mix"].items():
        outcomes = ", ".join(f"{k}: {v:,}" for k, v in sorted(row["outcomes"].items()))
        lines.append(f"| {kind} | {row['requests']:,} | {outcomes} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} |")
    m = report["metering"]
    lines += [
        "",
        f"Metering: {m['admitted']:,} requests admitted, {m['records']:,} usage records; lost {m['lost_count']}, "
        f"metered twice {m['duplicated']}, refused (429) {m['refused']:,} of which metered "
        f"{m['refused_but_metered']}, records of no admitted request {m['unexpected_records']}; "
        f"usage events the gateway wrote {report['usage_events']:.0f}, the persister handled "
        f"{report['persister'].get('handled', 0):,}; left over: {report['left_over']}.",
        "",
        f"Failed requests: {report['failed_requests']}; error lines in the logs: {report['log_error_count']}.",
        "",
        f"Verdict: {'PASS' if not report['problems'] else 'FAIL: ' + '; '.join(report['problems'])}",
    ]
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------


def parse_mix(text: str | None) -> dict[str, int]:
    if not text:
        return dict(DEFAULT_MIX)
    mix = {}
    for part in text.split(","):
        kind, _, weight = part.partition("=")
        if kind not in DEFAULT_MIX or not weight.isdigit():
            raise SystemExit(f"--mix: {part!r} is not kind=weight with kind one of {', '.join(DEFAULT_MIX)}")
        mix[kind] = int(weight)
    return mix


def interrupted(_signum: int, _frame: object) -> NoReturn:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--mix", help="kind=weight,… of " + ", ".join(f"{k}={v}" for k, v in DEFAULT_MIX.items()))
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--throttled-rpm", type=int, default=60, help="requests a minute of the throttled key")
    parser.add_argument("--ws-requests-per-socket", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=8, help="chunks in a fake engine's answer")
    parser.add_argument("--sample-every", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--max-growth", type=float, default=0.10, help="a judged figure growing this much fails")
    parser.add_argument("--persister", type=Path, help=argparse.SUPPRESS)  # the persister process
    args = parser.parse_args()
    isolate()
    if args.persister:
        run_persister(args.persister)
        return

    # Stopped (timeout, kill): the finally below still stops the processes it started.
    signal.signal(signal.SIGTERM, interrupted)
    mix = parse_mix(args.mix)
    report = report_start(args)
    report["command"] = " ".join(["bench/soak.py", *sys.argv[1:]])
    workdir = ROOT / "var" / "soak" / f"run-{time.strftime('%Y%m%dT%H%M%S')}"
    workdir.mkdir(parents=True)
    database_prepare()
    from django.conf import settings
    from django.db import connections

    processes: list[Server] = []
    exit_code = 1
    try:
        chat_engine = start_fake_engine(workdir, "fake-chat", args.tokens)
        processes.append(chat_engine)
        embed_engine = start_fake_engine(workdir, "fake-embed", args.tokens)
        processes.append(embed_engine)
        print("registering the soak's models and keys", flush=True)
        keys, key_ids = platform_setup(chat_engine.base, embed_engine.base, args.throttled_rpm)
        persister, persister_status = start_persister(workdir)
        processes.append(persister)
        gateway = start_gateway(workdir)
        processes.append(gateway)
        # This process's connections must not count as the gateway's.
        connections.close_all()

        rng = random.Random(args.seed)
        plan = rng.choices(list(mix), weights=list(mix.values()), k=args.requests)
        load = Load(gateway.base, keys, plan, args.ws_requests_per_socket)
        pg_port = int(settings.DATABASES["default"].get("PORT") or 5432)
        redis_port = urlsplit(settings.REDIS_URL).port or 6379
        sampler = Sampler(gateway, pg_port, redis_port)
        print(f"soak: {args.requests:,} requests at concurrency {args.concurrency} against {gateway.base}, "
              f"mix {mix}; logs in {workdir}", flush=True)  # fmt: skip
        samples, duration = asyncio.run(drive(load, sampler, args.concurrency, args.sample_every, 10.0))
        sampler.close()

        print("waiting for the persister to drain the usage stream", flush=True)
        left_over = wait_for_drain()

        async def final_metrics() -> dict[str, float]:
            async with aiohttp.ClientSession() as session:
                return await gateway_metrics(session, gateway.base)

        usage_events = asyncio.run(final_metrics()).get("usage_events", 0.0)
        persister.stop()
        persister_totals = json.loads(persister_status.read_text()) if persister_status.exists() else {}
        gateway.stop()
        metering = metering_check(load.tally, key_ids)
        # The gateway hands one event per admitted request to the stream, and the persister
        # handles each once: any more than there are records were metered twice.
        handled = int(persister_totals.get("handled", 0))
        metering["duplicated"] = max(0, int(usage_events) - metering["records"], handled - metering["records"])
        report |= {
            "run": {"requests": args.requests, "concurrency": args.concurrency, "duration_s": duration,
                    "sample_every": args.sample_every, "mix": mix},
            "samples": samples,
            "growth": growth_table(samples, args.max_growth),
            "mix": mix_summary(load.tally, mix),
            "metering": metering,
            "usage_events": usage_events,
            "persister": persister_totals,
            "left_over": left_over,
            "failed_requests": load.tally.failure_count,
            "failures": load.tally.failures,
        }  # fmt: skip
        errors = [f"{p.name}: {line}" for p in (gateway, persister) for line in log_errors(p.log)]
        report["log_error_count"], report["log_errors"] = len(errors), errors[:40]
        report["problems"] = problems = judge(report)
        table = markdown(report)
        print("\n" + table + "\n", flush=True)
        if load.tally.failures:
            print("first failures:\n  " + "\n  ".join(load.tally.failures), flush=True)
        if report["log_errors"]:
            print("error lines:\n  " + "\n  ".join(report["log_errors"]), flush=True)
        json_path = write_report("soak", report)
        json_path.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {json_path} and {json_path.with_suffix('.md').name}", flush=True)
        exit_code = 1 if problems else 0
    finally:
        for process in reversed(processes):
            process.stop()
        with contextlib.suppress(Exception):
            retire_models()
    raise SystemExit(exit_code)


if __name__ == "__main__":
    main()
