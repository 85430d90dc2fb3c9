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
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import orjson

from registry.signatures import DATATYPES, Signature, TensorSpec

# What the server says of itself (GET /v2, gRPC ServerMetadata).
SERVER_NAME = "inference-platform"
EXTENSIONS = ("binary_tensor_data",)


# What a tensor may declare, checked before any of its values is read: no model takes more
# dimensions, and no request body the platform accepts holds more values (each takes a byte
# at least on every wire, a BYTES element 4), so a larger shape is refused without reading
# or allocating anything for it.
MAX_DIMENSIONS = 16
MAX_ELEMENTS = 1 << 26


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


def _decode(spec: TensorSpec, tensor: Mapping[Any, Any], *, check_shape: bool = True) -> np.ndarray[Any, Any]:
    if tensor.get("datatype") != spec.datatype:
        raise BadTensor(spec.name, f"datatype {tensor.get('datatype')!r}; the model takes {spec.datatype}.")
    shape = tensor.get("shape")
    if not isinstance(shape, list):
        raise BadTensor(spec.name, "shape must be a list of sizes.")
    if len(shape) > MAX_DIMENSIONS:
        raise BadTensor(spec.name, f"a shape of {len(shape)} dimensions; a tensor has at most {MAX_DIMENSIONS}.")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise BadTensor(spec.name, "shape must be a list of sizes.")
    if check_shape:
        if len(shape) != len(spec.shape) or any(
            want not in (-1, got) for want, got in zip(spec.shape, shape, strict=True)
        ):
            raise BadTensor(spec.name, f"shape {shape}; the model takes {list(spec.shape)} (-1: any size).")
        if shape[0] < 1:
            raise BadTensor(spec.name, "the batch dimension must be at least 1.")
    # Before a value is read or anything allocated: a shape no request can hold is refused.
    count = math.prod(shape)
    if count > MAX_ELEMENTS or any(d > MAX_ELEMENTS for d in shape):
        raise BadTensor(spec.name, f"shape {shape}; a tensor holds at most {MAX_ELEMENTS:,} values "
                        f"(and no dimension is larger).")  # fmt: skip
    if RAW in tensor:
        if "data" in tensor:
            raise BadTensor(spec.name, "both data and binary_data_size given.")
        return _from_raw(spec.name, spec.datatype, shape, tensor[RAW])
    data = _flat(spec.name, tensor.get("data"), shape, count)
    try:
        if spec.datatype == "BYTES":
            if not all(isinstance(v, str | bytes) for v in data):
                raise ValueError("BYTES values are strings")
            array = np.array(data, dtype=np.object_)
        else:
            if any(isinstance(v, str | bytes) or v is None for v in data):
                raise ValueError("not a number")
            if spec.datatype != "BOOL" and any(isinstance(v, bool) for v in data):
                raise ValueError("true and false are BOOL values")
            array = np.asarray(data, dtype=DATATYPES[spec.datatype])
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadTensor(spec.name, f"values that are not {spec.datatype} ({exc}).") from None
    return array.reshape(shape)


def _flat(name: str, data: object, shape: list[int], count: int) -> list[Any]:
    """``data``'s values, flat: the protocol lets it be flat or nested in row-major order.

    Read no further than the shape allows: more than ``count`` values (or more lists than a
    nesting of ``shape`` has) is refused as soon as it is seen, however long ``data`` is."""
    if not isinstance(data, list):
        raise BadTensor(name, "data must be a list of values.")
    flat: list[Any] = []
    steps = (count + 1) * (len(shape) + 1)  # every value, and every list of a row-major nesting
    stack: list[Any] = [iter(data)]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        steps -= 1
        if isinstance(item, list):
            stack.append(iter(item))
        else:
            flat.append(item)
        if len(flat) > count or steps < 0:
            raise BadTensor(name, f"more values than shape {shape} holds ({count}).")
    if len(flat) != count:
        raise BadTensor(name, f"{len(flat)} values for shape {shape}, which holds {count}.")
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


# --- The binary tensor extension ---------------------------------------------------------
#
# Triton's extension, which ``tritonclient`` uses by default: the body is the JSON request
# (its length in the ``Inference-Header-Content-Length`` header) followed by each binary
# tensor's bytes, in the order of the tensors that say ``parameters.binary_data_size``.
# Numbers are little-endian, row-major; a BYTES element is its 4-byte length, then its bytes.

HEADER_LENGTH = "inference-header-content-length"


