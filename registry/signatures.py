"""A model version's signature: the tensors it takes and gives (name, datatype, shape), in
the Open Inference Protocol's terms, kept in the version's ``config["signature"]``.

Checked when a version is registered: the declared signature must be the one its artifact
has (``onnx_signature`` reads an ONNX model's), so a request checked against it
(``serving.gateway.inference_protocol``) never reaches a model that would refuse it.
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
PREDICT_FRAMEWORKS = frozenset({"onnx", "torchscript"})


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


def torchscript_file(path: Path) -> Path:
    """The TorchScript module of an artifact: the file itself, or ``model.pt`` (else the only
    ``.pt`` file) of a folder."""
    if path.is_file():
        return path
    if (path / "model.pt").is_file():
        return path / "model.pt"
    found = sorted(path.glob("*.pt"))
    if len(found) != 1:
        raise InvalidInput("artifact", "A TorchScript artifact is a .pt file, or a folder with model.pt in it.")
    return found[0]


def torch_dtype(datatype: str) -> Any:
    import torch

    types = {
        "BOOL": torch.bool, "UINT8": torch.uint8, "INT8": torch.int8, "INT16": torch.int16, "INT32": torch.int32,
        "INT64": torch.int64, "FP16": torch.float16, "FP32": torch.float32, "FP64": torch.float64,
    }  # fmt: skip
    if datatype not in types:
        raise InvalidInput("signature", f"TorchScript tensors cannot be {datatype}.")
    return types[datatype]


def torchscript_outputs(result: Any, names: list[str]) -> list[Any]:
    """A TorchScript module's answer as one tensor per declared output, in order: a tensor, a
    tuple or list of them, or a dict by output name."""
    if isinstance(result, dict):
        missing = [name for name in names if name not in result]
        if missing:
            raise InvalidInput("signature", f"The module's answer has no output {missing[0]!r}.")
        return [result[name] for name in names]
    values = list(result) if isinstance(result, list | tuple) else [result]
    if len(values) != len(names):
        raise InvalidInput("signature", f"The module gives {len(values)} outputs; {len(names)} are declared.")
    return values


def check_torchscript(path: Path, signature: Signature) -> None:
    """Load the module once and run one row of zeros through it: it must take the declared
    inputs and give the declared outputs (count, rank, datatype, the batch dimension)."""
    import numpy as np
    import torch

    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any failure to load is the artifact's
        raise InvalidInput("artifact", f"TorchScript cannot load it: {exc}") from None
    inputs = [
        torch.zeros([1 if d == -1 else d for d in spec.shape], dtype=torch_dtype(spec.datatype))
        for spec in signature.inputs
    ]
    try:
        with torch.no_grad():
            result = module(*inputs)
    except Exception as exc:  # noqa: BLE001 - the module refuses its declared inputs
        raise InvalidInput("signature", f"The module fails on one row of the declared inputs: {exc}") from None
    for spec, value in zip(
        signature.outputs, torchscript_outputs(result, [s.name for s in signature.outputs]), strict=True
    ):
        array = np.asarray(value.detach().cpu().numpy()) if hasattr(value, "detach") else np.asarray(value)
        if array.ndim != len(spec.shape) or array.shape[0] != 1:
            raise InvalidInput("signature", f"Output {spec.name!r} has shape {list(array.shape)} for one row; "
                               f"declared {list(spec.shape)}.")  # fmt: skip
        if array.dtype != np.dtype(DATATYPES[spec.datatype]):
            raise InvalidInput("signature", f"Output {spec.name!r} is {array.dtype}; declared {spec.datatype}.")


# The graph inputs a tokenizer step feeds (BERT-style encoders): ids, mask, segment ids.
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True)
class TextInput:
    """A text model's pre-processing (``config["tokenizer"]``): clients send one BYTES input of
    strings (``input``, shape [-1]); the worker tokenizes each batch with the artifact's
    Hugging Face ``tokenizers`` file (``file``, cut at ``max_length`` tokens, padded to the
    batch's longest) and feeds the graph's ``TOKEN_INPUTS``."""

    input: str
    file: str
    max_length: int

    @classmethod
    def from_json(cls, value: object) -> TextInput | None:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise InvalidInput("tokenizer", 'Must be an object: {"file", "input", "max_length"}.')
        file, name, length = value.get("file", "tokenizer.json"), value.get("input", "text"), value.get("max_length")
        if not isinstance(file, str) or not file or "/" in file or file.startswith("."):
            raise InvalidInput("tokenizer.file", "Must be the name of a file in the artifact's folder.")
        if not isinstance(name, str) or not name.strip():
            raise InvalidInput("tokenizer.input", "Must be the name of the text input clients send.")
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= 8192:
            raise InvalidInput("tokenizer.max_length", "Must be a number of tokens from 1 to 8192.")
        return cls(input=name, file=file, max_length=length)

    def as_json(self) -> dict[str, Any]:
        return {"input": self.input, "file": self.file, "max_length": self.max_length}

    def spec(self) -> TensorSpec:
        return TensorSpec(name=self.input, datatype="BYTES", shape=(-1,))

    def load(self, folder: Path) -> Any:
        """The tokenizer, set to cut and pad (``tokenizers.Tokenizer``)."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / self.file))
        tokenizer.enable_truncation(self.max_length)
        # To the batch's longest text, whatever the file says (sentence-transformers' files pad
        # every text to 128 tokens: 10x the work for a short sentence), with the file's pad token.
        padding = tokenizer.padding or {}
        tokenizer.enable_padding(
            pad_id=padding.get("pad_id", 0),
            pad_type_id=padding.get("pad_type_id", 0),
            pad_token=padding.get("pad_token", "[PAD]"),
            direction=padding.get("direction", "right"),
        )
        return tokenizer


def text_signature(text: TextInput, path: Path, declared: object) -> Signature:
    """A text model's public signature: its text input and its graph's outputs. The graph
    must take only ``TOKEN_INPUTS`` (INT64, [batch, tokens], ``input_ids`` among them) and
    the artifact must be a folder holding a tokenizer file that loads."""
    if not path.is_dir() or not (path / text.file).is_file():
        raise InvalidInput("tokenizer.file", f"The artifact must be a folder holding {text.file}.")
    try:
        text.load(path)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the artifact's
        raise InvalidInput("tokenizer.file", f"tokenizers cannot load {text.file}: {exc}") from None
    graph = onnx_signature(onnx_file(path))
    for spec in graph.inputs:
        if spec.name not in TOKEN_INPUTS or spec.datatype != "INT64" or len(spec.shape) != 2:
            raise InvalidInput("tokenizer", f"The graph's input {spec.name!r} is not one a tokenizer feeds "
                               f"({', '.join(TOKEN_INPUTS)}: INT64, [batch, tokens]).")  # fmt: skip
    if graph.input("input_ids") is None:
        raise InvalidInput("tokenizer", "The graph takes no input_ids.")
    public = Signature(inputs=(text.spec(),), outputs=graph.outputs)
    if declared is None:
        return public
    wanted = Signature.from_json(declared)
    if wanted.inputs != public.inputs:
        raise InvalidInput("signature.inputs", f"A text model takes one input: {text.spec().as_json()}.")
    check_signature(Signature(inputs=graph.inputs, outputs=wanted.outputs), graph)
    return wanted


def predict_config(framework: str, path: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """A predict version's config, checked by loading its artifact once: the declared
    signature must be the artifact's (an ONNX graph's is read; when none is declared, it is
    recorded; a TorchScript module must declare one, and is run on one row to check it), the
    batcher's settings must hold, a ``tokenizer`` step (``TextInput``) must fit the graph, and
    ``labels`` (class names by index), when given, must be
    a list of strings. Raises ``InvalidInput`` naming what is wrong."""
    from registry.batching import BatcherConfig

    kind = framework.strip().lower()
    if kind not in PREDICT_FRAMEWORKS:
        raise InvalidInput("framework", f"Must be one of {', '.join(sorted(PREDICT_FRAMEWORKS))}.")
    text = TextInput.from_json(config.get("tokenizer"))
    if text is not None:
        if kind != "onnx":
            raise InvalidInput("tokenizer", "A tokenizer step runs before ONNX graphs only.")
        declared = text_signature(text, path, config.get("signature"))
    elif kind == "torchscript":
        if config.get("signature") is None:
            raise InvalidInput("signature", "A TorchScript version declares its signature (inputs and outputs).")
        declared = Signature.from_json(config["signature"])
        check_torchscript(torchscript_file(path), declared)
    elif config.get("signature") is not None:
        declared = Signature.from_json(config["signature"])
        check_signature(declared, onnx_signature(onnx_file(path)))
    else:
        declared = onnx_signature(onnx_file(path))
    BatcherConfig.from_json(config.get("batcher"))
    labels = config.get("labels")
    if labels is not None and (not isinstance(labels, list) or not all(isinstance(x, str) for x in labels)):
        raise InvalidInput("labels", "Must be a list of class names (strings), by class index.")
    return {
        **config,
        "signature": declared.as_json(),
        **({"tokenizer": text.as_json()} if text is not None else {}),
    }
