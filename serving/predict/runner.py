"""A model version's ONNX graph run on batches: the ``run_batch`` a ``DynamicBatcher`` calls.

Each request of a batch brings arrays by input name with its own rows; the batch's arrays are
concatenated along the first (batch) dimension, run once through ONNX Runtime, and every
output is cut back into each request's rows, in order. ONNX Runtime releases the GIL while
it runs, so several instances (threads) of one runner can share a replica's cores; its own
thread pool is sized to the cores its slot was given.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from registry.signatures import DATATYPES, Signature

Arrays = Mapping[str, np.ndarray[Any, Any]]


class TorchScriptRunner:
    """A TorchScript module run on batches, as ``OnnxRunner`` runs a graph (torch releases the
    GIL in its kernels; its intra-op threads are the slot's cores)."""

    def __init__(self, path: Path, signature: Signature, *, threads: int = 1) -> None:
        import torch

        from registry.signatures import torch_dtype

        torch.set_num_threads(max(1, threads))
        self.signature = signature
        self._torch = torch
        self._module = torch.jit.load(str(path), map_location="cpu").eval()
        self._dtypes = [torch_dtype(spec.datatype) for spec in signature.inputs]
        self._outputs = [spec.name for spec in signature.outputs]

    def run_batch(self, payloads: list[Arrays]) -> list[dict[str, np.ndarray[Any, Any]]]:
        from registry.signatures import torchscript_outputs

        rows = [len(next(iter(payload.values()))) for payload in payloads]
        inputs = [
            self._torch.from_numpy(np.ascontiguousarray(np.concatenate([p[spec.name] for p in payloads]))).to(dtype)
            for spec, dtype in zip(self.signature.inputs, self._dtypes, strict=True)
        ]
        with self._torch.inference_mode():
            produced = [t.detach().cpu().numpy() for t in torchscript_outputs(self._module(*inputs), self._outputs)]
        bounds = np.cumsum([0, *rows])
        return [
            {name: array[bounds[i] : bounds[i + 1]] for name, array in zip(self._outputs, produced, strict=True)}
            for i in range(len(payloads))
        ]


class OnnxRunner:
    def __init__(self, path: Path, signature: Signature, *, threads: int = 1) -> None:
        import onnxruntime  # loaded by workers only

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = max(1, threads)
        options.inter_op_num_threads = 1
        self.signature = signature
        self._session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self._outputs = [spec.name for spec in signature.outputs]

    def run_batch(self, payloads: list[Arrays]) -> list[dict[str, np.ndarray[Any, Any]]]:
        """Run every request of the batch at once; one dict of outputs per request, in order."""
        rows = [len(next(iter(payload.values()))) for payload in payloads]
        feeds = {
            spec.name: np.concatenate([payload[spec.name] for payload in payloads]).astype(
                DATATYPES[spec.datatype], copy=False
            )
            for spec in self.signature.inputs
        }
        produced = self._session.run(self._outputs, feeds)
        bounds = np.cumsum([0, *rows])
        return [
            {name: array[bounds[i] : bounds[i + 1]] for name, array in zip(self._outputs, produced, strict=True)}
            for i in range(len(payloads))
        ]
