"""The OpenAI-compatible API end to end: the official SDK → daphne → real vLLM replicas."""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.support.gateway import committed, engine_counter, persisted, request_id_of

pytestmark = [pytest.mark.engine, pytest.mark.django_db]

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"
# Never assert a fixed text from the engine: greedy answers differ between CPUs (bf16 kernels).
# Answers are compared with the same replica's own answer to the same request.
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def sdk(gateway, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0, timeout=120)


class TestModels:
    def test_it_lists_the_models_the_key_may_use(self, gateway, api_key):
        ids = {m.id for m in sdk(gateway, api_key.secret).models.list().data}
        assert {CHAT, EMBED} <= ids

    def test_a_restricted_key_sees_only_its_models(self, gateway, make_api_key):
        key = make_api_key(allowed_models=[EMBED])
        client = sdk(gateway, key.secret)
        assert [m.id for m in client.models.list().data] == [EMBED]
        assert client.models.retrieve(EMBED).id == EMBED
        with pytest.raises(openai.BadRequestError) as excinfo:  # outside its scope, a model does not exist
            client.models.retrieve(CHAT)
        assert excinfo.value.body["code"] == "model_not_found"


class TestEngineKeys:
    def test_a_replica_refuses_callers_without_its_key(self, engines, django_db_blocker):
        endpoint = engines.endpoint(CHAT, django_db_blocker)
        body = {"model": CHAT, "messages": FRANCE, "max_tokens": 1}
        assert httpx.post(f"{endpoint}/v1/chat/completions", json=body, timeout=30).status_code == 401
        wrong = {"Authorization": f"Bearer {engines.key(EMBED)}"}  # another replica's key
        assert httpx.post(f"{endpoint}/v1/chat/completions", json=body, headers=wrong, timeout=30).status_code == 401
        right = {"Authorization": f"Bearer {engines.key(CHAT)}"}
        assert httpx.post(f"{endpoint}/v1/chat/completions", json=body, headers=right, timeout=30).status_code == 200


