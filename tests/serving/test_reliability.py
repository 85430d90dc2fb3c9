"""Regression tests of issue 18's defects that need a real gateway: what a request that never
ran costs, a huge prompt that must not stall the others, a client that stops reading."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import pytest

from tests.support.gateway import chat as chat_hello
from tests.support.gateway import committed, persisted, price_model, register_fake_replica, start_fake_engine
from tests.support.processes import Gateway, free_port

pytestmark = pytest.mark.django_db

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
chat = functools.partial(chat_hello, messages=QUESTION)


@dataclass
class CountedModel:
    """A fake engine behind a model whose prompts the gateway counts exactly (SmolLM2's tokenizer)."""

    name: str
    endpoint: str

    def control(self, **state: Any) -> None:
        httpx.post(f"{self.endpoint}/_control", json=state, timeout=5).raise_for_status()

    def requests(self) -> int:
        return int(httpx.get(f"{self.endpoint}/_stats", timeout=5).json()["requests"])


@pytest.fixture
def counted_model(bundled_models, django_db_blocker) -> Iterator[CountedModel]:
    process, endpoint = start_fake_engine()
    name = f"counted-{uuid.uuid4().hex[:8]}"
    artifact = bundled_models["versions"]["smollm2-135m-instruct"].artifact_uri

    def register() -> None:
        register_fake_replica(name, endpoint, artifact_uri=artifact)
        price_model(name, input_per_million="1000", output_per_million="2000")

    committed(django_db_blocker, register)
    yield CountedModel(name, endpoint)
    process.kill()
    process.wait(5)


@pytest.fixture
def gateway(spawn_gateway) -> Gateway:
    return spawn_gateway(REPLICA_STALE_AFTER="86400", ROUTING_REFRESH_SECONDS="0.2", ENGINE_FIRST_TOKEN_TIMEOUT="2")


class TestARequestNoEngineRanCostsNothing:
    """Defect 6: an engine's refusal, or no replica to take it, is not billed its prompt."""

    def test_an_engine_refusal_costs_nothing_and_says_why(self, gateway, api_key, counted_model):
        served = chat(gateway, api_key, counted_model.name)
        assert served.status_code == 200
        counted_model.control(mode="error400")
        refused = chat(gateway, api_key, counted_model.name)
        assert refused.status_code == 400
        ids = [served.headers["x-request-id"], refused.headers["x-request-id"]]
        records = persisted(ids)
        ok, bad = records[ids[0]], records[ids[1]]
        assert ok.prompt_tokens > 0  # a request that ran is billed
        assert ok.cost > 0
        assert ok.error_code == ""
        assert (bad.status_code, bad.prompt_tokens, bad.completion_tokens, bad.cost) == (400, 0, 0, Decimal(0))
        assert bad.error_code == "invalid_request"

    def test_a_request_every_replica_refused_costs_nothing(self, spawn_gateway, api_key, bundled_models,
                                                           django_db_blocker):  # fmt: skip
        name = f"unreachable-{uuid.uuid4().hex[:8]}"
        artifact = bundled_models["versions"]["smollm2-135m-instruct"].artifact_uri

        def register() -> None:
            register_fake_replica(name, f"http://127.0.0.1:{free_port()}", artifact_uri=artifact)  # nothing listens
            price_model(name, input_per_million="1000", output_per_million="2000")

        committed(django_db_blocker, register)
        gateway = spawn_gateway(REPLICA_STALE_AFTER="86400")
        response = chat(gateway, api_key, name)
        assert response.status_code == 503
        request_id = response.headers["x-request-id"]
        record = persisted([request_id])[request_id]
        assert (record.status_code, record.prompt_tokens, record.cost) == (503, 0, Decimal(0))
        assert record.error_code == "engine_unavailable"


@pytest.fixture
def long_context_model(bundled_models, django_db_blocker) -> Iterator[CountedModel]:
    """Like ``counted_model``, with a context so long that a 4 MB prompt passes the cheap bound
    and must be tokenised."""
    process, endpoint = start_fake_engine()
    name = f"long-{uuid.uuid4().hex[:8]}"
    artifact = bundled_models["versions"]["smollm2-135m-instruct"].artifact_uri
    committed(django_db_blocker, lambda: register_fake_replica(name, endpoint, artifact_uri=artifact,
                                                                  max_seq_len=1 << 22))  # fmt: skip
    yield CountedModel(name, endpoint)
    process.kill()
    process.wait(5)


def big_question(chars: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]}]


