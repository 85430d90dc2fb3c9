"""Faults of clients: bodies, prompts and WebSocket frames too large, requests cancelled or left
right after they started, a client that stops reading. Each is refused or settled at once, holds
no place or replica, and is metered for what it was sent."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from core import keys
from core.redis import sync_redis
from tests.support.gateway import (
    HELLO,
    QUESTION,
    CountedModel,
    chat,
    committed,
    in_flight_of,
    persisted,
    register_fake_replica,
    replica_in_flight,
    start_fake_engine,
    wait_for,
)

pytestmark = pytest.mark.django_db


ask = functools.partial(chat, messages=QUESTION)  # the question most tests here send


class TestBodies:
    def test_a_6_mb_body_is_a_413_with_the_openai_body(self, fault_gateway, api_key, fake_model):
        body = json.dumps({"model": fake_model.name, "messages": [{"role": "user", "content": "x" * 6_000_000}]})
        response = httpx.post(
            f"{fault_gateway.base_url}/v1/chat/completions", content=body, timeout=30,
            headers={"Authorization": f"Bearer {api_key.secret}", "Content-Type": "application/json"},
        )  # fmt: skip
        assert response.status_code == 413
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_body_too_large")
        assert "4 MiB" in error["message"]
        assert response.headers["x-request-id"]
        assert fake_model.requests() == 0

    def test_a_chunked_body_over_the_limit_is_a_413_too(self, fault_gateway, api_key, fake_model):
        def chunks():
            yield b'{"model": "x", "messages": [{"role": "user", "content": "'
            for _ in range(60):
                yield b"y" * 100_000
            yield b'"}]}'

        response = httpx.post(
            f"{fault_gateway.base_url}/v1/chat/completions", content=chunks(), timeout=30,
            headers={"Authorization": f"Bearer {api_key.secret}", "Content-Type": "application/json"},
        )  # fmt: skip
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_body_too_large"


class TestRequestsThatEndEarly:
    def test_a_stream_left_right_after_it_started_is_settled_at_once(self, fault_gateway, make_api_key, fake_model):
        key = make_api_key(rate_limit_rpm=10_000, max_concurrent=1)
        fake_model.control(mode="normal", tokens=20, delay=0.3)
        with httpx.stream(
            "POST", f"{fault_gateway.base_url}/v1/chat/completions", timeout=30,
            json={"model": fake_model.name, "messages": HELLO, "stream": True},
            headers={"Authorization": f"Bearer {key.secret}"},
        ) as response:  # fmt: skip
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
        # The client is gone before reading a byte of the body: settled now, not by the sweeper.
        record = persisted([request_id])[request_id]
        assert record.status_code == 499
        assert in_flight_of(key.key_id) == []
        assert sync_redis().zcard(keys.model_queue(fake_model.name)) == 0
        wait_for(lambda: replica_in_flight(fault_gateway, fake_model.replica_id) == 0, 5, "replica left counted busy")
        fake_model.control(mode="normal", tokens=2, delay=0)
        assert chat(fault_gateway, key, fake_model.name).status_code == 200  # its one concurrent slot is free

    def test_150_requests_cancelled_at_once_on_one_socket_leave_nothing_behind(
        self, fault_gateway, make_api_key, fake_model
    ):
        key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=4)
        fake_model.control(mode="normal", tokens=50, delay=0.1)
        url = fault_gateway.base_url.replace("http://", "ws://") + "/ws/v1/chat/completions"
        ids = [f"r{i}" for i in range(150)]
        with connect(url, additional_headers={"Authorization": f"Bearer {key.secret}"}) as socket_:
            body = {"model": fake_model.name, "messages": HELLO}
            for client_id in ids:
                socket_.send(json.dumps({"type": "chat.completion", "id": client_id, "body": body}))
            for client_id in ids:
                socket_.send(json.dumps({"type": "cancel", "id": client_id}))
            # Each id ends with exactly one frame: usage (admitted, so metered) or error (never ran).
            finals: dict[str, list[dict[str, Any]]] = {client_id: [] for client_id in ids}
            deadline = time.monotonic() + 60
            while sum(map(len, finals.values())) < len(ids) and time.monotonic() < deadline:
                frame = json.loads(socket_.recv(timeout=max(0.1, deadline - time.monotonic())))
                if frame["type"] in {"usage", "error"}:
                    finals[frame["id"]].append(frame)
            time.sleep(0.5)
            with pytest.raises(TimeoutError):  # nothing after every request ended
                socket_.recv(timeout=0.5)
        assert {k: len(v) for k, v in finals.items() if len(v) != 1} == {}
        final = {k: v[0] for k, v in finals.items()}
        refused = [f for f in final.values() if f["type"] == "error"]
        assert {f["error"]["code"] for f in refused} <= {"cancelled", "rate_limit_exceeded"}
        admitted = [f for f in final.values() if f["type"] == "usage"]
        assert all(f["status"] in {"cancelled", "completed"} for f in admitted)
        records = persisted([f["request_id"] for f in admitted])
        assert len(records) == len(admitted)  # each admitted request metered once
        assert in_flight_of(key.key_id) == []
        assert sync_redis().zcard(keys.limit_scope("key", key.key_id) + ":conc") == 0
        assert sync_redis().zcard(keys.model_queue(fake_model.name)) == 0

        # The key's four concurrent places are all free again: four at once are admitted.
        fake_model.control(mode="normal", tokens=3, delay=0.2)
        with ThreadPoolExecutor(max_workers=4) as pool:
            statuses = list(pool.map(lambda _: chat(fault_gateway, key, fake_model.name).status_code, range(4)))
        assert statuses == [200] * 4


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
        response = ask(gateway, api_key, counted_model.name, messages=big_question(3_900_000))
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
            response = ask(gateway, api_key, long_context_model.name, messages=body, max_tokens=1)
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
        statuses = [ask(gateway, key, counted_model.name, messages=big_question(200_000)).status_code for _ in range(4)]
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
