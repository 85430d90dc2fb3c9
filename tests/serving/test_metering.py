"""Exactly one usage record per admitted request, whatever happens to it."""

from __future__ import annotations

import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest

from tests.support.gateway import committed, engine_counter, persisted, request_id_of

pytestmark = [pytest.mark.engine, pytest.mark.django_db]

CHAT = "smollm2-135m-instruct"
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]


def _stream(gateway, secret, **body):
    return httpx.stream(
        "POST", f"{gateway.base_url}/v1/chat/completions", timeout=120,
        json={"model": CHAT, "messages": STORY, "stream": True, **body},
        headers={"Authorization": f"Bearer {secret}"},
    )  # fmt: skip


class TestExactlyOnce:
    def test_a_client_that_disconnects_mid_stream(self, gateway, api_key, engines, django_db_blocker):
        endpoint = engines.endpoint(CHAT, django_db_blocker)
        # Long enough (no EOS) that the disconnect always lands mid-generation, even on a fast CPU
        # where the client thread is descheduled for seconds: 400 tokens once finished first.
        with _stream(gateway, api_key.secret, max_tokens=3000, ignore_eos=True) as response:
            request_id = response.headers["x-request-id"]
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 5:
                    break
        # The gateway closed the upstream, so vLLM aborted the sequence long before 3,000 tokens.
        deadline = time.monotonic() + 10
        while engine_counter(endpoint, "vllm:num_requests_running") > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert engine_counter(endpoint, "vllm:num_requests_running") == 0
        record = persisted([request_id])[request_id]
        assert record.status_code == 499
        assert 4 <= record.completion_tokens < 3000
        assert record.total_tokens == record.prompt_tokens + record.completion_tokens

    def test_a_replayed_event_is_not_counted_twice(self, gateway, api_key):
        from billing.models import UsageRecord
        from billing.usage import persist_usage_stream
        from core import keys
        from core.redis import sync_redis

        persist_usage_stream()  # drain what earlier tests left
        raw = openai.OpenAI(
            base_url=f"{gateway.base_url}/v1", api_key=api_key.secret
        ).chat.completions.with_raw_response
        request_id = raw.create(model=CHAT, messages=STORY, max_tokens=4).headers["x-request-id"]
        client = sync_redis()
        entries = [f for _, f in client.xrange(keys.usage_stream()) if f[b"request_id"].decode() == request_id]
        assert len(entries) == 1
        client.xadd(keys.usage_stream(), entries[0])  # the same event delivered again
        client.xadd(keys.usage_stream(), entries[0])
        persist_usage_stream()
        assert UsageRecord.objects.filter(request_id=request_id).count() == 1

    def test_a_gateway_killed_right_after_its_response(self, engines, api_key, spawn_gateway):
        doomed = spawn_gateway()
        client = openai.OpenAI(base_url=f"{doomed.base_url}/v1", api_key=api_key.secret, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model=CHAT, messages=STORY, max_tokens=6)
        os.kill(doomed.process.pid, signal.SIGKILL)
        doomed.process.wait(10)
        request_id = raw.headers["x-request-id"]
        record = persisted([request_id])[request_id]
        assert (record.status_code, record.completion_tokens) == (200, raw.parse().usage.completion_tokens)

    def test_a_gateway_killed_mid_request_is_closed_by_the_sweeper(self, fake_model, api_key, spawn_gateway, settings):
        from billing.ledger import sweep_lost_requests

        fake_model.control(mode="hang")
        doomed = spawn_gateway(REPLICA_STALE_AFTER="86400", GATEWAY_HEARTBEAT_SECONDS="0.5", GATEWAY_LOST_AFTER="2")

        def call() -> int:
            body = {"model": fake_model.name, "messages": STORY, "stream": True}
            headers = {"Authorization": f"Bearer {api_key.secret}"}
            try:
                httpx.post(f"{doomed.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30)
            except httpx.HTTPError:
                return -1
            return 0

        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(call)
            deadline = time.monotonic() + 10
            while fake_model.requests() == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert fake_model.requests() == 1  # admitted and dispatched; the engine hangs
            os.kill(doomed.process.pid, signal.SIGKILL)
            assert pending.result() == -1  # the client lost its connection
        doomed.process.wait(10)
        settings.GATEWAY_LOST_AFTER = 2
        time.sleep(2.5)  # its heartbeat key has expired
        sweep_lost_requests()  # the first sight of a missing heartbeat only makes the gateway a suspect
        assert fake_model.name in _inflight_models()
        time.sleep(2.1)
        sweep_lost_requests()  # still missing GATEWAY_LOST_AFTER later: dead
        assert fake_model.name not in _inflight_models()  # closed once
        from billing.models import UsageRecord
        from billing.usage import persist_usage_stream

        persist_usage_stream()
        record = UsageRecord.objects.filter(model=fake_model.name).get()
        assert record.status_code == 500
        assert record.api_key_id == api_key.key_id

    @pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
    def test_records_say_why_generation_stopped(self, gateway, api_key, stream):
        """``stop`` (a stop string) and ``length`` (max_tokens) from the real engine, as the client saw them."""
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=api_key.secret, max_retries=0)
        question = [{"role": "user", "content": f"Tell me about the sea. ({uuid.uuid4().hex[:6]})"}]
        seen: dict[str, str] = {}
        for expected, limits in (("stop", {"stop": [" ", "e", "a", "."], "max_tokens": 200}),
                                 ("length", {"max_tokens": 2})):  # fmt: skip
            raw = client.chat.completions.with_raw_response.create(
                model=CHAT, messages=question, temperature=0, stream=stream, **limits
            )
            if stream:
                reasons = [c.finish_reason for chunk in raw.parse() for c in chunk.choices if c.finish_reason]
                reason = reasons[-1]
            else:
                reason = raw.parse().choices[0].finish_reason
            assert reason == expected
            seen[raw.headers["x-request-id"]] = reason
        records = persisted(list(seen))
        assert {request_id: r.finish_reason for request_id, r in records.items()} == seen

    def test_a_replica_killed_mid_stream(self, gateway, api_key, engines, django_db_blocker):
        """Last in this module: it takes the chat replica down for a restart."""
        from registry.models import Replica

        replica_id = engines.replica_ids[CHAT]
        old_pid = committed(django_db_blocker, lambda: Replica.objects.get(pk=replica_id).pid)
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=api_key.secret, max_retries=0)
        stream = client.chat.completions.create(model=CHAT, messages=STORY, max_tokens=400, stream=True)
        seen = []
        with pytest.raises(openai.APIError) as excinfo:  # noqa: PT012
            for chunk in stream:
                seen.append(chunk)
                if len(seen) == 5:
                    os.killpg(old_pid, signal.SIGKILL)
        assert "engine" in str(excinfo.value).lower()
        request_id = request_id_of(seen[0].id)
        record = persisted([request_id])[request_id]
        assert record.status_code == 502
        assert 4 <= record.completion_tokens < 3000

        # runworkers notices, marks it failed and starts it again.
        deadline = time.monotonic() + 300
        replica = None
        while time.monotonic() < deadline:
            replica = committed(django_db_blocker, lambda: Replica.objects.get(pk=replica_id))
            if replica.state == "ready" and replica.pid != old_pid:
                break
            time.sleep(1)
        assert replica is not None
        assert replica.state == "ready"
        assert replica.pid != old_pid
        time.sleep(1.5)  # the gateway's routing snapshot refreshes within a second
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(model=CHAT, messages=question, max_tokens=30, temperature=0)
        theirs = engines.direct(CHAT, django_db_blocker).chat.completions.create(
            model=CHAT, messages=question, max_tokens=30, temperature=0
        )
        assert answer.choices[0].message.content == theirs.choices[0].message.content


def _inflight_models() -> set[str]:
    from core import keys
    from core.redis import sync_redis

    return {orjson.loads(raw)["model"] for raw in sync_redis().hvals(keys.inflight_requests())}


def test_usage_event_fields_are_strings_the_persister_reads():
    from billing.usage import parse_event

    event = {
        b"request_id": b"6f1c1d8e-2a1b-4c55-9d36-1f2a3b4c5d6e", b"api_key_id": b"1", b"organization_id": b"2",
        b"model": b"m", b"model_version": b"1", b"endpoint": b"chat", b"prompt_tokens": b"3",
        b"completion_tokens": b"4", b"cached_tokens": b"0", b"latency_ms": b"10", b"ttft_ms": b"",
        b"status_code": b"200", b"created_at": b"2026-11-22T06:00:00+00:00",
    }  # fmt: skip
    record = parse_event(event)
    assert (record.total_tokens, record.ttft_ms, record.created_at.tzinfo is not None) == (7, None, True)
    with pytest.raises(ValueError, match="negative"):
        parse_event({**event, b"prompt_tokens": b"-1"})
    assert orjson.loads(orjson.dumps({"ok": True}))["ok"]
