"""Regression tests for the gateway's failure paths: real daphne, PostgreSQL and Redis, a fake engine.

Each case here once ended in a 500, a request left in flight, or a lost usage record.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from core import keys
from core.redis import sync_redis
from tests.support import processes
from tests.support.gateway import HELLO, chat, persisted
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.django_db


def in_flight_of(key_id: int) -> list[dict[str, str]]:
    entries = [json.loads(raw) for raw in sync_redis().hvals(keys.inflight_requests())]
    return [e for e in entries if e.get("api_key_id") == str(key_id)]


def replica_in_flight(gateway, replica_id: int) -> float:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=5).text
    prefix = f'inference_replica_in_flight{{replica="{replica_id}"}}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def wait_for(condition, timeout: float = 10.0, message: str = "condition not reached"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(message)


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


class TestEngineTransportErrors:
    @pytest.mark.parametrize("stream", [False, True])
    def test_a_connection_dropped_by_the_engine_is_a_502_and_a_circuit_failure(
        self, fault_gateway, api_key, fake_model, stream
    ):
        fake_model.control(mode="reset")
        statuses = [chat(fault_gateway, api_key, fake_model.name, stream=stream).status_code for _ in range(4)]
        # Three failures open the circuit: the fourth request is not sent to that replica.
        assert statuses == [502, 502, 502, 503]
        assert fake_model.requests() == 3
        response = chat(fault_gateway, api_key, fake_model.name, stream=stream)
        assert response.json()["error"]["code"] == "engine_unavailable"

    def test_an_unreadable_event_mid_stream_ends_the_stream_with_an_error(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="bad_event", tokens=6, die_after=2)
        response = chat(fault_gateway, api_key, fake_model.name, stream=True)
        assert response.status_code == 200
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert "[DONE]" not in events
        assert '"error"' in events[-1]
        request_id = response.headers["x-request-id"]
        record = persisted([request_id])[request_id]
        assert record.status_code >= 500
        assert record.completion_tokens == 2


@pytest.fixture
def db_proxy():
    from django.db import connection

    proxy = TcpProxy(int(connection.settings_dict["PORT"])).start()
    yield proxy
    proxy.close()


class TestDatabaseDown:
    def test_beyond_the_routing_tables_staleness_it_is_a_503(
        self, api_key, fake_model, db_proxy, spawn_gateway, django_db_blocker
    ):
        url = processes.test_database_url().replace(f":{db_proxy.target[1]}/", f":{db_proxy.port}/")
        gateway = spawn_gateway(
            DATABASE_URL=url, REPLICA_STALE_AFTER="86400", ROUTING_REFRESH_SECONDS="0.2", ROUTING_MAX_STALENESS="2",
            API_KEY_CACHE_SECONDS="1",
        )  # fmt: skip
        fake_model.control(mode="normal", tokens=2, delay=0)
        assert chat(gateway, api_key, fake_model.name).status_code == 200
        db_proxy.cut()
        time.sleep(2.5)
        refused = chat(gateway, api_key, fake_model.name, timeout=60)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] in {"auth_unavailable", "routing_unavailable", "database_unavailable"}
        assert httpx.get(f"{gateway.base_url}/v1/models", timeout=60,
                         headers={"Authorization": f"Bearer {api_key.secret}"}).status_code == 503  # fmt: skip
        db_proxy.restore()
        wait_for(lambda: chat(gateway, api_key, fake_model.name).status_code == 200, 20, "not back after restore")


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


class TestWebSocketFailures:
    def _run(self, gateway, key, body):
        url = gateway.base_url.replace("http://", "ws://") + "/ws/v1/chat/completions"
        with connect(url, additional_headers={"Authorization": f"Bearer {key.secret}"}) as socket_:
            socket_.send(json.dumps({"type": "chat.completion", "id": "a", "body": body}))
            frames = []
            deadline = time.monotonic() + 30
            while not any(f["type"] == "usage" for f in frames):
                frames.append(json.loads(socket_.recv(timeout=max(0.1, deadline - time.monotonic()))))
        return frames

    def test_an_engine_error_before_the_first_token_is_an_error_then_usage(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="error500")
        frames = self._run(fault_gateway, api_key, {"model": fake_model.name, "messages": HELLO})
        assert [f["type"] for f in frames] == ["error", "usage"]
        assert frames[0]["error"]["code"] == "engine_error"
        assert (frames[1]["status"], frames[1]["status_code"]) == ("error", 502)

    def test_a_dropped_engine_connection_is_reported_not_completed(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="reset")
        frames = self._run(fault_gateway, api_key, {"model": fake_model.name, "messages": HELLO})
        assert frames[-1]["status"] == "error"
        assert frames[-1]["status_code"] == 502
        record = persisted([frames[-1]["request_id"]])[frames[-1]["request_id"]]
        assert record.status_code == 502

    def test_an_unreadable_event_after_admission_is_not_completed(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="bad_event", tokens=6, die_after=2)
        frames = self._run(fault_gateway, api_key, {"model": fake_model.name, "messages": HELLO})
        assert [f["type"] for f in frames][-2:] == ["error", "usage"]
        assert frames[-1]["status"] == "error"
        assert frames[-1]["status_code"] >= 500


@pytest.fixture
def redis_proxy():
    from django.conf import settings

    port = int(settings.REDIS_URL.rsplit(":", 1)[1].split("/")[0])
    proxy = TcpProxy(port).start()
    yield proxy
    proxy.close()


class TestRedisOutage:
    def test_a_settlement_waits_for_redis_however_long_it_is_away(
        self, make_api_key, fake_model, redis_proxy, spawn_gateway
    ):
        from django.conf import settings

        from billing.ledger import sweep_lost_requests

        db = settings.REDIS_URL.rsplit("/", 1)[1]
        gateway = spawn_gateway(
            TEST_REDIS_URL=f"redis://127.0.0.1:{redis_proxy.port}/{db}", REPLICA_STALE_AFTER="86400",
            ROUTING_REFRESH_SECONDS="0.2",
        )  # fmt: skip
        key = make_api_key(rate_limit_rpm=10_000)
        fake_model.control(mode="normal", tokens=10, delay=0.2)
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(chat, gateway, key, fake_model.name, stream=True, timeout=60)
            wait_for(lambda: fake_model.requests() == 1, 10, "not dispatched")
            redis_proxy.cut()  # Redis goes away mid-stream, for longer than the old 6 s of retries
            response = pending.result()
        assert response.status_code == 200
        assert response.text.rstrip().endswith("data: [DONE]")
        request_id = response.headers["x-request-id"]
        time.sleep(10)
        assert sweep_lost_requests() == 0  # the gateway is alive: its request is not the sweeper's
        redis_proxy.restore()
        wait_for(lambda: in_flight_of(key.key_id) == [], 20, "not settled after Redis came back")
        record = persisted([request_id])[request_id]  # written once Redis is back
        assert (record.status_code, record.completion_tokens) == (200, 10)
        assert in_flight_of(key.key_id) == []
