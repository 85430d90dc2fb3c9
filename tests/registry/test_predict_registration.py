"""Registering small models (framework onnx or torchscript): the artifact is loaded once and
its signature checked; a TorchScript module must declare one and is run on one row; what does
not load, or does not match, is refused naming why. A registered TorchScript version is served
by the predict worker like an ONNX one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from core.errors import InvalidInput
from registry.services import model_version_create
from registry.signatures import predict_config

SIGNATURE = {
    "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [
        {"name": "label", "datatype": "INT64", "shape": [-1]},
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 3]},
    ],
}


class Classifier(torch.nn.Module):  # type: ignore[misc]  # torch is typed as Any here
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probabilities = torch.softmax(self.linear(features), dim=1)
        return probabilities.argmax(dim=1), probabilities


@pytest.fixture
def torchscript_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "classifier"
    folder.mkdir()
    torch.jit.script(Classifier()).save(str(folder / "model.pt"))
    return folder


def test_a_torchscript_module_is_checked_against_its_declared_signature(torchscript_dir):
    config = predict_config("torchscript", torchscript_dir, {"signature": SIGNATURE, "labels": ["a", "b", "c"]})
    assert config["signature"] == SIGNATURE
    with pytest.raises(InvalidInput) as excinfo:
        predict_config("torchscript", torchscript_dir, {})
    assert excinfo.value.field == "signature"
    wrong_dtype: dict[str, Any] = {**SIGNATURE, "outputs": [
        {"name": "label", "datatype": "INT32", "shape": [-1]}, SIGNATURE["outputs"][1]]}  # fmt: skip
    with pytest.raises(InvalidInput, match="'label' is int64; declared INT32"):
        predict_config("torchscript", torchscript_dir, {"signature": wrong_dtype})
    wrong_width = {**SIGNATURE, "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 5]}]}
    with pytest.raises(InvalidInput, match="fails on one row"):
        predict_config("torchscript", torchscript_dir, {"signature": wrong_width})
    one_output = {**SIGNATURE, "outputs": SIGNATURE["outputs"][:1]}
    with pytest.raises(InvalidInput, match="gives 2 outputs; 1 are declared"):
        predict_config("torchscript", torchscript_dir, {"signature": one_output})


@pytest.mark.django_db
def test_registration_refuses_what_does_not_load_and_keeps_what_does(store, torchscript_dir, tmp_path, people):
    admin = people["ml"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.pt").write_bytes(b"not a module")
    stored = store.put_directory(source=broken, key="broken/1")
    with pytest.raises(InvalidInput) as excinfo:
        model_version_create(
            actor=admin, name="broken", version="1", framework="torchscript", artifact_uri=stored.uri,
            config={"signature": SIGNATURE}, task="classification",
        )  # fmt: skip
    assert excinfo.value.field == "artifact"
    onnx_broken = tmp_path / "onnx-broken"
    onnx_broken.mkdir()
    (onnx_broken / "model.onnx").write_bytes(b"not a graph")
    stored = store.put_directory(source=onnx_broken, key="onnx-broken/1")
    with pytest.raises(InvalidInput, match="ONNX Runtime cannot load it"):
        model_version_create(actor=admin, name="onnx-broken", version="1", framework="onnx",
                             artifact_uri=stored.uri, config={}, task="classification")  # fmt: skip
    stored = store.put_directory(source=torchscript_dir, key="classifier/1")
    version, created = model_version_create(
        actor=admin, name="classifier", version="1", framework="torchscript", artifact_uri=stored.uri,
        config={"signature": SIGNATURE}, task="classification",
    )  # fmt: skip
    assert created
    assert version.config["signature"] == SIGNATURE


async def test_the_worker_serves_a_torchscript_version(torchscript_dir):
    from serving.predict.worker import Worker

    worker = Worker(name="classifier", version="1", artifact=torchscript_dir, framework="torchscript",
                    config={"signature": SIGNATURE, "batcher": {"max_batch_size": 8}}, threads=1)  # fmt: skip
    worker.batcher.start()
    worker.ready = True
    try:
        features = np.random.default_rng(3).normal(size=(5, 4)).astype(np.float32)
        transport = httpx.ASGITransport(app=worker)
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as client:
            response = await client.post("/v2/models/classifier/infer", json={
                "inputs": [{"name": "features", "datatype": "FP32", "shape": [5, 4], "data": features.tolist()}]
            })  # fmt: skip
            metadata = (await client.get("/v2/models/classifier")).json()
        assert response.status_code == 200, response.text
        outputs = {o["name"]: o for o in response.json()["outputs"]}
        expected_labels, expected = Classifier()(torch.from_numpy(features))
        assert outputs["label"]["data"] == expected_labels.tolist()
        np.testing.assert_allclose(
            np.array(outputs["probabilities"]["data"]).reshape(5, 3), expected.detach().numpy(), rtol=1e-5
        )
        assert metadata["platform"] == "pytorch_libtorch"
    finally:
        await worker.batcher.stop()