class _BinaryPart:
    """The key under which a binary tensor's bytes are put beside its JSON description. Not a
    string, so no JSON client can send it: a client's own ``"_raw"`` (the key this once was)
    is only a field the protocol does not know."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "RAW"


RAW: Final = _BinaryPart()


class BadRequest(ValueError):
    """A request body that is not an inference request at all (not a tensor's fault)."""


def read_body(body: bytes, header_length: str | None) -> dict[str, Any]:
    """The request (or response) JSON, with each binary tensor's bytes under ``RAW``."""
    if header_length is None:
        json_part, rest = body, b""
    else:
        try:
            size = int(header_length)
        except ValueError:
            raise BadRequest("Inference-Header-Content-Length is not a number.") from None
        if not 0 < size <= len(body):
            raise BadRequest(f"Inference-Header-Content-Length is {size}; the body has {len(body)} bytes.")
        json_part, rest = body[:size], body[size:]
    try:
        header = orjson.loads(json_part)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The body is not JSON ({exc}).") from None
    if not isinstance(header, dict):
        raise BadRequest("The body must be a JSON object.")
    offset = 0
    for key in ("inputs", "outputs"):
        tensors = header.get(key)
        if not isinstance(tensors, list):
            continue
        for tensor in tensors:
            parameters = tensor.get("parameters") if isinstance(tensor, dict) else None
            announced = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
            if announced is None:
                continue
            name = tensor.get("name") if isinstance(tensor.get("name"), str) else key
            size = announced
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise BadTensor(name, "parameters.binary_data_size must be a number of bytes.")
            if offset + size > len(rest):
                raise BadTensor(name, f"{size} binary bytes announced, {len(rest) - offset} left in the body.")
            tensor[RAW] = rest[offset : offset + size]
            offset += size
    if offset != len(rest):
        raise BadRequest(f"{len(rest) - offset} bytes after the tensors that no tensor announced.")
    return header


def _from_raw(spec_name: str, datatype: str, shape: list[int], raw: bytes) -> np.ndarray[Any, Any]:
    """A binary tensor's bytes as an array of ``shape``, read no further than the shape allows
    (``shape`` is already within ``MAX_ELEMENTS``)."""
    count = math.prod(shape)
    if datatype == "BYTES":
        if count > len(raw) // 4:  # every element is at least its 4-byte length
            raise BadTensor(spec_name, f"{len(raw)} binary bytes cannot hold {count} BYTES values "
                            "(each takes at least 4).")  # fmt: skip
        items: list[bytes] = []
        offset = 0
        while offset < len(raw):
            if len(items) == count:
                raise BadTensor(spec_name, f"more values than shape {shape} holds ({count}).")
            if offset + 4 > len(raw):
                raise BadTensor(spec_name, "a BYTES element's length is cut short.")
            length = int.from_bytes(raw[offset : offset + 4], "little")
            offset += 4
            if offset + length > len(raw):
                raise BadTensor(spec_name, "a BYTES element is cut short.")
            items.append(raw[offset : offset + length])
            offset += length
        if len(items) != count:
            raise BadTensor(spec_name, f"{len(items)} values for shape {shape}, which holds {count}.")
        array = np.empty(count, dtype=np.object_)
        array[:] = items
        return array.reshape(shape)
    dtype = np.dtype(DATATYPES[datatype]).newbyteorder("<")
    if len(raw) != count * dtype.itemsize:
        raise BadTensor(spec_name, f"{len(raw)} binary bytes for shape {shape} of {datatype}, "
                        f"which takes {count * dtype.itemsize}.")  # fmt: skip
    return np.frombuffer(raw, dtype=dtype).astype(DATATYPES[datatype], copy=False).reshape(shape)


def to_raw(array: np.ndarray[Any, Any], datatype: str) -> bytes:
    if datatype == "BYTES":
        parts: list[bytes] = []
        for value in array.reshape(-1).tolist():
            item = value if isinstance(value, bytes) else str(value).encode()
            parts.append(len(item).to_bytes(4, "little") + item)
        return b"".join(parts)
    dtype = np.dtype(DATATYPES[datatype]).newbyteorder("<")
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def encode_request(arrays: Mapping[str, np.ndarray[Any, Any]], signature: Signature) -> tuple[bytes, int]:
    """A binary request for these inputs asking every output in binary (the gateway → worker
    wire): (body, JSON header length)."""
    tensors = []
    blobs = []
    for spec in signature.inputs:
        raw = to_raw(arrays[spec.name], spec.datatype)
        blobs.append(raw)
        tensors.append({"name": spec.name, "datatype": spec.datatype, "shape": list(arrays[spec.name].shape),
                        "parameters": {"binary_data_size": len(raw)}})  # fmt: skip
    header = orjson.dumps({"inputs": tensors, "parameters": {"binary_data_output": True}})
    return header + b"".join(blobs), len(header)


def requested_outputs(signature: Signature, header: Mapping[str, Any]) -> dict[str, bool]:
    """The outputs a request asks for, each with whether it wants it in binary (all outputs,
    in JSON unless ``parameters.binary_data_output``, when it names none)."""
    parameters = header.get("parameters")
    all_binary = isinstance(parameters, Mapping) and parameters.get("binary_data_output") is True
    asked = header.get("outputs")
    if asked is None:
        return {spec.name: all_binary for spec in signature.outputs}
    if not isinstance(asked, list):
        raise BadTensor("outputs", "must be a list of tensors by name.")
    known = {spec.name for spec in signature.outputs}
    wanted: dict[str, bool] = {}
    for entry in asked:
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or name not in known:
            raise BadTensor(str(name), f"the model has no such output (its outputs: {', '.join(sorted(known))}).")
        own = entry.get("parameters")
        wanted[name] = bool(own.get("binary_data")) if isinstance(own, Mapping) and "binary_data" in own else all_binary
    return wanted


def encode_response(
    signature: Signature,
    outputs: Mapping[str, np.ndarray[Any, Any]],
    wanted: Mapping[str, bool],
    *,
    model_name: str,
    model_version: str,
    request_id: str | None = None,
) -> tuple[bytes, int | None]:
    """The inference response: (body, JSON header length, None when there is no binary part)."""
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for spec in signature.outputs:
        if spec.name not in wanted:
            continue
        array = np.asarray(outputs[spec.name])
        if wanted[spec.name]:
            raw = to_raw(array, spec.datatype)
            blobs.append(raw)
            tensors.append({"name": spec.name, "datatype": spec.datatype, "shape": list(array.shape),
                            "parameters": {"binary_data_size": len(raw)}})  # fmt: skip
        else:
            tensors.extend(encode_outputs(Signature(inputs=signature.inputs, outputs=(spec,)), {spec.name: array}))
    answer: dict[str, Any] = {"model_name": model_name, "model_version": model_version, "outputs": tensors}
    if request_id:
        answer["id"] = request_id
    header = orjson.dumps(answer)
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)


