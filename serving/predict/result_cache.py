"""The exact result cache's key for a deterministic model: the same version given the same
tensors answers the same, so the answer can be served again (billed as cached).

The key hashes, for each input in name order, its name, datatype, shape and bytes (strings
as UTF-8, each with its length, so no two lists of strings run together). Nothing about
the request's encoding (nested or flat data, JSON spacing, the order inputs were listed in)
changes it; any value, dtype, shape or version does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np


def result_key(*, version_id: int, inputs: Mapping[str, np.ndarray[Any, Any]]) -> str:
    digest = hashlib.blake2b(f"v{version_id}".encode(), digest_size=20)
    for name in sorted(inputs):
        array = inputs[name]
        digest.update(f"|{name}|{array.dtype.str if array.dtype != object else 'bytes'}|{array.shape}|".encode())
        if array.dtype == object:
            for value in array.reshape(-1):
                raw = value if isinstance(value, bytes) else str(value).encode()
                digest.update(len(raw).to_bytes(8, "little"))
                digest.update(raw)
        else:
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()
