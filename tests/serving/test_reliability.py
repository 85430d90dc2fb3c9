"""Regression tests of issue 18's defects that need a real gateway: what a request that never
ran costs, a huge prompt that must not stall the others, a client that stops reading."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import pytest

from tests.processes import Gateway, free_port
from tests.serving.conftest import committed, persisted, price_model, register_fake_replica, start_fake_engine

pytestmark = pytest.mark.django_db

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]


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


def chat(gateway: Gateway, key: Any, model: str, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{gateway.base_url}/v1/chat/completions", timeout=30,
        json={"model": model, "messages": QUESTION, **body},
        headers={"Authorization": f"Bearer {key.secret}"},
    )  # fmt: skip


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