class TestChatCompletions:
    def test_json_answer_is_real_and_metered(self, gateway, api_key, engines, django_db_blocker):
        raw = sdk(gateway, api_key.secret).chat.completions.with_raw_response.create(
            model=CHAT, messages=FRANCE, max_tokens=30, temperature=0
        )
        completion = raw.parse()
        request_id = raw.headers["x-request-id"]
        theirs = engines.direct(CHAT, django_db_blocker).chat.completions.create(
            model=CHAT, messages=FRANCE, max_tokens=30, temperature=0
        )
        assert completion.choices[0].message.content == theirs.choices[0].message.content
        assert completion.choices[0].message.content
        assert completion.usage.completion_tokens == theirs.usage.completion_tokens
        assert completion.id == f"chatcmpl-{request_id.replace('-', '')}"
        assert completion.model == CHAT
        record = persisted([request_id])[request_id]
        assert (record.status_code, record.model, record.model_version) == (200, CHAT, "0.1.2")
        assert (record.prompt_tokens, record.completion_tokens) == (
            completion.usage.prompt_tokens,
            completion.usage.completion_tokens,
        )
        assert record.total_tokens == completion.usage.total_tokens
        assert (record.api_key_id, record.organization_id) == (api_key.key_id, api_key.organization_id)

    def test_stream_with_usage(self, gateway, api_key, engines, django_db_blocker):
        client = sdk(gateway, api_key.secret)
        theirs = engines.direct(CHAT, django_db_blocker).chat.completions.create(
            model=CHAT, messages=FRANCE, max_tokens=30, temperature=0
        )
        chunks = list(
            client.chat.completions.create(
                model=CHAT, messages=FRANCE, max_tokens=30, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        assert len({c.id for c in chunks}) == 1
        assert {c.model for c in chunks} == {CHAT}
        *content_chunks, last = chunks
        assert last.choices == []
        assert last.usage.completion_tokens == theirs.usage.completion_tokens
        assert all(c.usage is None for c in content_chunks)
        text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
        assert text == theirs.choices[0].message.content
        request_id = request_id_of(last.id)
        record = persisted([request_id])[request_id]
        assert (record.status_code, record.completion_tokens, record.prompt_tokens) == (
            200,
            theirs.usage.completion_tokens,
            last.usage.prompt_tokens,
        )
        assert record.ttft_ms is not None
        assert 0 < record.ttft_ms <= record.latency_ms

    def test_stream_without_usage_has_no_usage_chunk(self, gateway, api_key):
        chunks = list(
            sdk(gateway, api_key.secret).chat.completions.create(
                model=CHAT, messages=FRANCE, max_tokens=5, temperature=0, stream=True
            )
        )
        assert all(c.choices for c in chunks)
        assert all(c.usage is None for c in chunks)

    def test_sse_wire_format(self, gateway, api_key):
        body = {"model": CHAT, "messages": FRANCE, "max_tokens": 3, "stream": True}
        with httpx.stream(
            "POST", f"{gateway.base_url}/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {api_key.secret}"}, timeout=60,
        ) as response:  # fmt: skip
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-request-id"]
            lines = [line for line in response.iter_lines() if line]
        assert all(line.startswith("data: ") for line in lines)
        assert lines[-1] == "data: [DONE]"

    def test_same_answer_as_the_replica_directly(self, gateway, api_key, engines, django_db_blocker):
        direct = engines.direct(CHAT, django_db_blocker)
        messages = [{"role": "user", "content": "Name three colours."}]
        ours = sdk(gateway, api_key.secret).chat.completions.create(
            model=CHAT, messages=messages, max_tokens=20, temperature=0, seed=7
        )
        theirs = direct.chat.completions.create(model=CHAT, messages=messages, max_tokens=20, temperature=0, seed=7)
        assert ours.choices[0].message.content == theirs.choices[0].message.content
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens

    def test_the_seed_path_alias(self, gateway, api_key):
        client = openai.OpenAI(base_url=f"{gateway.base_url}/api/v1", api_key=api_key.secret, max_retries=0)
        answer = client.chat.completions.create(model=CHAT, messages=FRANCE, max_tokens=30, temperature=0)
        assert answer.choices[0].message.content
        assert answer.model == CHAT


class TestCompletions:
    def test_completion_matches_the_replica(self, gateway, api_key, engines, django_db_blocker):
        direct = engines.direct(CHAT, django_db_blocker)
        ours = sdk(gateway, api_key.secret).completions.create(
            model=CHAT, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        theirs = direct.completions.create(model=CHAT, prompt="The capital of France is", max_tokens=8, temperature=0)
        assert ours.choices[0].text == theirs.choices[0].text
        assert ours.choices[0].text
        assert ours.id.startswith("cmpl-")
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens

    def test_streamed_completion(self, gateway, api_key, engines, django_db_blocker):
        chunks = list(
            sdk(gateway, api_key.secret).completions.create(
                model=CHAT, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        theirs = engines.direct(CHAT, django_db_blocker).completions.create(
            model=CHAT, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert chunks[-1].usage.completion_tokens == theirs.usage.completion_tokens
        assert "".join(c.choices[0].text for c in chunks if c.choices) == theirs.choices[0].text


class TestEmbeddings:
    def test_base64_and_float_equal_the_replica(self, gateway, api_key, engines, django_db_blocker):
        texts = ["a cat sat on the mat", "stock markets fell"]
        client = sdk(gateway, api_key.secret)
        default = client.embeddings.create(model=EMBED, input=texts)  # the SDK asks for base64
        floats = client.embeddings.create(model=EMBED, input=texts, encoding_format="float")
        direct = httpx.post(
            f"{engines.endpoint(EMBED, django_db_blocker)}/v1/embeddings",
            json={"model": EMBED, "input": texts, "encoding_format": "float"},
            headers={"Authorization": f"Bearer {engines.key(EMBED)}"},
            timeout=30,
        ).json()
        expected = np.array([d["embedding"] for d in direct["data"]])
        assert expected.shape == (2, 384)
        assert np.allclose([d.embedding for d in default.data], expected, atol=1e-6)
        assert np.allclose([d.embedding for d in floats.data], expected, atol=1e-6)
        assert np.allclose(np.linalg.norm(expected, axis=1), 1.0, atol=1e-3)
        assert default.usage.prompt_tokens == direct["usage"]["prompt_tokens"]

    def test_embeddings_are_metered(self, gateway, api_key):
        raw = sdk(gateway, api_key.secret).embeddings.with_raw_response.create(model=EMBED, input="hello")
        request_id = raw.headers["x-request-id"]
        record = persisted([request_id])[request_id]
        assert (record.status_code, record.prompt_tokens, record.completion_tokens) == (
            200,
            raw.parse().usage.prompt_tokens,
            0,
        )


class TestSemanticCache:
    """The cache's real path: the embedding replica embeds, pgvector finds, the verifier checks."""

    def test_an_answer_is_replayed_to_the_same_question_and_a_near_repeat_never_to_a_trap(
        self, gateway, api_key, engines, django_db_blocker
    ):
        from serving.models import CacheEntry

        client = sdk(gateway, api_key.secret)

        def ask(question: str) -> Any:
            return client.chat.completions.with_raw_response.create(
                model=CHAT, messages=[{"role": "user", "content": question}], max_tokens=20, temperature=0
            )

        first = ask("What is the capital of France?")
        assert first.headers["x-cache"] == "miss"
        # The answer is stored off the request path: wait until the gateway has committed it.
        stored = lambda: CacheEntry.objects.filter(organization_id=api_key.organization_id).count()  # noqa: E731
        deadline = time.monotonic() + 30
        while committed(django_db_blocker, stored) < 1:
            assert time.monotonic() < deadline, "the first answer was never stored"
            time.sleep(0.2)

        again = ask("What is the capital of France?")
        near = ask("what is the capital of france")  # casing and punctuation: a near-repeat
        trap = ask("What is the capital of Germany?")
        assert [r.headers["x-cache"] for r in (again, near, trap)] == ["hit", "semantic-hit", "miss"]
        assert float(near.headers["x-cache-similarity"]) >= 0.9
        answer = first.parse().choices[0].message.content
        for replay in (again, near):
            completion = replay.parse()
            assert completion.choices[0].message.content == answer
            usage = completion.usage
            assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens
        # The trap was answered by the engine: the replica's own answer to it.
        theirs = engines.direct(CHAT, django_db_blocker).chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "What is the capital of Germany?"}], max_tokens=20,
            temperature=0,
        )  # fmt: skip
        assert trap.parse().choices[0].message.content == theirs.choices[0].message.content

        ids = [r.headers["x-request-id"] for r in (first, again, near, trap)]
        records = persisted(ids)
        assert [records[i].cache for i in ids] == ["miss", "hit", "semantic-hit", "miss"]
        for i in ids[1:3]:
            assert records[i].cached_tokens == records[i].prompt_tokens > 0


def _post(gateway, path, *, json=None, content=None, secret=None, method="POST"):
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
    return httpx.request(method, f"{gateway.base_url}{path}", json=json, content=content, headers=headers, timeout=30)


class TestRefusedRequestsDispatchNothing:
    """Each refusal: the right status and OpenAI error body; the engine sees nothing; no usage."""

    @pytest.fixture
    def nothing_dispatched(self, engines, django_db_blocker):
        from billing.models import UsageRecord
        from billing.usage import persist_usage_stream

        endpoint = engines.endpoint(CHAT, django_db_blocker)
        before = engine_counter(endpoint, "vllm:prompt_tokens_total")
        persist_usage_stream()
        records_before = UsageRecord.objects.count()
        yield
        time.sleep(0.3)
        assert engine_counter(endpoint, "vllm:prompt_tokens_total") == before
        persist_usage_stream()
        assert UsageRecord.objects.count() == records_before

    @pytest.mark.parametrize(
        ("body", "status", "param", "code"),
        [
            ({"model": CHAT}, 400, "messages", "missing_required_parameter"),
            ({"model": CHAT, "messages": FRANCE, "temperature": "hot"}, 400, "temperature", "invalid_value"),
            ({"model": CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role",
             "invalid_value"),
            ({"model": CHAT, "messages": FRANCE, "n": 17}, 400, "n", "invalid_value"),
            ({"model": CHAT, "messages": FRANCE, "bogus": 1}, 400, "bogus", None),
            ({"model": "no-such-model", "messages": FRANCE}, 400, "model", "model_not_found"),
            ({"model": CHAT, "messages": FRANCE, "max_tokens": 9000}, 400, "max_tokens", "context_length_exceeded"),
            ({"model": CHAT, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages",
             "context_length_exceeded"),
            ({"model": EMBED, "messages": FRANCE}, 400, "model", "model_not_supported"),
        ],
    )  # fmt: skip
    def test_invalid_bodies(self, gateway, api_key, nothing_dispatched, body, status, param, code):
        response = _post(gateway, "/v1/chat/completions", json=body, secret=api_key.secret)
        assert response.status_code == status
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
        assert response.headers["x-request-id"]

    def test_malformed_json(self, gateway, api_key, nothing_dispatched):
        response = _post(gateway, "/v1/chat/completions", content=b'{"model": ', secret=api_key.secret)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_json"

    def test_missing_key(self, gateway, nothing_dispatched):
        response = _post(gateway, "/v1/chat/completions", json={"model": CHAT, "messages": FRANCE})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "missing_api_key"

    def test_unknown_key(self, gateway, nothing_dispatched):
        response = _post(
            gateway, "/v1/chat/completions", json={"model": CHAT, "messages": FRANCE}, secret="sk-nope" * 5
        )
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key"
        assert "sk-nopesk-nope" not in error["message"]  # the key is not echoed back

    def test_revoked_key(self, gateway, make_api_key, django_db_blocker, nothing_dispatched):
        from accounts.models import ApiKey

        key = make_api_key()
        assert _post(gateway, "/v1/models", method="GET", secret=key.secret).status_code == 200
        committed(django_db_blocker, lambda: ApiKey.objects.filter(pk=key.key_id).update(is_active=False))
        time.sleep(1.1)  # the gateway trusts a cached key for at most 1 s
        response = _post(gateway, "/v1/chat/completions", json={"model": CHAT, "messages": FRANCE}, secret=key.secret)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"

    def test_expired_key(self, gateway, make_api_key, django_db_blocker, nothing_dispatched):
        from datetime import UTC, datetime, timedelta

        from accounts.models import ApiKey

        key = make_api_key(expires_at=datetime.now(UTC) + timedelta(seconds=30))  # only a future expiry is accepted
        expired = datetime.now(UTC) - timedelta(seconds=1)
        committed(django_db_blocker, lambda: ApiKey.objects.filter(pk=key.key_id).update(expires_at=expired))
        time.sleep(1.1)  # the gateway trusts a cached key for at most 1 s
        response = _post(gateway, "/v1/chat/completions", json={"model": CHAT, "messages": FRANCE}, secret=key.secret)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "expired_api_key"

    def test_model_outside_the_keys_scope(self, gateway, make_api_key, nothing_dispatched):
        key = make_api_key(allowed_models=[EMBED])
        response = _post(gateway, "/v1/chat/completions", json={"model": CHAT, "messages": FRANCE}, secret=key.secret)
        assert response.status_code == 400  # outside its scope, a model does not exist
        assert response.json()["error"]["code"] == "model_not_found"

    def test_wrong_method_and_unknown_path_are_json(self, gateway, api_key, nothing_dispatched):
        wrong = _post(gateway, "/v1/chat/completions", method="GET", secret=api_key.secret)
        assert wrong.status_code == 405
        assert wrong.json()["error"]["code"] == "method_not_allowed"
        unknown = _post(gateway, "/v1/nothing-here", secret=api_key.secret)
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "unknown_url"