def decode_outputs(signature: Signature, answer: Mapping[str, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """A worker's response (``read_body``) back into arrays by name."""
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    specs = {spec.name: spec for spec in signature.outputs}
    for tensor in answer.get("outputs") or []:
        spec = specs.get(tensor.get("name"))
        if spec is None:
            continue
        arrays[spec.name] = _decode(spec, tensor, check_shape=False)
    missing = [name for name in specs if name not in arrays]
    if missing:
        raise BadRequest(f"The model's answer lacks output {missing[0]!r}.")
    return arrays


# --- The seeds' instance shape -----------------------------------------------------------


def instances_to_tensors(signature: Signature, instances: object) -> list[dict[str, Any]]:
    """``[{"<input>": row, ...}, ...]`` (or bare rows, for a model with one input) as the
    protocol's tensors, one row per instance; ``decode_inputs`` then checks them."""
    if not isinstance(instances, list) or not instances:
        raise BadTensor("inputs", "send a non-empty list of instances.")
    names = [spec.name for spec in signature.inputs]
    rows: dict[str, list[Any]] = {name: [] for name in names}
    for index, instance in enumerate(instances):
        if not isinstance(instance, Mapping):
            if len(names) != 1:
                raise BadTensor("inputs", f"instance {index} must be an object by input name ({', '.join(names)}).")
            instance = {names[0]: instance}
        unknown = sorted(set(instance) - set(names))
        if unknown:
            raise BadTensor(unknown[0], f"the model has no such input (its inputs: {', '.join(names)}).")
        for name in names:
            if name not in instance:
                raise BadTensor(name, f"missing from instance {index}.")
            rows[name].append(instance[name])
    tensors = []
    for spec in signature.inputs:
        values = rows[spec.name]
        shape = [len(values), *_row_shape(spec.name, values[0])]
        tensors.append({"name": spec.name, "datatype": spec.datatype, "shape": shape, "data": values})
    return tensors


def _row_shape(name: str, row: object) -> list[int]:
    shape: list[int] = []
    while isinstance(row, list):
        if not row:
            raise BadTensor(name, "an empty list in an instance.")
        shape.append(len(row))
        row = row[0]
    return shape


def predictions(outputs: Mapping[str, np.ndarray[Any, Any]], labels: Sequence[str], rows: int) -> list[dict[str, Any]]:
    """Each row's answer in the seeds' terms: ``prediction`` (the class name, where the model
    has a ``label`` output and names for its classes), ``confidence`` (that class's
    probability, where it has ``probabilities``) and every output's value for the row."""
    answers: list[dict[str, Any]] = []
    for row in range(rows):
        values = {name: _plain(array[row]) for name, array in outputs.items()}
        answer: dict[str, Any] = {}
        label = values.get("label")
        if isinstance(label, int):
            answer["prediction"] = labels[label] if 0 <= label < len(labels) else label
            probabilities = values.get("probabilities")
            if isinstance(probabilities, list) and 0 <= label < len(probabilities):
                answer["confidence"] = round(float(probabilities[label]), 6)
        elif label is not None:
            answer["prediction"] = label
        answer["outputs"] = values
        answers.append(answer)
    return answers


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value] if value.dtype == np.object_ else value.tolist()
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


# --- several requests in one call (a gateway to its worker; not part of the protocol) --------
#
# A gateway sends the predictions that wait for the same replica together: one HTTP call to
# ``MANY_PATH`` whose body is a 4-byte big-endian length, a JSON index of the parts
# (``[status, inference-header length or null, byte length]`` each; status 0 in a request),
# then the parts' bytes one after the other. The worker answers each part as it would the
# same request sent alone (its own status: a 429 for one part leaves the others answered),
# each as soon as it is ready (a part whose batch ran first does not wait for the others):
# the answer streams frames, each a 4-byte big-endian length, a JSON head
# ``[part index, status, inference-header length or null, byte length]`` and the bytes.

MANY_PATH = "/internal/infer-many"


@dataclass(frozen=True, slots=True)
class Part:
    """One request (status 0) or answer within a call to ``MANY_PATH``."""

    status: int
    header_length: str | None
    body: bytes


def pack_many(parts: Sequence[Part]) -> bytes:
    index = orjson.dumps([[p.status, p.header_length, len(p.body)] for p in parts])
    return b"".join([len(index).to_bytes(4, "big"), index, *(p.body for p in parts)])


def unpack_many(body: bytes) -> list[Part]:
    """The parts of a ``pack_many`` body; ``BadRequest`` when it is not one."""
    size = int.from_bytes(body[:4], "big")
    try:
        index = orjson.loads(body[4 : 4 + size])
    except orjson.JSONDecodeError:
        raise BadRequest("The parts' index is not JSON.") from None
    parts: list[Part] = []
    offset = 4 + size
    for entry in index if isinstance(index, list) else [None]:
        if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(entry[i], int) for i in (0, 2))):
            raise BadRequest("Each part's index entry is [status, header length or null, length].")
        status, header_length, length = entry
        if header_length is not None and not isinstance(header_length, str):
            raise BadRequest("A part's header length is a string or null.")
        if length < 0 or offset + length > len(body):
            raise BadRequest("A part is longer than the body.")
        parts.append(Part(status, header_length, body[offset : offset + length]))
        offset += length
    if offset != len(body):
        raise BadRequest("Bytes after the last part.")
    return parts


