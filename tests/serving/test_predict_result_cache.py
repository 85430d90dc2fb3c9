"""The exact result cache's key (serving.predict.result_cache): the same tensors of the same
version give one key however the request spelled them; anything else gives another."""

from __future__ import annotations

import numpy as np

from registry.signatures import Signature
from serving.gateway.inference_protocol import decode_inputs
from serving.predict.result_cache import result_key

SIGNATURE = Signature.from_json({
    "inputs": [{"name": "a", "datatype": "FP32", "shape": [-1, 2]}, {"name": "t", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
})  # fmt: skip


def key(a: object, t: object, *, version: int = 1, order: str = "at") -> str:
    tensors = {
        "a": {"name": "a", "datatype": "FP32", "shape": [2, 2], "data": a},
        "t": {"name": "t", "datatype": "BYTES", "shape": [2], "data": t},
    }
    arrays, _ = decode_inputs(SIGNATURE, [tensors[name] for name in order])
    return result_key(version_id=version, inputs=arrays)


def test_the_same_tensors_spelled_differently_share_a_key():
    flat = key([1, 2, 3, 4], ["x", "y"])
    assert key([[1, 2], [3, 4]], ["x", "y"]) == flat  # nested data
    assert key([1.0, 2.0, 3.0, 4.0], ["x", "y"], order="ta") == flat  # floats, other order


def test_anything_else_is_another_key():
    base = key([1, 2, 3, 4], ["x", "y"])
    assert key([1, 2, 3, 5], ["x", "y"]) != base
    assert key([1, 2, 3, 4], ["x", "z"]) != base
    assert key([1, 2, 3, 4], ["xy", ""]) != base  # strings never run together
    assert key([1, 2, 3, 4], ["x", "y"], version=2) != base
    arrays = {"a": np.ones((2, 2), np.float32), "t": np.array(["x", "y"], dtype=object)}
    assert result_key(version_id=1, inputs=arrays) != result_key(
        version_id=1, inputs={**arrays, "a": np.ones((1, 4), np.float32)}
    )  # the same bytes in another shape
    assert result_key(version_id=1, inputs=arrays) != result_key(
        version_id=1, inputs={**arrays, "a": np.ones((2, 2), np.float64)}
    )  # the same values in another dtype