class TestLargePrompts:
    """Defect 2: a large prompt is refused by a cheap bound, counted off the event loop, and
    paid for as a request, so it neither stalls the gateway nor repeats for free."""

    def test_a_prompt_that_cannot_fit_is_refused_without_being_counted(self, gateway, api_key, counted_model):
        response = chat(gateway, api_key, counted_model.name, messages=big_question(3_900_000))
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
        assert "at least" in error["message"]  # the cheap bound, not a count
        assert counted_model.requests() == 0

    def test_counting_a_large_prompt_does_not_stall_other_requests(self, spawn_gateway, api_key, long_context_model):
        import time
        from concurrent.futures import ThreadPoolExecutor

        gateway = spawn_gateway(REPLICA_STALE_AFTER="86400", ENGINE_MAX_MODEL_LEN=str(1 << 22))
        headers = {"Authorization": f"Bearer {api_key.secret}"}
        assert httpx.get(f"{gateway.base_url}/v1/models", headers=headers).status_code == 200  # warm
        body = big_question(3_900_000)

        def big() -> tuple[httpx.Response, float]:
            started = time.monotonic()
            response = chat(gateway, api_key, long_context_model.name, messages=body, max_tokens=1)
            return response, time.monotonic() - started

        waits: list[float] = []
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(big)
            while not pending.done():
                started = time.monotonic()
                assert httpx.get(f"{gateway.base_url}/v1/models", headers=headers, timeout=30).status_code == 200
                waits.append(time.monotonic() - started)
            response, took = pending.result()
        assert response.status_code == 200, response.text  # it fits this context: counted, then served
        # Counting ~4 MB takes about a second of CPU; on the event loop, one of these small
        # requests would have waited for most of it.
        assert len(waits) >= 3, (waits, took)
        assert max(waits) < took / 2, (waits, took)

    def test_large_refused_requests_count_against_the_request_limit(self, gateway, make_api_key, counted_model):
        key = make_api_key(rate_limit_rpm=3, rate_limit_tpm=10_000_000)
        statuses = [
            chat(gateway, key, counted_model.name, messages=big_question(200_000)).status_code for _ in range(4)
        ]
        assert statuses == [400, 400, 400, 429]
        assert counted_model.requests() == 0


class TestWebSocketFrames:
    """Defect 2: a WebSocket frame is bounded like a request body."""

    def test_a_frame_over_the_body_limit_is_refused_unread(self, gateway, api_key, counted_model):
        import json

        from websockets.sync.client import connect

        url = gateway.base_url.replace("http://", "ws://") + "/ws/v1/chat/completions"
        headers = {"Authorization": f"Bearer {api_key.secret}"}
        huge = json.dumps({"type": "chat.completion", "id": "big",
                           "body": {"model": counted_model.name, "messages": big_question(4_500_000)}})  # fmt: skip
        with connect(url, additional_headers=headers, max_size=None) as socket:
            socket.send(huge)
            refused = json.loads(socket.recv(timeout=30))
            assert refused["type"] == "error"
            assert refused["error"]["code"] == "request_body_too_large"
            # The socket still works.
            socket.send(json.dumps({"type": "chat.completion", "id": "ok",
                                    "body": {"model": counted_model.name, "messages": QUESTION}}))  # fmt: skip
            frames = []
            while not frames or frames[-1]["type"] not in ("usage", "error"):
                frames.append(json.loads(socket.recv(timeout=30)))
            assert frames[-1]["type"] == "usage"
            assert frames[-1]["status"] == "completed"
        assert counted_model.requests() == 1


@dataclass
class TwoReplicas:
    name: str
    endpoints: list[str]

    def control(self, index: int, **state: Any) -> None:
        httpx.post(f"{self.endpoints[index]}/_control", json=state, timeout=5).raise_for_status()

    def requests(self, index: int) -> int:
        return int(httpx.get(f"{self.endpoints[index]}/_stats", timeout=5).json()["requests"])


@pytest.fixture
def two_replicas(django_db_blocker) -> Iterator[TwoReplicas]:
    """One version served by two fake replicas."""
    engines = [start_fake_engine(), start_fake_engine()]
    name = f"pair-{uuid.uuid4().hex[:8]}"

    def register() -> None:
        from django.utils import timezone

        from registry.models import Replica

        first = Replica.objects.get(pk=register_fake_replica(name, engines[0][1]))
        Replica.objects.create(deployment=first.deployment, host="fake", endpoint=engines[1][1], state="ready",
                               last_heartbeat=timezone.now())  # fmt: skip

    committed(django_db_blocker, register)
    yield TwoReplicas(name, [endpoint for _, endpoint in engines])
    for process, _ in engines:
        process.kill()
        process.wait(5)


def failed_attempts(request_ids: list[str]) -> dict[str, Any]:
    from billing.models import FailedAttempt
    from billing.usage import persist_failed_attempts

    persist_failed_attempts()
    return {str(a.request_id): a for a in FailedAttempt.objects.filter(request_id__in=request_ids)}


