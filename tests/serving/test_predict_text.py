"""Text models: a tokenizer step (registry.signatures.TextInput) before an ONNX graph that takes
token ids. Registration checks the step against the graph; the worker tokenizes each batch,
and a text's answer does not depend on the texts batched with it (padding is masked)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from core.errors import InvalidInput
from registry.signatures import predict_config
from registry.small_models import _minilm_dir, build_digits
from serving.gateway.inference_protocol import HEADER_LENGTH, decode_outputs, encode_request, read_body
from serving.predict.worker import KEY_ENV, Worker

KEY = "replica-secret"
TOKENIZER = {"file": "tokenizer.json", "input": "text", "max_length": 16}


def _export_tiny(folder: Path, inputs: tuple[str, ...] = ("input_ids", "attention_mask")) -> None:
    """A tiny text classifier over MiniLM's vocabulary: mean of token embeddings → 2 classes."""
    import torch

    torch.manual_seed(0)

    class Tiny(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(30522, 8)
            self.head = torch.nn.Linear(8, 2)

        def forward(self, input_ids: Any, attention_mask: Any) -> tuple[Any, Any]:
            mask = attention_mask.unsqueeze(-1).to(torch.float32)
            pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            probabilities = torch.softmax(self.head(pooled), dim=-1)
            return torch.argmax(probabilities, dim=-1), probabilities

    sample = (torch.ones(2, 5, dtype=torch.int64), torch.ones(2, 5, dtype=torch.int64))
    axes = {name: {0: "batch", 1: "tokens"} for name in inputs}
    torch.onnx.export(
        Tiny().eval(), sample, str(folder / "model.onnx"), input_names=list(inputs),
        output_names=["label", "probabilities"],
        dynamic_axes={**axes, "label": {0: "batch"}, "probabilities": {0: "batch"}}, opset_version=17, dynamo=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def text_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("tiny-text")
    shutil.copyfile(_minilm_dir() / "tokenizer.json", folder / "tokenizer.json")
    _export_tiny(folder)
    return folder, predict_config("onnx", folder, {"tokenizer": TOKENIZER, "labels": ["negative", "positive"]})


class TestRegistration:
    def test_the_public_signature_is_one_text_input(self, text_artifact):
        _, config = text_artifact
        assert config["signature"]["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
        assert [o["name"] for o in config["signature"]["outputs"]] == ["label", "probabilities"]
        assert config["tokenizer"] == TOKENIZER

    def test_a_declared_signature_must_be_the_text_input_and_the_graphs_outputs(self, text_artifact):
        folder, config = text_artifact
        assert predict_config("onnx", folder, {"tokenizer": TOKENIZER, "signature": config["signature"]})
        wrong_input = {**config["signature"], "inputs": [{"name": "text", "datatype": "FP32", "shape": [-1]}]}
        with pytest.raises(InvalidInput) as refused:
            predict_config("onnx", folder, {"tokenizer": TOKENIZER, "signature": wrong_input})
        assert refused.value.field == "signature.inputs"
        wrong_output = {**config["signature"], "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 2]}]}
        with pytest.raises(InvalidInput, match="no output 'scores'"):
            predict_config("onnx", folder, {"tokenizer": TOKENIZER, "signature": wrong_output})

    @pytest.mark.parametrize(
        ("tokenizer", "field"),
        [
            ({**TOKENIZER, "file": "missing.json"}, "tokenizer.file"),
            ({**TOKENIZER, "file": "../tokenizer.json"}, "tokenizer.file"),
            ({**TOKENIZER, "max_length": 0}, "tokenizer.max_length"),
            ({**TOKENIZER, "input": ""}, "tokenizer.input"),
            ("tokenizer.json", "tokenizer"),
        ],
    )
    def test_a_bad_tokenizer_step_is_refused_by_name(self, text_artifact, tokenizer, field):
        folder, _ = text_artifact
        with pytest.raises(InvalidInput) as refused:
            predict_config("onnx", folder, {"tokenizer": tokenizer})
        assert refused.value.field == field

    def test_a_tokenizer_file_that_does_not_load_is_refused(self, tmp_path):
        _export_tiny(tmp_path)
        (tmp_path / "tokenizer.json").write_text("{not json")
        with pytest.raises(InvalidInput, match="tokenizers cannot load"):
            predict_config("onnx", tmp_path, {"tokenizer": TOKENIZER})

    def test_a_graph_a_tokenizer_cannot_feed_is_refused(self, tmp_path):
        build_digits(tmp_path)
        shutil.copyfile(_minilm_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
        with pytest.raises(InvalidInput, match="'pixels' is not one a tokenizer feeds"):
            predict_config("onnx", tmp_path, {"tokenizer": TOKENIZER})

    def test_torchscript_takes_no_tokenizer_step(self, text_artifact):
        folder, config = text_artifact
        with pytest.raises(InvalidInput) as refused:
            predict_config("torchscript", folder, {"tokenizer": TOKENIZER, "signature": config["signature"]})
        assert refused.value.field == "tokenizer"


@pytest.fixture
async def worker(text_artifact, monkeypatch) -> AsyncIterator[Worker]:
    folder, config = text_artifact
    monkeypatch.setenv(KEY_ENV, KEY)
    config = {**config, "batcher": {"max_batch_size": 8, "max_queue_delay_us": 20_000}}
    worker = Worker(name="tiny-text", version="1", artifact=folder, config=config, threads=1)
    worker.batcher.start()
    worker.ready = True
    yield worker
    await worker.batcher.stop()


def _client(worker: Worker) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=worker), base_url="http://w", headers={"Authorization": f"Bearer {KEY}"}
    )


def test_a_batch_is_padded_to_its_longest_text_not_to_the_files_length(text_artifact):
    from registry.signatures import TextInput
    from serving.predict.runner import Tokenize

    folder, config = text_artifact
    text = TextInput.from_json(config["tokenizer"])
    assert text is not None
    feeds = Tokenize(text, folder, ["input_ids", "attention_mask"]).feeds(
        np.array(["great", "fine I guess"], dtype=object)
    )
    # [CLS] great [SEP] and [CLS] fine i guess [SEP]; MiniLM's file would pad both to 128.
    assert feeds["input_ids"].shape == (2, 5)
    assert feeds["attention_mask"].sum(axis=1).tolist() == [3, 5]
    long = Tokenize(text, folder, ["input_ids"]).feeds(np.array(["word " * 100], dtype=object))
    assert long["input_ids"].shape == (1, TOKENIZER["max_length"])  # cut at max_length


TEXTS = ["great", "this was a long and thoroughly disappointing evening, never again", "fine I guess"]


async def test_a_texts_answer_does_not_depend_on_its_batch(worker):
    import asyncio

    def body(texts: list[str]) -> dict[str, Any]:
        return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}

    async with _client(worker) as c:
        alone = [(await c.post("/v2/models/tiny-text/infer", json=body([t]))).json() for t in TEXTS]
        together = await asyncio.gather(*(c.post("/v2/models/tiny-text/infer", json=body([t])) for t in TEXTS))
        one_request = (await c.post("/v2/models/tiny-text/infer", json=body(TEXTS))).json()
    assert max(worker.batcher.stats.batch_sizes) > 1  # texts of different lengths shared a batch
    for index, (single, batched) in enumerate(zip(alone, together, strict=True)):
        assert batched.status_code == 200
        mine = {o["name"]: o["data"] for o in single["outputs"]}
        theirs = {o["name"]: o["data"] for o in batched.json()["outputs"]}
        assert mine["label"] == theirs["label"]
        assert np.allclose(mine["probabilities"], theirs["probabilities"], atol=1e-5)
        rows = {o["name"]: o["data"] for o in one_request["outputs"]}
        assert np.allclose(mine["probabilities"], rows["probabilities"][2 * index : 2 * index + 2], atol=1e-5)


async def test_binary_strings_and_a_wrong_datatype(worker, text_artifact):
    from registry.signatures import Signature

    signature = Signature.from_json(text_artifact[1]["signature"])
    content, length = encode_request({"text": np.array([t.encode() for t in TEXTS], dtype=np.object_)}, signature)
    async with _client(worker) as c:
        binary = await c.post("/v2/models/tiny-text/infer", content=content, headers={HEADER_LENGTH: str(length)})
        numbers = await c.post(
            "/v2/models/tiny-text/infer",
            json={"inputs": [{"name": "text", "datatype": "FP32", "shape": [1], "data": [1.0]}]},
        )
    assert binary.status_code == 200, binary.text
    answer = decode_outputs(signature, read_body(binary.content, binary.headers.get(HEADER_LENGTH)))
    assert answer["probabilities"].shape == (3, 2)
    assert numbers.status_code == 400
    assert numbers.json()["error"]["param"] == "text"
    assert "BYTES" in numbers.json()["error"]["message"]
