"""Small real models the platform builds itself at install time, from data that ships inside
scikit-learn (nothing is downloaded): an image classifier on the 8x8 handwritten digits and a
tabular classifier on the Wisconsin breast-cancer measurements, both exported to ONNX with
scikit-learn's official converter (skl2onnx).

Each builder trains on a fixed split, writes ``model.onnx`` into a folder and returns the
version's config: its signature (checked against the exported graph), the class labels,
the batcher's settings and the accuracy on the held-out part of the split. They are bundled
models (``registry.bundled``): imported, deployed and priced by ``make run`` like the LLMs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from registry.signatures import Signature, check_signature, onnx_signature

# The version the bundled small models are registered as; a new build of the same version
# (other library versions) replaces its artifact, as for the other bundled models.
VERSION = "1"
SEED = 20261125
HELD_OUT = 0.25


@dataclass(frozen=True)
class SmallModel:
    name: str
    description: str
    build: Callable[[Path], dict[str, Any]]


def _split(features: np.ndarray[Any, Any], target: np.ndarray[Any, Any]) -> tuple[Any, Any, Any, Any]:
    from sklearn.model_selection import train_test_split

    split: tuple[Any, Any, Any, Any] = train_test_split(
        features.astype(np.float32), target, test_size=HELD_OUT, random_state=SEED, stratify=target
    )
    return split


def _export(estimator: Any, input_name: str, width: int, out: Path) -> Path:
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType

    # zipmap off: probabilities come as one tensor, as the protocol carries them.
    onnx_model = to_onnx(
        estimator,
        initial_types=[(input_name, FloatTensorType([None, width]))],
        options={id(estimator): {"zipmap": False}},
        target_opset=17,
    )
    path = out / "model.onnx"
    path.write_bytes(onnx_model.SerializeToString())
    return path


def _config(
    path: Path,
    declared: dict[str, Any],
    labels: list[str],
    held_out: tuple[Any, Any],
    *,
    try_it: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import onnxruntime

    signature = Signature.from_json(declared)
    check_signature(signature, onnx_signature(path))
    features, target = held_out
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    predicted = session.run(["label"], {signature.inputs[0].name: features})[0]
    return {
        "signature": signature.as_json(),
        "labels": labels,
        "batcher": {"max_batch_size": 64, "max_queue_delay_us": 2_000, "preferred_batch_sizes": [16, 64]},
        "heldout_accuracy": round(float(np.mean(predicted == target)), 4),
        "heldout_rows": len(target),
        # One held-out instance, for the console's "try it" form and the docs.
        "example": {signature.inputs[0].name: [round(float(v), 4) for v in features[0]]},
        **({"try_it": try_it} if try_it else {}),
    }


def build_digits(out: Path) -> dict[str, Any]:
    """8x8 grey digits (0-16 per pixel, flattened to 64) → the digit: a small neural net."""
    from sklearn.datasets import load_digits
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    digits = load_digits()
    train_x, test_x, train_y, test_y = _split(digits.data, digits.target)
    model = make_pipeline(
        StandardScaler(), MLPClassifier(hidden_layer_sizes=(64,), max_iter=400, random_state=SEED)
    ).fit(train_x, train_y)
    path = _export(model, "pixels", 64, out)
    declared = {
        "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}],
        "outputs": [
            {"name": "label", "datatype": "INT64", "shape": [-1]},
            {"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]},
        ],
    }
    # The console draws on an 8x8 grid of 0 (white) to 16 (black), as the data set's pixels are.
    canvas = {"kind": "canvas", "input": "pixels", "width": 8, "height": 8, "max": 16}
    return _config(path, declared, [str(d) for d in range(10)], (test_x, test_y), try_it=canvas)


def build_tabular(out: Path) -> dict[str, Any]:
    """30 measurements of a breast mass → benign or malignant: gradient-boosted trees."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.ensemble import GradientBoostingClassifier

    data = load_breast_cancer()
    train_x, test_x, train_y, test_y = _split(data.data, data.target)
    model = GradientBoostingClassifier(n_estimators=100, max_depth=3, random_state=SEED).fit(train_x, train_y)
    path = _export(model, "features", 30, out)
    declared = {
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 30]}],
        "outputs": [
            {"name": "label", "datatype": "INT64", "shape": [-1]},
            {"name": "probabilities", "datatype": "FP32", "shape": [-1, 2]},
        ],
    }
    return _config(path, declared, [str(name) for name in data.target_names], (test_x, test_y))


SMALL_MODELS: tuple[SmallModel, ...] = (
    SmallModel("digits-mlp", "Handwritten digits (8x8, scikit-learn's bundled set): a small MLP, ONNX.", build_digits),
    SmallModel(
        "breast-cancer-gbt",
        "Breast-cancer diagnosis from 30 measurements: gradient-boosted trees, ONNX.",
        build_tabular,
    ),
)