class TestFallback:
    """A request whose engine fails before the first byte reaches the client is answered by
    another replica (or the base version), metered once, and the failure still counted."""

    @pytest.mark.parametrize("stream", [False, True])
    def test_a_replica_that_fails_is_replaced_by_another(self, gateway, api_key, two_replicas, stream,
                                                         django_db_blocker):  # fmt: skip
        two_replicas.control(0, mode="error500")
        two_replicas.control(1, mode="error500")
        ids: list[str] = []
        for _ in range(6):
            # Whichever replica a request tries first, the other is healthy for this one.
            response = None
            for broken in (0, 1):
                two_replicas.control(broken, mode="error500" if not stream else "hang")
                two_replicas.control(1 - broken, mode="normal")
                response = chat(gateway, api_key, two_replicas.name, stream=stream)
                assert response.status_code == 200, response.text
                ids.append(response.headers["x-request-id"])
        records = committed(django_db_blocker, lambda: persisted(ids))
        assert sorted(records) == sorted(ids)  # metered once each
        assert {r.status_code for r in records.values()} == {200}
        attempts = committed(django_db_blocker, lambda: failed_attempts(ids))
        assert attempts  # the ones that went to the broken replica first
        assert {a.status_code for a in attempts.values()} <= {502, 504}
        assert all(a.model_version == "1" for a in attempts.values())

    def test_a_pinned_request_never_changes_version(self, gateway, api_key, django_db_blocker):
        engines = [start_fake_engine(), start_fake_engine()]
        name = f"pinned-{uuid.uuid4().hex[:8]}"
        try:

            def register() -> None:
                register_fake_replica(name, engines[0][1], version="v1")
                register_fake_replica(name, engines[1][1], version="v2", weight=0)

            committed(django_db_blocker, register)
            httpx.post(f"{engines[1][1]}/_control", json={"mode": "error500"}, timeout=5).raise_for_status()
            pinned = httpx.post(
                f"{gateway.base_url}/v1/chat/completions", timeout=30,
                json={"model": name, "messages": QUESTION},
                headers={"Authorization": f"Bearer {api_key.secret}", "X-Model-Version": "v2"},
            )  # fmt: skip
            assert pinned.status_code == 502
            assert httpx.get(f"{engines[0][1]}/_stats", timeout=5).json()["requests"] == 0
            # Unpinned, a request of v2's callers would have been answered by v1; the pinned one was not.
            request_id = pinned.headers["x-request-id"]
            assert committed(django_db_blocker, lambda: persisted([request_id]))[request_id].model_version == "v2"
        finally:
            for process, _ in engines:
                process.kill()
                process.wait(5)


class TestAClientThatStopsReading:
    """Defect 8: a client that stops reading no longer holds its request for ever (until the
    sweeper settled it from its admission draft, unbilled): the write times out, and the
    request is settled at once as the client's going away, with the tokens it was sent."""

    def test_it_is_settled_with_what_it_was_sent(self, spawn_gateway, api_key, counted_model, django_db_blocker):
        import json
        import socket
        import time

        gateway = spawn_gateway(REPLICA_STALE_AFTER="86400", CLIENT_SEND_TIMEOUT="1")
        counted_model.control(mode="normal", tokens=400_000, delay=0)
        body = json.dumps({"model": counted_model.name, "messages": QUESTION, "stream": True}).encode()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, then no reading at all
        client.connect(("127.0.0.1", gateway.port))
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {api_key.secret}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += client.recv(1024)
        request_id = next(
            line.split(b":", 1)[1].strip().decode()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"x-request-id:")
        )
        try:
            deadline = time.monotonic() + 60
            records: dict[str, Any] = {}
            while not records and time.monotonic() < deadline:
                records = committed(django_db_blocker, lambda: persisted([request_id]))
            record = records[request_id]
            assert (record.status_code, record.error_code) == (499, "client_closed")
            assert 0 < record.completion_tokens < 400_000  # billed for what it was sent, stopped early
        finally:
            client.close()


class TestASlowReplica:
    def test_json_requests_that_time_out_open_its_circuit(self, spawn_gateway, api_key, two_replicas):
        """A JSON request that hits the whole request's limit judges its replica (504 and a
        failure on its circuit), so a slow replica stops being chosen; it was 'nothing learnt'."""
        gateway = spawn_gateway(REPLICA_STALE_AFTER="86400", ENGINE_REQUEST_TIMEOUT="1.5", CIRCUIT_OPEN_SECONDS="60")
        two_replicas.control(0, mode="normal", latency=30)
        statuses: list[int] = []
        # Requests go to either replica (the fewest in flight, ties drawn at random) until the
        # slow one has failed CIRCUIT_FAILURE_THRESHOLD (3) times; then its circuit rests.
        while statuses.count(504) < 3:
            statuses.append(chat(gateway, api_key, two_replicas.name).status_code)
            assert len(statuses) < 60, statuses
        assert set(statuses) <= {200, 504}
        after = [chat(gateway, api_key, two_replicas.name).status_code for _ in range(10)]
        assert after == [200] * 10, (statuses, after)
