"""Usage records say why generation stopped (``finish_reason``), as the engine told the client.

Through a real gateway and the fake engine (tests/support/fake_engine.py), whose JSON answers always
stop by ``length`` and whose streams end without a finishing chunk (no reason: recorded
empty); ``stop`` from a real engine is in tests/serving/test_metering.py.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import httpx
import orjson
import pytest

from tests.support.gateway import chat, committed, persisted, register_fake_replica, start_fake_engine

pytestmark = pytest.mark.django_db


def last_finish_reason(response: httpx.Response) -> str:
    """The last finish reason a stream's choices carried ("" when none did)."""
    reason = ""
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in orjson.loads(line[6:]).get("choices") or []:
            reason = choice.get("finish_reason") or reason
    return reason


class TestFinishReasonOnUsageRecords:
    def test_a_json_answer_cut_by_its_limit_is_recorded_as_length(self, fault_gateway, api_key, fake_model):
        response = chat(fault_gateway, api_key, fake_model.name, max_tokens=5)
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "length"
        request_id = response.headers["x-request-id"]
        assert persisted([request_id])[request_id].finish_reason == "length"

    def test_a_stream_records_what_its_last_chunks_said(self, fault_gateway, api_key, fake_model):
        response = chat(fault_gateway, api_key, fake_model.name, stream=True)
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        record = persisted([request_id])[request_id]
        assert record.status_code == 200
        # The fake engine's streams carry no finishing chunk: "" (unknown). A real engine's
        # "stop"/"length" are checked in test_metering.py.
        assert record.finish_reason == last_finish_reason(response)

    def test_a_failed_request_has_no_finish_reason(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="error500")
        response = chat(fault_gateway, api_key, fake_model.name)
        assert response.status_code == 502
        request_id = response.headers["x-request-id"]
        assert persisted([request_id])[request_id].finish_reason == ""

    def test_embeddings_have_no_finish_reason(self, fault_gateway, api_key, django_db_blocker):
        process, endpoint = start_fake_engine()
        try:
            name = f"fake-embed-{uuid.uuid4().hex[:8]}"
            committed(django_db_blocker, lambda: register_fake_replica(name, endpoint, task="embedding"))
            response = httpx.post(
                f"{fault_gateway.base_url}/v1/embeddings", timeout=30, json={"model": name, "input": "hello"},
                headers={"Authorization": f"Bearer {api_key.secret}"},
            )  # fmt: skip
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            assert persisted([request_id])[request_id].finish_reason == ""
        finally:
            process.kill()
            process.wait(5)


class TestCacheHits:
    def test_a_hit_is_recorded_with_the_stored_answers_finish_reason(
        self, bundled_models, api_key, spawn_gateway, django_db_blocker
    ):
        processes = [start_fake_engine(), start_fake_engine()]
        (_, chat_endpoint), (_, embed_endpoint) = processes
        suffix = uuid.uuid4().hex[:6]
        name, embedder = f"finish-cached-{suffix}", f"finish-embedder-{suffix}"
        # The bundled SmolLM2's tokenizer counts the fake model's prompts exactly, as the cache requires.
        artifact = bundled_models["versions"]["smollm2-135m-instruct"].artifact_uri

        def register() -> None:
            register_fake_replica(name, chat_endpoint, artifact_uri=artifact)
            register_fake_replica(embedder, embed_endpoint, task="embedding")

        try:
            committed(django_db_blocker, register)
            gateway = spawn_gateway(SEMANTIC_CACHE_EMBEDDING_MODEL=embedder, REPLICA_STALE_AFTER="86400")
            question = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "temperature": 0}
            first = chat(gateway, api_key, name, **question)
            assert first.headers["x-cache"] == "miss"
            for stream in (False, True):
                deadline = time.monotonic() + 10
                while (hit := chat(gateway, api_key, name, stream=stream, **question)).headers["x-cache"] == "miss":
                    assert time.monotonic() < deadline, "the answer was not stored in the cache"
                    time.sleep(0.1)
                request_id = hit.headers["x-request-id"]
                record = persisted([request_id])[request_id]
                assert (record.cache, record.finish_reason) == ("hit", "length")  # as the engine's answer ended
        finally:
            for process, _ in processes:
                process.kill()
                process.wait(5)


class TestSeveralChoices:
    """n > 1 (or several prompts): "length" when any choice was cut, else the first choice's."""

    def _reason(self, *chunks):
        from serving.gateway.openai_wire import finish_reason_of, note_finish_reasons

        reasons: dict[int, str] = {}
        for choices in chunks:
            note_finish_reasons(reasons, choices)
        return finish_reason_of(reasons)

    def test_any_choice_cut_makes_it_length(self):
        assert (
            self._reason([{"index": 0, "finish_reason": "stop"}, {"index": 1, "finish_reason": "length"}]) == "length"
        )

    def test_otherwise_the_first_choice_says(self):
        # A stream ends its choices one by one, in any order.
        first, second = (
            [{"index": 1, "finish_reason": "stop", "delta": {}}],
            [{"index": 0, "finish_reason": "tool_calls"}],
        )
        assert self._reason(first, second) == "tool_calls"

    def test_unfinished_choices_say_nothing(self):
        assert self._reason([{"index": 0, "finish_reason": None, "delta": {"content": "x"}}], None, []) == ""


class TestUsageEventField:
    def _event(self, **changes):
        from billing.ledger import UsageEvent

        fields = {
            "request_id": uuid.uuid4(), "api_key_id": 1, "organization_id": 2, "model": "m", "model_version": "1",
            "endpoint": "chat", "prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 0, "latency_ms": 10,
            "ttft_ms": None, "status_code": 200, "created_at": datetime(2026, 11, 22, 6, tzinfo=UTC),
        }  # fmt: skip
        return UsageEvent(**(fields | changes))

    def test_it_travels_on_the_stream(self):
        from billing.ledger import UsageEvent

        event = self._event(finish_reason="length")
        assert UsageEvent.from_fields(event.to_fields()) == event

    def test_an_entry_written_before_the_field_existed_reads_as_unknown(self):
        from billing.ledger import UsageEvent

        fields = self._event().to_fields()
        del fields["finish_reason"]
        assert UsageEvent.from_fields(fields).finish_reason == ""

    def test_a_reason_longer_than_the_record_keeps_is_refused(self):
        from billing.ledger import UsageEvent

        with pytest.raises(ValueError, match="finish_reason"):
            UsageEvent.from_fields(self._event().to_fields() | {"finish_reason": "x" * 17})
