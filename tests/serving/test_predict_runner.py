"""An ONNX model behind the dynamic batcher (serving.predict.runner + batcher): concurrent
requests of different sizes share batches, and each gets exactly what it would have got alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from registry.signatures import Signature
from registry.small_models import build_digits
from serving.gateway.inference_protocol import decode_inputs
from serving.predict.batcher import BatcherConfig, DynamicBatcher
from serving.predict.runner import OnnxRunner


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> OnnxRunner:
    folder = tmp_path_factory.mktemp("digits")
    config = build_digits(folder)
    return OnnxRunner(folder / "model.onnx", Signature.from_json(config["signature"]), threads=1)


PIXELS = Signature.from_json({
    "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}],
    "outputs": [{"name": "label", "datatype": "INT64", "shape": [-1]}],
})  # fmt: skip


def requests_of(sizes: list[int]) -> list[dict[str, np.ndarray]]:
    """Requests of these many digits each, decoded as the protocol decodes them."""
    from sklearn.datasets import load_digits

    rows = load_digits().data.astype(np.float32)
    bounds = np.cumsum([0, *sizes])
    return [
        decode_inputs(PIXELS, [{"name": "pixels", "datatype": "FP32", "shape": [size, 64],
                                "data": rows[bounds[i] : bounds[i + 1]].tolist()}])[0]
        for i, size in enumerate(sizes)
    ]  # fmt: skip


def test_a_batch_is_cut_back_into_each_requests_rows(digits):
    requests = requests_of([1, 3, 2])
    together = digits.run_batch(requests)
    alone = [digits.run_batch([request])[0] for request in requests]
    assert [len(out["label"]) for out in together] == [1, 3, 2]
    for mine, single in zip(together, alone, strict=True):
        assert np.array_equal(mine["label"], single["label"])
        assert np.allclose(mine["probabilities"], single["probabilities"], atol=1e-5)


async def test_concurrent_requests_share_batches_and_get_their_own_answers(digits):
    requests = requests_of([1, 2, 1, 4, 1, 1, 3, 1] * 4)
    batcher = DynamicBatcher(digits.run_batch, BatcherConfig(max_batch_size=16, max_queue_delay_us=20_000))
    batcher.start()
    try:
        answers = await asyncio.gather(*(batcher.submit(r, rows=len(r["pixels"])) for r in requests))
    finally:
        await batcher.stop()
    assert sum(batcher.stats.batch_sizes.values()) < len(requests)  # batches formed
    assert max(batcher.stats.batch_sizes) <= 16
    for request, answer in zip(requests, answers, strict=True):
        assert np.array_equal(answer["label"], digits.run_batch([request])[0]["label"])
