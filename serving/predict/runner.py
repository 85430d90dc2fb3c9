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

from registry.signatures import DATATYPES, Signature, TextInput

Arrays = Mapping[str, np.ndarray[Any, Any]]


class TorchScriptRunner:
    """A TorchScript module run on batches, as ``OnnxRunner`` runs a graph (torch releases the
    GIL in its kernels; its intra-op threads are the slot's cores)."""

    def __init__(self, path: Path, signature: Signature, *, threads: int = 1, device: str = "cpu") -> None:
        import torch

        from registry.signatures import torch_dtype

        torch.set_num_threads(max(1, threads))
        self.signature = signature
        self._torch = torch
        self.device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
        self._module = torch.jit.load(str(path), map_location=self.device).eval()
        self._dtypes = [torch_dtype(spec.datatype) for spec in signature.inputs]
        self._outputs = [spec.name for spec in signature.outputs]

    def run_batch(self, payloads: list[Arrays]) -> list[dict[str, np.ndarray[Any, Any]]]:
        from registry.signatures import torchscript_outputs

        rows = [len(next(iter(payload.values()))) for payload in payloads]
        inputs = [
            self._torch.from_numpy(np.ascontiguousarray(np.concatenate([p[spec.name] for p in payloads])))
            .to(self.device)
            .to(dtype)
            for spec, dtype in zip(self.signature.inputs, self._dtypes, strict=True)
        ]
        with self._torch.inference_mode():
            produced = [t.detach().cpu().numpy() for t in torchscript_outputs(self._module(*inputs), self._outputs)]
        bounds = np.cumsum([0, *rows])
        return [
            {name: array[bounds[i] : bounds[i + 1]] for name, array in zip(self._outputs, produced, strict=True)}
            for i in range(len(payloads))
        ]


class Tokenize:
    """A text model's tokenizer step: a batch's strings → the graph's token inputs, padded to
    the batch's longest text (so a batch of short texts stays short)."""

    def __init__(self, text: TextInput, folder: Path, graph_inputs: list[str]) -> None:
        self.text = text
        self._tokenizer = text.load(folder)
        self._inputs = graph_inputs

    def feeds(self, texts: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
        strings = [t.decode(errors="replace") if isinstance(t, bytes) else str(t) for t in texts.reshape(-1)]
        encoded = self._tokenizer.encode_batch(strings)
        columns = {
            "input_ids": [e.ids for e in encoded],
            "attention_mask": [e.attention_mask for e in encoded],
            "token_type_ids": [e.type_ids for e in encoded],
        }
        return {name: np.asarray(columns[name], dtype=np.int64) for name in self._inputs}


class OnnxRunner:
    def __init__(
        self, path: Path, signature: Signature, *, threads: int = 1, text: TextInput | None = None, device: str = "cpu"
    ) -> None:
        import onnxruntime  # loaded by workers only

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = max(1, threads)
        options.inter_op_num_threads = 1
        self.signature = signature
        # On a GPU slot, ONNX Runtime's CUDA provider where the installed build has it
        # (onnxruntime-gpu); the CPU one otherwise, and for what CUDA does not run.
        cuda = device == "cuda" and "CUDAExecutionProvider" in onnxruntime.get_available_providers()
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
        self.device = "cuda" if cuda else "cpu"
        self._session = onnxruntime.InferenceSession(str(path), options, providers=providers)
        self._outputs = [spec.name for spec in signature.outputs]
        graph_inputs = [arg.name for arg in self._session.get_inputs()]
        self._tokenize = Tokenize(text, path.parent, graph_inputs) if text is not None else None

    def run_batch(self, payloads: list[Arrays]) -> list[dict[str, np.ndarray[Any, Any]]]:
        """Run every request of the batch at once; one dict of outputs per request, in order."""
        rows = [len(next(iter(payload.values()))) for payload in payloads]
        if self._tokenize is not None:
            name = self._tokenize.text.input
            feeds = self._tokenize.feeds(np.concatenate([payload[name] for payload in payloads]))
        else:
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
