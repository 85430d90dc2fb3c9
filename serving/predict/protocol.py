"""The Open Inference Protocol (v2) tensors that KServe, Triton and MLServer speak, checked
against a model version's signature before anything reaches the model.

A signature (the version's ``config["signature"]``) names each input and output with its
datatype and shape; the first dimension is the batch (-1: any size), other -1s are any size
too. A request's inputs become numpy arrays of exactly that type and shape, or the request
is refused with a message naming the tensor (a 400, never the model's error).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from registry.signatures import DATATYPES, Signature, TensorSpec


class BadTensor(ValueError):
    """A request's tensor that does not fit the signature; the message names it."""

    def __init__(self, tensor: str, message: str) -> None:
        super().__init__(f"Input {tensor!r}: {message}")
        self.tensor = tensor


def decode_inputs(signature: Signature, inputs: object) -> tuple[dict[str, np.ndarray[Any, Any]], int]:
    """The request's ``inputs`` as arrays by name, and the batch size they share.

    Every input of the signature must be given once, with its datatype, a shape that fits
    (the same batch size for all) and as many values as the shape holds."""
    if not isinstance(inputs, list) or not inputs:
        raise BadTensor("inputs", "send a non-empty list of tensors.")
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    batch: int | None = None
    for tensor in inputs:
        if not isinstance(tensor, Mapping) or not isinstance(tensor.get("name"), str):
            raise BadTensor("inputs", "each tensor is an object with a name.")
        name = tensor["name"]
        spec = signature.input(name)
        if spec is None:
            known = ", ".join(s.name for s in signature.inputs)
            raise BadTensor(name, f"the model has no such input (its inputs: {known}).")
        if name in arrays:
            raise BadTensor(name, "given twice.")
        arrays[name] = _decode(spec, tensor)
        size = int(arrays[name].shape[0])
        if batch is not None and size != batch:
            raise BadTensor(name, f"its batch size is {size}, another input's is {batch}.")
        batch = size
    missing = [s.name for s in signature.inputs if s.name not in arrays]
    if missing:
        raise BadTensor(missing[0], "missing.")
    assert batch is not None
    return arrays, batch


def _decode(spec: TensorSpec, tensor: Mapping[str, Any]) -> np.ndarray[Any, Any]:
    if tensor.get("datatype") != spec.datatype:
        raise BadTensor(spec.name, f"datatype {tensor.get('datatype')!r}; the model takes {spec.datatype}.")
    shape = tensor.get("shape")
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise BadTensor(spec.name, "shape must be a list of sizes.")
    if len(shape) != len(spec.shape) or any(want not in (-1, got) for want, got in zip(spec.shape, shape, strict=True)):
        raise BadTensor(spec.name, f"shape {shape}; the model takes {list(spec.shape)} (-1: any size).")
    if shape[0] < 1:
        raise BadTensor(spec.name, "the batch dimension must be at least 1.")
    data = _flat(tensor.get("data"))
    if data is None:
        raise BadTensor(spec.name, "data must be a list of values.")
    count = math.prod(shape)
    if len(data) != count:
        raise BadTensor(spec.name, f"{len(data)} values for shape {shape}, which holds {count}.")
    try:
        if spec.datatype == "BYTES":
            if not all(isinstance(v, str | bytes) for v in data):
                raise ValueError("BYTES values are strings")
            array = np.array(data, dtype=np.object_)
        else:
            if any(isinstance(v, str | bytes) or v is None for v in data):
                raise ValueError("not a number")
            array = np.asarray(data, dtype=DATATYPES[spec.datatype])
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadTensor(spec.name, f"values that are not {spec.datatype} ({exc}).") from None
    return array.reshape(shape)


def _flat(data: object) -> list[Any] | None:
    """The protocol lets ``data`` be flat or nested in row-major order."""
    if not isinstance(data, list):
        return None
    flat: list[Any] = []
    stack: list[Any] = [iter(data)]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            stack.append(iter(item))
        else:
            flat.append(item)
    return flat


_END = object()


def encode_outputs(signature: Signature, outputs: Mapping[str, np.ndarray[Any, Any]]) -> list[dict[str, Any]]:
    """The model's outputs as the protocol's tensors (flat data, row-major), in signature order."""
    encoded: list[dict[str, Any]] = []
    for spec in signature.outputs:
        array = np.asarray(outputs[spec.name])
        data: Sequence[Any]
        if spec.datatype == "BYTES":
            data = [v.decode() if isinstance(v, bytes) else str(v) for v in array.reshape(-1).tolist()]
        else:
            data = array.astype(DATATYPES[spec.datatype], copy=False).reshape(-1).tolist()
        encoded.append({"name": spec.name, "datatype": spec.datatype, "shape": list(array.shape), "data": data})
    return encoded