def answer_frame(index: int, part: Part) -> bytes:
    """One part's answer, as the worker streams it."""
    head = orjson.dumps([index, part.status, part.header_length, len(part.body)])
    return b"".join([len(head).to_bytes(4, "big"), head, part.body])


def frame_head(head: bytes, parts: int) -> tuple[int, int, str | None, int]:
    """An answer frame's head: (part index, status, header length, byte length);
    ``BadRequest`` when it is not one, or names no part of ``parts``."""
    try:
        entry = orjson.loads(head)
    except orjson.JSONDecodeError:
        raise BadRequest("An answer's head is not JSON.") from None
    if not (
        isinstance(entry, list)
        and len(entry) == 4
        and all(isinstance(entry[i], int) and entry[i] >= 0 for i in (0, 1, 3))
        and (entry[2] is None or isinstance(entry[2], str))
    ):
        raise BadRequest("An answer's head is [part index, status, header length or null, length].")
    if entry[0] >= parts:
        raise BadRequest(f"An answer to part {entry[0]} of {parts}.")
    return entry[0], entry[1], entry[2], entry[3]


def take_answers(buffer: bytes, parts: int) -> tuple[list[tuple[int, Part]], bytes]:
    """The whole answer frames at the start of ``buffer`` (part index, answer), and what is
    left after them (a frame not all there yet)."""
    answers: list[tuple[int, Part]] = []
    offset = 0
    while len(buffer) - offset >= 4:
        size = int.from_bytes(buffer[offset : offset + 4], "big")
        start = offset + 4 + size
        if len(buffer) < start:
            break
        index, status, header_length, length = frame_head(buffer[offset + 4 : start], parts)
        if len(buffer) < start + length:
            break
        answers.append((index, Part(status, header_length, buffer[start : start + length])))
        offset = start + length
    return answers, buffer[offset:]


def unpack_answers(body: bytes, parts: int) -> dict[int, Part]:
    """A whole streamed answer read at once: each part's answer by its index."""
    answers, rest = take_answers(body, parts)
    if rest:
        raise BadRequest("An answer is longer than the body.")
    return dict(answers)
