"""The seeds' generate and embed shapes, end to end over the real engines: the same answers,
headers and metering as the OpenAI paths they adapt."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import orjson
import pytest

from tests.support.gateway import persisted

pytestmark = [pytest.mark.engine, pytest.mark.django_db]

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"
QUESTION = "What is the capital of France?"


def _post(gateway, path, secret, body):
    return httpx.post(
        f"{gateway.base_url}{path}", json=body, headers={"Authorization": f"Bearer {secret}"}, timeout=120
    )


def _events(response: httpx.Response) -> list[object]:
    events = []
    for block in response.text.split("\n\n"):
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


class TestGenerate:
    def test_json_is_the_chat_answer_metered_once(self, gateway, api_key):
        body = {"model": CHAT, "prompt": QUESTION, "max_tokens": 12, "temperature": 0}
        seeds = _post(gateway, "/api/v1/generate", api_key.secret, body)
        assert seeds.status_code == 200, seeds.text
        answer = seeds.json()
        assert set(answer) == {"model", "text", "finish_reason", "usage", "latency_ms"}
        assert answer["model"] == CHAT
        assert answer["text"]
        assert answer["finish_reason"] in {"stop", "length"}
        assert seeds.headers["x-model-version"]
        assert seeds.headers["x-cache"] == "miss"
        # The same request on the chat path answers the same text (greedy, same replica).
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=api_key.secret, max_retries=0)
        chat = client.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0,
            extra_headers={"Cache-Control": "no-cache"},
        )  # fmt: skip
        assert chat.choices[0].message.content == answer["text"]
        record = persisted([seeds.headers["x-request-id"]])[seeds.headers["x-request-id"]]
        assert record.completion_tokens == answer["usage"]["completion_tokens"] > 0
        assert record.prompt_tokens == answer["usage"]["prompt_tokens"]

    def test_stream_is_tokens_then_the_finish(self, gateway, api_key):
        body = {"prompt": "Count from one to five.", "max_tokens": 10, "temperature": 0, "stream": True}
        response = _post(gateway, f"/api/v1/models/{CHAT}/generate", api_key.secret, body)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
        assert events[-1] == "[DONE]"
        finish = events[-2]
        tokens = events[:-2]
        assert tokens
        assert all(set(e) == {"token"} and e["token"] for e in tokens)
        assert finish["finish_reason"] in {"stop", "length"}
        assert finish["usage"]["completion_tokens"] >= len(tokens) > 0
        record = persisted([response.headers["x-request-id"]])[response.headers["x-request-id"]]
        assert record.completion_tokens == finish["usage"]["completion_tokens"]

    @pytest.mark.parametrize(
        ("path", "body", "param"),
        [
            ("/api/v1/generate", {"prompt": "hi"}, "model"),
            ("/api/v1/generate", {"model": CHAT}, "prompt"),
            ("/api/v1/generate", {"model": CHAT, "prompt": "hi", "stream": "yes"}, "stream"),
            ("/api/v1/generate", {"model": CHAT, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
            (f"/api/v1/models/{CHAT}/generate", {"model": EMBED, "prompt": "hi"}, "model"),
            ("/api/v1/generate", {"model": EMBED, "prompt": "hi"}, "model"),
            ("/api/v1/embed", {"model": EMBED}, "inputs"),
            ("/api/v1/embed", {"model": EMBED, "inputs": ["ok", 3]}, "inputs"),
            ("/api/v1/embed", {"model": CHAT, "inputs": ["ok"]}, "model"),
        ],
    )
    def test_bad_bodies_are_openai_errors(self, gateway, api_key, path, body, param):
        response = _post(gateway, path, api_key.secret, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param

    def test_a_key_is_needed(self, gateway):
        response = httpx.post(f"{gateway.base_url}/api/v1/generate", json={"model": CHAT, "prompt": "x"}, timeout=30)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "missing_api_key"


class TestEmbed:
    def test_it_is_the_embeddings_answer(self, gateway, api_key):
        texts = ["Hello world", "How are you"]
        response = _post(gateway, "/api/v1/embed", api_key.secret, {"model": EMBED, "inputs": texts})
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["dimensions"] == 384
        assert len(answer["embeddings"]) == 2
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=api_key.secret, max_retries=0)
        reference = client.embeddings.create(model=EMBED, input=texts)
        for mine, theirs in zip(answer["embeddings"], reference.data, strict=True):
            assert np.allclose(mine, theirs.embedding, atol=1e-5)
        record = persisted([response.headers["x-request-id"]])[response.headers["x-request-id"]]
        assert record.prompt_tokens == answer["usage"]["prompt_tokens"] > 0
