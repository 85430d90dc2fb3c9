"""Batch jobs on the real engines: a chat batch on SmolLM2 (vLLM, priority scheduling: the
batch's lines carry a low priority), an embeddings batch on MiniLM and a predict batch on the
bundled sentiment model, each through the unmodified openai SDK and a real batch worker."""

from __future__ import annotations

import orjson
import pytest

from tests.support.batch_worker import results_of, sdk_client, usage_of, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.django_db]

CHAT, EMBED, SENTIMENT = "smollm2-135m-instruct", "all-minilm-l6-v2", "sentiment-minilm"
# Real replicas send heartbeats: the usual staleness; a CPU engine may take its time.
REAL_ENV = {"REPLICA_STALE_AFTER": "30", "ENGINE_REQUEST_TIMEOUT": "120", "ENGINE_FIRST_TOKEN_TIMEOUT": "60"}


def _file(url: str, bodies: list[dict[str, object]]) -> bytes:
    return b"".join(
        orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}) + b"\n"
        for i, body in enumerate(bodies)
    )


@pytest.mark.parametrize(
    ("url", "bodies", "check"),
    [
        (
            "/v1/chat/completions",
            [
                {"model": CHAT, "max_tokens": 4, "messages": [{"role": "user", "content": f"Count to {i}."}]}
                for i in range(3)
            ],
            lambda body: body["choices"][0]["message"]["content"] is not None and body["usage"]["completion_tokens"],
        ),
        (
            "/v1/embeddings",
            [{"model": EMBED, "input": text} for text in ("a cat", "a dog", "a boat")],
            lambda body: len(body["data"][0]["embedding"]) == 384,
        ),
        (
            "/api/v1/predict",
            [{"model": SENTIMENT, "input": {"text": text}} for text in ("I love it", "I hate it", "Great!")],
            lambda body: body["prediction"] in ("positive", "negative") and 0 < body["confidence"] <= 1,
        ),
    ],
)
def test_a_batch_on_each_kind_of_engine(engines, gateway, worker_factory, api_key, url, bodies, check):
    client = sdk_client(gateway, api_key.secret)
    uploaded = client.files.create(file=("in.jsonl", _file(url, bodies)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=url, completion_window="24h")
    done = wait_for(client, batch.id, worker_factory(**REAL_ENV), until={"completed", "failed"}, timeout=180)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 3, 0), done
    results = results_of(client, done.output_file_id)
    assert [r["custom_id"] for r in results] == ["r0", "r1", "r2"]
    assert all(r["response"]["status_code"] == 200 and check(r["response"]["body"]) for r in results), results
    records = usage_of(done.id, 3)
    assert len(records) == 3
    assert all(r.batch for r in records)
