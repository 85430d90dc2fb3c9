"""Shadow traffic through a real gateway: the customer sees only the stable answer; the copy to
the candidate version is recorded (``ShadowRecord``), never metered, limited or billed.

Two fake engines serve one model: version 1 (weight 100, five tokens an answer) and the
candidate, version 2 (weight 0, nine tokens an answer), so every figure tells which one
produced it.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import orjson
import pytest

from tests.support.gateway import (
    HELLO,
    FakeModel,
    chat,
    committed,
    persisted,
    price_model,
    register_fake_replica,
    start_fake_engine,
)
from tests.support.processes import Gateway

pytestmark = pytest.mark.django_db

STABLE_TOKENS, CANDIDATE_TOKENS = 5, 9


@dataclass
class Shadowed:
    name: str
    stable: FakeModel
    candidate: FakeModel

    def shadow_requests(self) -> int:
        return self.candidate.requests()


def set_policy(django_db_blocker, name: str, percent: str | int, *, enabled: bool = True) -> None:
    from registry.models import Model
    from serving.shadow.services import shadow_policy_set

    def apply() -> None:
        model = Model.objects.get(name=name)
        shadow_policy_set(model=model, candidate=model.versions.get(version="2"), percent=percent, enabled=enabled)

    committed(django_db_blocker, apply)
    time.sleep(0.5)  # every gateway reloads its routing table (at once on the announcement; 0.2 s at worst)


@pytest.fixture
def shadowed(django_db_setup, django_db_blocker) -> Iterator[Shadowed]:
    """A priced model served by version 1, with version 2 deployed at weight 0 and shadowing 100 %."""
    processes = [start_fake_engine(), start_fake_engine()]
    (stable_process, stable_endpoint), (candidate_process, candidate_endpoint) = processes
    name = f"shadowed-{uuid.uuid4().hex[:8]}"

    def register() -> tuple[int, int]:
        stable = register_fake_replica(name, stable_endpoint, version="1")
        candidate = register_fake_replica(name, candidate_endpoint, version="2", weight=0)
        price_model(name, input_per_million="10", output_per_million="30")
        return stable, candidate

    stable_id, candidate_id = committed(django_db_blocker, register)
    world = Shadowed(
        name,
        FakeModel(name, stable_endpoint, stable_process, stable_id),
        FakeModel(name, candidate_endpoint, candidate_process, candidate_id),
    )
    world.candidate.control(tokens=CANDIDATE_TOKENS)
    set_policy(django_db_blocker, name, 100)
    yield world
    for process, _ in processes:
        process.kill()
        process.wait(5)


def streamed_text(response: httpx.Response) -> str:
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in orjson.loads(line[6:]).get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
    return text


def shadow_records(request_ids: list[str], *, timeout: float = 10) -> dict[str, Any]:
    """The ShadowRecords of these requests, once all are written (or what there is at the timeout)."""
    from serving.models import ShadowRecord

    deadline = time.monotonic() + timeout
    while True:
        records = {str(r.request_id): r for r in ShadowRecord.objects.filter(request_id__in=request_ids)}
        if len(records) == len(request_ids) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def wait_for(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def shadow_counter(gateway: Gateway, model: str, outcome: str) -> float:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=5).text
    pattern = re.compile(rf'^inference_shadow_requests_total\{{(?=[^}}]*model="{re.escape(model)}")'
                         rf'(?=[^}}]*outcome="{outcome}")[^}}]*\}} (\S+)$', re.M)  # fmt: skip
    return sum(float(value) for value in pattern.findall(text))


class TestTheCustomerGetsTheStableAnswer:
    def test_a_json_request_is_answered_by_the_stable_version_and_copied_to_the_candidate(
        self, fault_gateway, api_key, shadowed
    ):
        from billing.models import UsageRecord

        # The candidate answers with as many tokens as max_tokens allows: cut, "length", by any reading.
        response = chat(fault_gateway, api_key, shadowed.name, max_tokens=CANDIDATE_TOKENS)
        assert response.status_code == 200
        assert response.headers["x-model-version"] == "1"
        assert response.json()["choices"][0]["message"]["content"] == "tok " * STABLE_TOKENS
        assert response.json()["usage"]["completion_tokens"] == STABLE_TOKENS
        request_id = response.headers["x-request-id"]

        wait_for(lambda: shadowed.shadow_requests() == 1)
        assert shadowed.stable.requests() == 1
        shadow = shadow_records([request_id])[request_id]
        assert (shadow.model, shadow.candidate_version, shadow.primary_version) == (shadowed.name, "2", "1")
        assert (shadow.status_code, shadow.stream, shadow.endpoint, shadow.error) == (200, False, "chat", "")
        assert (shadow.prompt_tokens, shadow.completion_tokens, shadow.finish_reason) == (3, CANDIDATE_TOKENS, "length")
        assert shadow.ttft_ms is None
        assert shadow.latency_ms >= 0

        # Metered and billed once: the primary's tokens, at the primary's price.
        record = persisted([request_id])[request_id]
        assert UsageRecord.objects.filter(model=shadowed.name).count() == 1
        assert (record.model_version, record.completion_tokens) == ("1", STABLE_TOKENS)
        assert record.cost == (Decimal(record.prompt_tokens) * 10 + Decimal(STABLE_TOKENS) * 30) / 1_000_000
        assert shadow_counter(fault_gateway, shadowed.name, "ok") == 1

    def test_a_streamed_request_is_copied_as_a_stream(self, fault_gateway, api_key, shadowed):
        from billing.models import UsageRecord

        response = chat(fault_gateway, api_key, shadowed.name, stream=True)
        assert response.status_code == 200
        assert response.headers["x-model-version"] == "1"
        assert streamed_text(response) == "".join(f"t{i} " for i in range(STABLE_TOKENS))
        request_id = response.headers["x-request-id"]
        shadow = shadow_records([request_id])[request_id]
        assert (shadow.status_code, shadow.stream, shadow.completion_tokens) == (200, True, CANDIDATE_TOKENS)
        assert shadow.ttft_ms is not None
        assert shadow.ttft_ms <= shadow.latency_ms
        record = persisted([request_id])[request_id]
        assert record.completion_tokens == STABLE_TOKENS
        assert UsageRecord.objects.filter(model=shadowed.name).count() == 1

    def test_a_websocket_request_is_copied_too(self, fault_gateway, api_key, shadowed):
        from websockets.sync.client import connect

        url = fault_gateway.base_url.replace("http://", "ws://") + "/ws/v1/chat/completions"
        with connect(url, additional_headers={"Authorization": f"Bearer {api_key.secret}"}) as socket:
            body = {"model": shadowed.name, "messages": HELLO}
            socket.send(orjson.dumps({"type": "chat.completion", "id": "a", "body": body}).decode())
            frames = []
            while not frames or frames[-1]["type"] not in ("usage", "error"):
                frames.append(orjson.loads(socket.recv(timeout=10)))
        usage = frames[-1]
        assert (usage["status"], usage["model_version"]) == ("completed", "1")
        assert usage["usage"]["completion_tokens"] == STABLE_TOKENS
        shadow = shadow_records([usage["request_id"]])[usage["request_id"]]
        assert (shadow.stream, shadow.completion_tokens) == (True, CANDIDATE_TOKENS)


class TestNeverCharged:
    def test_copies_do_not_count_against_the_customers_limits(self, fault_gateway, make_api_key, shadowed):
        key = make_api_key(rate_limit_rpm=2)
        answers = [chat(fault_gateway, key, shadowed.name) for _ in range(3)]
        # Two requests a minute: the copies of the first two took nothing from the bucket.
        assert [a.status_code for a in answers] == [200, 200, 429]
        wait_for(lambda: shadowed.shadow_requests() == 2)


class TestAFailingCandidateChangesNothing:
    def test_a_candidate_that_fails_is_recorded_and_the_customer_served(self, fault_gateway, api_key, shadowed):
        shadowed.candidate.control(mode="error500")
        response = chat(fault_gateway, api_key, shadowed.name)
        assert response.status_code == 200
        assert response.json()["choices"][0]["message"]["content"] == "tok " * STABLE_TOKENS
        request_id = response.headers["x-request-id"]
        shadow = shadow_records([request_id])[request_id]
        assert shadow.status_code == 502
        assert "fake engine broke" in shadow.error
        assert persisted([request_id])[request_id].status_code == 200
        assert shadow_counter(fault_gateway, shadowed.name, "error") == 1

    @pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
    def test_a_candidate_that_hangs_does_not_slow_the_customer(self, fault_gateway, api_key, shadowed, stream):
        chat(fault_gateway, api_key, shadowed.name, stream=stream)  # warm: connections, routing table
        shadowed.candidate.control(mode="hang")
        started = time.monotonic()
        response = chat(fault_gateway, api_key, shadowed.name, stream=stream)
        elapsed = time.monotonic() - started
        assert response.status_code == 200
        assert response.headers["x-model-version"] == "1"
        assert elapsed < 1.0  # the gateway gives the copy ENGINE_REQUEST_TIMEOUT = 6 s
        request_id = response.headers["x-request-id"]
        wait_for(lambda: shadowed.shadow_requests() == 2)  # the copy did go out, and hangs
        assert shadow_records([request_id], timeout=0) == {}
        assert persisted([request_id])[request_id].status_code == 200
        # The copy gives up after the gateway's request time limit, and says so.
        shadow = shadow_records([request_id], timeout=12)[request_id]
        assert shadow.status_code == 504
        assert shadow.latency_ms >= 5_900

    def test_copies_beyond_the_limit_in_flight_are_dropped_not_queued(self, spawn_gateway, api_key, shadowed):
        from serving.shadow.traffic import MAX_IN_FLIGHT

        gateway = spawn_gateway(ENGINE_REQUEST_TIMEOUT="3", REPLICA_STALE_AFTER="86400")
        shadowed.candidate.control(mode="hang")
        extra = 3
        for _ in range(MAX_IN_FLIGHT + extra):
            assert chat(gateway, api_key, shadowed.name).status_code == 200
        wait_for(lambda: shadowed.shadow_requests() == MAX_IN_FLIGHT)
        assert shadow_counter(gateway, shadowed.name, "dropped") == extra
        time.sleep(0.5)
        assert shadowed.shadow_requests() == MAX_IN_FLIGHT  # nothing was waiting to go out later


class TestWhichRequestsAreCopied:
    def test_none_at_0_percent(self, fault_gateway, api_key, shadowed, django_db_blocker):
        from serving.models import ShadowRecord

        set_policy(django_db_blocker, shadowed.name, 0)
        for stream in (False, True) * 5:
            assert chat(fault_gateway, api_key, shadowed.name, stream=stream).status_code == 200
        time.sleep(1)
        assert shadowed.shadow_requests() == 0
        assert not ShadowRecord.objects.filter(model=shadowed.name).exists()

    def test_none_when_the_policy_is_disabled(self, fault_gateway, api_key, shadowed, django_db_blocker):
        set_policy(django_db_blocker, shadowed.name, 100, enabled=False)
        assert chat(fault_gateway, api_key, shadowed.name).status_code == 200
        time.sleep(1)
        assert shadowed.shadow_requests() == 0

    def test_the_share_is_picked_by_request_id(self, fault_gateway, api_key, shadowed, django_db_blocker):
        from serving.shadow.traffic import selected

        set_policy(django_db_blocker, shadowed.name, "50")
        request_ids = [chat(fault_gateway, api_key, shadowed.name).headers["x-request-id"] for _ in range(30)]
        picked = [r for r in request_ids if selected(uuid.UUID(r), 5000)]
        assert 0 < len(picked) < len(request_ids)
        assert set(shadow_records(picked)) == set(picked)
        time.sleep(0.6)  # records are written within FLUSH_SECONDS
        assert set(shadow_records(request_ids, timeout=0)) == set(picked)
        assert shadowed.shadow_requests() == len(picked)

    def test_a_request_pinned_to_the_candidate_is_not_copied_to_itself(self, fault_gateway, api_key, shadowed):
        response = httpx.post(
            f"{fault_gateway.base_url}/v1/chat/completions", timeout=30,
            json={"model": shadowed.name, "messages": HELLO},
            headers={"Authorization": f"Bearer {api_key.secret}", "X-Model-Version": "2"},
        )  # fmt: skip
        assert response.headers["x-model-version"] == "2"
        assert response.json()["usage"]["completion_tokens"] == CANDIDATE_TOKENS
        time.sleep(1)
        assert shadowed.shadow_requests() == 1  # the request itself, no copy
        assert shadow_records([response.headers["x-request-id"]], timeout=0) == {}


class TestPolicies:
    def test_the_candidate_must_be_a_version_of_the_model(self, shadowed):
        from core.errors import InvalidInput
        from registry.models import Model, ModelVersion
        from serving.shadow.services import shadow_policy_set

        model = Model.objects.get(name=shadowed.name)
        elsewhere = ModelVersion.objects.create(
            model=Model.objects.create(name=f"other-{uuid.uuid4().hex[:8]}", task="chat"), version="2",
            framework="fake", artifact_uri="local://fake/other", artifact_sha256="0" * 64, artifact_size=0,
        )  # fmt: skip
        with pytest.raises(InvalidInput, match="candidate"):
            shadow_policy_set(model=model, candidate=elsewhere, percent=10)
        with pytest.raises(InvalidInput, match="percent"):
            shadow_policy_set(model=model, candidate=model.versions.get(version="2"), percent="100.5")

    def test_setting_one_is_audited(self, shadowed, django_db_blocker):
        from registry.models import AuditEntry

        entry = AuditEntry.objects.filter(action="shadow.set", target=shadowed.name).get()
        assert entry.after == {"candidate": "2", "percent": "100.00", "enabled": True}


@pytest.fixture
def cache_gateway(bundled_models, django_db_blocker, spawn_gateway) -> Iterator[tuple[Gateway, str]]:
    """A gateway whose semantic cache embeds with a fake embedding model, and the bundled
    SmolLM2's artifact (its tokenizer counts a fake chat model's prompts exactly, as the
    cache requires)."""
    process, endpoint = start_fake_engine()
    embedder = f"shadow-embedder-{uuid.uuid4().hex[:6]}"
    committed(django_db_blocker, lambda: register_fake_replica(embedder, endpoint, task="embedding"))
    smollm2 = bundled_models["versions"]["smollm2-135m-instruct"].artifact_uri
    yield spawn_gateway(SEMANTIC_CACHE_EMBEDDING_MODEL=embedder, REPLICA_STALE_AFTER="86400"), smollm2
    process.kill()
    process.wait(5)


class TestCacheHits:
    def test_a_request_answered_from_the_cache_is_not_copied(self, cache_gateway, api_key, django_db_blocker):
        gateway, artifact = cache_gateway
        processes = [start_fake_engine(), start_fake_engine()]
        name = f"shadowed-cached-{uuid.uuid4().hex[:8]}"

        def register() -> int:
            register_fake_replica(name, processes[0][1], version="1", artifact_uri=artifact)
            return register_fake_replica(name, processes[1][1], version="2", artifact_uri=artifact, weight=0)

        try:
            candidate = FakeModel(name, processes[1][1], processes[1][0], committed(django_db_blocker, register))
            set_policy(django_db_blocker, name, 100)
            question = {"messages": [{"role": "user", "content": "What is the tallest mountain?"}], "temperature": 0}
            first = chat(gateway, api_key, name, **question)
            assert first.headers["x-cache"] == "miss"
            misses = 1
            deadline = time.monotonic() + 10
            while (again := chat(gateway, api_key, name, **question)).headers["x-cache"] == "miss":
                misses += 1  # not stored yet: answered by the engine, and copied
                assert time.monotonic() < deadline, "the answer was not stored in the cache"
                time.sleep(0.1)
            assert again.headers["x-cache"] == "hit"
            time.sleep(1)
            assert candidate.requests() == misses  # every engine-answered request, never the hit
            assert shadow_records([again.headers["x-request-id"]], timeout=0) == {}
        finally:
            for process, _ in processes:
                process.kill()
                process.wait(5)
