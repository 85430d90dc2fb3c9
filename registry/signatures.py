"""A model version's signature: the tensors it takes and gives (name, datatype, shape), in
the Open Inference Protocol's terms, kept in the version's ``config["signature"]``.

Checked when a version is registered: the declared signature must be the one its artifact
has (``onnx_signature`` reads an ONNX model's), so a request checked against it
(``serving.predict.protocol``) never reaches a model that would refuse it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import InvalidInput

# The protocol's datatypes and numpy's: BYTES carries strings (or raw bytes) as objects.
DATATYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}
MAX_DIMENSIONS = 8


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1: any size; the first dimension is the batch

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @classmethod
    def from_json(cls, value: object) -> Signature:
        """Checked: a bad signature is an ``InvalidInput`` naming the entry."""
        if not isinstance(value, Mapping):
            raise InvalidInput("signature", "Must be an object with inputs and outputs.")
        return cls(
            inputs=_specs(value.get("inputs"), "signature.inputs"),
            outputs=_specs(value.get("outputs"), "signature.outputs"),
        )

    def as_json(self) -> dict[str, Any]:
        return {"inputs": [s.as_json() for s in self.inputs], "outputs": [s.as_json() for s in self.outputs]}

    def input(self, name: str) -> TensorSpec | None:
        return next((spec for spec in self.inputs if spec.name == name), None)


def _specs(value: object, field: str) -> tuple[TensorSpec, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidInput(field, "Must be a non-empty list of tensors.")
    specs: list[TensorSpec] = []
    for index, entry in enumerate(value):
        where = f"{field}[{index}]"
        if not isinstance(entry, Mapping):
            raise InvalidInput(where, "Must be an object with name, datatype and shape.")
        name, datatype, shape = entry.get("name"), entry.get("datatype"), entry.get("shape")
        if not isinstance(name, str) or not name.strip():
            raise InvalidInput(f"{where}.name", "Must be a non-empty string.")
        if datatype not in DATATYPES:
            raise InvalidInput(f"{where}.datatype", f"Must be one of {', '.join(DATATYPES)}.")
        if (
            not isinstance(shape, list)
            or not 1 <= len(shape) <= MAX_DIMENSIONS
            or any(isinstance(d, bool) or not isinstance(d, int) or (d < 1 and d != -1) for d in shape)
        ):
            raise InvalidInput(
                f"{where}.shape", f"Must list 1 to {MAX_DIMENSIONS} dimensions, each a size or -1 (any)."
            )
        if name in {s.name for s in specs}:
            raise InvalidInput(f"{where}.name", f"{name!r} is named twice.")
        specs.append(TensorSpec(name=name, datatype=str(datatype), shape=tuple(shape)))
    return tuple(specs)


# ONNX's element types (``tensor(float)``) in the protocol's names.
ONNX_TYPES = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64", "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32",
    "tensor(int64)": "INT64", "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}  # fmt: skip


def onnx_signature(path: Path) -> Signature:
    """The signature an ONNX model has, read by loading it once with ONNX Runtime (symbolic
    or unknown dimensions are -1). A file that does not load is an ``InvalidInput``."""
    import onnxruntime  # loaded by registration and workers only

    try:
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - any failure to load is the artifact's
        raise InvalidInput("artifact", f"ONNX Runtime cannot load it: {exc}") from None

    def specs(args: list[Any]) -> tuple[TensorSpec, ...]:
        found = []
        for arg in args:
            datatype = ONNX_TYPES.get(arg.type)
            if datatype is None:
                raise InvalidInput("artifact", f"tensor {arg.name!r} has type {arg.type}, which the protocol lacks.")
            shape = tuple(d if isinstance(d, int) and d > 0 else -1 for d in (arg.shape or [-1]))
            found.append(TensorSpec(name=arg.name, datatype=datatype, shape=shape))
        return tuple(found)

    return Signature(inputs=specs(session.get_inputs()), outputs=specs(session.get_outputs()))


def check_signature(declared: Signature, actual: Signature) -> None:
    """Refuse a declared signature its artifact does not have, naming the first difference.
    A declared size may pin a dimension the model leaves open (-1), never the other way."""
    for kind in ("inputs", "outputs"):
        have = {spec.name: spec for spec in getattr(actual, kind)}
        for index, spec in enumerate(getattr(declared, kind)):
            where = f"signature.{kind}[{index}]"
            model = have.get(spec.name)
            if model is None:
                raise InvalidInput(f"{where}.name", f"The model has no {kind[:-1]} {spec.name!r} (it has "
                                   f"{', '.join(have) or 'none'}).")  # fmt: skip
            if spec.datatype != model.datatype:
                raise InvalidInput(f"{where}.datatype", f"{spec.name!r} is {model.datatype} in the model.")
            if len(spec.shape) != len(model.shape) or any(
                m != -1 and d != m for d, m in zip(spec.shape, model.shape, strict=True)
            ):
                raise InvalidInput(f"{where}.shape", f"{spec.name!r} is {list(model.shape)} in the model.")
        missing = [name for name in have if name not in {s.name for s in getattr(declared, kind)}]
        if kind == "inputs" and missing:
            raise InvalidInput("signature.inputs", f"The model also takes {missing[0]!r}: declare every input.")


# --- Versions that a predict worker serves ---------------------------------------------------

# The frameworks whose versions run in the platform's own worker (serving.predict.worker)
# behind the dynamic batcher, rather than in a vLLM engine.
PREDICT_FRAMEWORKS = frozenset({"onnx"})


def is_predict_framework(framework: str) -> bool:
    return framework.strip().lower() in PREDICT_FRAMEWORKS


def onnx_file(path: Path) -> Path:
    """The ONNX graph of an artifact: the file itself, or ``model.onnx`` (else the only
    ``.onnx`` file) of a folder."""
    if path.is_file():
        return path
    if (path / "model.onnx").is_file():
        return path / "model.onnx"
    found = sorted(path.glob("*.onnx"))
    if len(found) != 1:
        raise InvalidInput("artifact", "An ONNX artifact is a .onnx file, or a folder with model.onnx in it.")
    return found[0]


def predict_config(framework: str, path: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """A predict version's config, checked by loading its artifact once: the declared
    signature must be the artifact's (when none is declared, the artifact's is recorded), the
    batcher's settings must hold, and ``labels`` (class names by index), when given, must be
    a list of strings. Raises ``InvalidInput`` naming what is wrong."""
    from registry.batching import BatcherConfig

    if framework.strip().lower() != "onnx":
        raise InvalidInput("framework", f"Must be one of {', '.join(sorted(PREDICT_FRAMEWORKS))}.")
    actual = onnx_signature(onnx_file(path))
    if config.get("signature") is not None:
        declared = Signature.from_json(config["signature"])
        check_signature(declared, actual)
    else:
        declared = actual
    BatcherConfig.from_json(config.get("batcher"))
    labels = config.get("labels")
    if labels is not None and (not isinstance(labels, list) or not all(isinstance(x, str) for x in labels)):
        raise InvalidInput("labels", "Must be a list of class names (strings), by class index.")
    return {**config, "signature": declared.as_json()}
