"""The small models the platform builds from data inside scikit-learn (registry.small_models),
and the signature check registration will apply to any ONNX artifact (registry.signatures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import pytest

from core.errors import InvalidInput
from registry.signatures import Signature, check_signature, onnx_signature
from registry.small_models import SMALL_MODELS, build_digits


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Any]]]:
    made = {}
    for small in SMALL_MODELS:
        if small.name == "sentiment-minilm":
            continue  # built by the bundled import once per session (tests/registry/test_bundled_models.py)
        folder = tmp_path_factory.mktemp(small.name)
        made[small.name] = (folder / "model.onnx", small.build(folder))
    return made


def test_each_model_is_built_offline_and_right_on_its_held_out_rows(built):
    for name, (path, config) in built.items():
        assert path.stat().st_size > 1_000, name
        # Rows the model never saw (a fixed, stratified quarter of the set); far above chance
        # (10 % for digits, 63 % for the majority class of the tabular set).
        assert config["heldout_accuracy"] >= 0.9, name
        assert config["heldout_rows"] >= 100
        check_signature(Signature.from_json(config["signature"]), onnx_signature(path))  # raises on a difference


def test_the_digits_model_answers_a_batch_through_onnx_runtime(built):
    from sklearn.datasets import load_digits

    path, config = built["digits-mlp"]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    digits = load_digits()
    rows = digits.data[:16].astype(np.float32)
    label, probabilities = session.run(["label", "probabilities"], {"pixels": rows})
    assert label.shape == (16,)
    assert probabilities.shape == (16, 10)
    assert np.allclose(probabilities.sum(axis=1), 1, atol=1e-4)
    assert config["labels"][int(label[0])] in [str(d) for d in range(10)]


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 64]}]}, "signature.inputs[0].name",
         "no input 'image'"),
        ({"inputs": [{"name": "pixels", "datatype": "FP64", "shape": [-1, 64]}]}, "signature.inputs[0].datatype",
         "FP32 in the model"),
        ({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [-1, 8, 8]}]}, "signature.inputs[0].shape",
         "[-1, 64] in the model"),
        ({"outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 10]}]}, "signature.outputs[0].name",
         "no output 'scores'"),
    ],
)  # fmt: skip
def test_a_signature_the_artifact_does_not_have_is_refused_by_name(built, change, field, says):
    path, config = built["digits-mlp"]
    declared = Signature.from_json({**config["signature"], **change})
    with pytest.raises(InvalidInput) as refused:
        check_signature(declared, onnx_signature(path))
    assert refused.value.field == field
    assert says in refused.value.message


def test_an_artifact_that_does_not_load_is_refused(tmp_path):
    broken = tmp_path / "model.onnx"
    broken.write_bytes(b"not an onnx graph")
    with pytest.raises(InvalidInput, match="ONNX Runtime cannot load it"):
        onnx_signature(broken)


def test_a_build_is_reproducible(tmp_path, built):
    # The same seed and split: the same held-out accuracy on another build.
    assert build_digits(tmp_path)["heldout_accuracy"] == built["digits-mlp"][1]["heldout_accuracy"]
