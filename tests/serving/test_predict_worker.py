"""The predict worker (serving.predict.worker) in process: the replica's key, JSON and binary
tensors, a bad tensor refused before the model, a full queue refused at once (429), a failed
batch failing only its own requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from registry.small_models import build_digits
from serving.gateway.inference_protocol import (
    HEADER_LENGTH,
    MANY_PATH,
    Part,
    decode_outputs,
    encode_request,
    pack_many,
    read_body,
    unpack_answers,
)
from serving.predict.worker import KEY_ENV, Worker

KEY = "replica-secret"


@pytest.fixture(scope="module")
def digits_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("digits")
    return folder, build_digits(folder)


@pytest.fixture
async def worker(digits_artifact, monkeypatch) -> AsyncIterator[Worker]:
    folder, config = digits_artifact
    monkeypatch.setenv(KEY_ENV, KEY)
    config = {**config, "batcher": {"max_batch_size": 4, "max_queue_size": 4, "max_queue_delay_us": 1000}}
    worker = Worker(name="digits-mlp", version="1", artifact=folder, config=config, threads=1)
    worker.batcher.start()
    worker.ready = True
    yield worker
    await worker.batcher.stop()


def client(worker: Worker, key: str | None = KEY) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=worker), base_url="http://w", headers=headers)


def tensor(rows: int, width: int = 64) -> dict[str, Any]:
    return {"name": "pixels", "datatype": "FP32", "shape": [rows, width], "data": [8.0] * (rows * width)}


async def test_health_and_metrics_need_no_key_and_everything_else_does(worker):
    async with client(worker, key=None) as c:
        assert (await c.get("/health")).status_code == 200
        metrics = await c.get("/metrics")  # Prometheus scrapes it keyless, as vLLM's
        assert metrics.status_code == 200
        assert "predict:" in metrics.text
        refused = await c.post("/v2/models/digits-mlp/infer", json={"inputs": [tensor(1)]})
        assert refused.status_code == 401
    async with client(worker, key="another replica's") as c:
        assert (await c.get("/stats")).status_code == 401


async def test_json_and_binary_tensors_give_the_same_answer(worker):
    pixels = np.random.default_rng(1).uniform(0, 16, size=(3, 64)).astype(np.float32)
    async with client(worker) as c:
        as_json = await c.post(
            "/v2/models/digits-mlp/infer",
            json={"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [3, 64], "data": pixels.tolist()}]},
        )
        body, length = encode_request({"pixels": pixels}, worker.signature)
        as_binary = await c.post("/v2/models/digits-mlp/infer", content=body, headers={HEADER_LENGTH: str(length)})
    assert as_json.status_code == as_binary.status_code == 200
    from_json = decode_outputs(worker.signature, as_json.json())
    from_binary = decode_outputs(worker.signature, read_body(as_binary.content, as_binary.headers[HEADER_LENGTH]))
    np.testing.assert_array_equal(from_json["label"], from_binary["label"])
    np.testing.assert_allclose(from_json["probabilities"], from_binary["probabilities"], rtol=1e-6)
    assert from_json["label"].shape == (3,)


async def test_a_bad_tensor_is_a_400_naming_it_and_never_reaches_the_model(worker):
    async with client(worker) as c:
        response = await c.post("/v2/models/digits-mlp/infer", json={"inputs": [tensor(1, width=10)]})
        too_many = await c.post("/v2/models/digits-mlp/infer", json={"inputs": [tensor(5)]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_tensor", "pixels")
    assert "'pixels'" in error["message"]
    assert too_many.status_code == 400
    assert too_many.json()["error"]["code"] == "batch_too_large"
    assert worker.batcher.stats.batch_sizes == {}


async def test_a_full_queue_is_refused_at_once_with_429(worker):
    run = worker.batcher._run_batch

    def slow(payloads: list[Any]) -> Any:
        time.sleep(0.3)
        return run(payloads)

    worker.batcher._run_batch = slow
    async with client(worker) as c:
        # 4 rows take the model, 4 more fill the queue; the next must not wait.
        requests = [c.post("/v2/models/digits-mlp/infer", json={"inputs": [tensor(4)]}) for _ in range(4)]
        responses = await asyncio.gather(*requests)
    statuses = sorted(r.status_code for r in responses)
    assert 429 in statuses
    assert 200 in statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "model_queue_full"
    assert worker.batcher.stats.refused >= 1


async def test_a_failed_batch_fails_only_its_requests(worker):
    run = worker.batcher._run_batch
    calls = 0

    def first_fails(payloads: list[Any]) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("the model crashed")
        return run(payloads)

    worker.batcher._run_batch = first_fails
    async with client(worker) as c:
        failed = await c.post("/v2/models/digits-mlp/infer", json={"inputs": [tensor(1)]})
        ok = await c.post("/v2/models/digits-mlp/infer", json={"inputs": [tensor(1)]})
        stats = (await c.get("/stats")).json()
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == "model_error"
    assert ok.status_code == 200
    assert stats["failed"] == 1


async def test_several_requests_in_one_call_are_each_answered_as_if_alone(worker):
    """The gateway's calls that carry several predictions (MANY_PATH): each part gets the
    answer (and the status) it would get alone, in order; one bad part spoils no other."""
    rng = np.random.default_rng(7)
    inputs = [rng.uniform(0, 16, size=(rows, 64)).astype(np.float32) for rows in (1, 2, 1)]  # 4 rows: the queue's size
    parts = []
    for pixels in inputs:
        body, length = encode_request({"pixels": pixels}, worker.signature)
        parts.append(Part(0, str(length), body))
    parts.insert(1, Part(0, None, orjson.dumps({"inputs": [tensor(1, width=10)]})))  # a bad tensor
    async with client(worker) as c:
        together = await c.post(MANY_PATH, content=pack_many(parts))
        alone = []
        for pixels in inputs:
            body, length = encode_request({"pixels": pixels}, worker.signature)
            headers = {HEADER_LENGTH: str(length)}
            alone.append(await c.post("/v2/models/digits-mlp/infer", content=body, headers=headers))
        garbled = await c.post(MANY_PATH, content=b"\x00\x00\x00\x05[1,2")
    assert together.status_code == 200
    by_index = unpack_answers(together.content, len(parts))
    answers = [by_index[i] for i in range(len(parts))]
    assert [a.status for a in answers] == [200, 400, 200, 200]
    assert orjson.loads(answers[1].body)["error"]["param"] == "pixels"
    for answer, single in zip([answers[0], *answers[2:]], alone, strict=True):
        got = decode_outputs(worker.signature, read_body(answer.body, answer.header_length))
        want = decode_outputs(worker.signature, read_body(single.content, single.headers[HEADER_LENGTH]))
        np.testing.assert_array_equal(got["label"], want["label"])
        np.testing.assert_allclose(got["probabilities"], want["probabilities"], rtol=1e-6)
    assert garbled.status_code == 400
