"""An MLServer runtime that serves an ONNX graph with ONNX Runtime, as MLServer's users write
one (MLServer ships no ONNX runtime): the baseline of bench/predict_suite.py. MLServer's
adaptive batching (max_batch_size, max_batch_time in model-settings.json) merges requests
along the first dimension before ``predict`` and splits the answer after it.

A text model (``parameters.extra.tokenizer``: a Hugging Face ``tokenizers`` file) takes one
BYTES input of strings and is fed the graph's token inputs, padded to the batch's longest
text, as the platform's worker does."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxModel(MLModel):  # type: ignore[misc]  # MLServer is not installed where mypy runs
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # as the platform's worker on one slot
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(self.settings.parameters.uri, options, providers=["CPUExecutionProvider"])
        self._outputs = [output.name for output in self._session.get_outputs()]
        self._inputs = [arg.name for arg in self._session.get_inputs()]
        extra = self.settings.parameters.extra or {}
        self._tokenizer = None
        if extra.get("tokenizer"):
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(extra["tokenizer"])
            self._tokenizer.enable_truncation(128)
            padding = self._tokenizer.padding or {}  # to the batch's longest text, as the platform's worker
            self._tokenizer.enable_padding(pad_id=padding.get("pad_id", 0), pad_token=padding.get("pad_token", "[PAD]"))
        return True

    def _feeds(self, payload: InferenceRequest) -> dict[str, np.ndarray]:
        if self._tokenizer is None:
            return {tensor.name: NumpyCodec.decode_input(tensor) for tensor in payload.inputs}
        texts = NumpyCodec.decode_input(payload.inputs[0]).reshape(-1)
        encoded = self._tokenizer.encode_batch([t.decode() if isinstance(t, bytes) else str(t) for t in texts])
        columns = {
            "input_ids": [e.ids for e in encoded],
            "attention_mask": [e.attention_mask for e in encoded],
            "token_type_ids": [e.type_ids for e in encoded],
        }
        return {name: np.asarray(columns[name], dtype=np.int64) for name in self._inputs}

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        results = self._session.run(self._outputs, self._feeds(payload))
        return InferenceResponse(
            model_name=self.name,
            outputs=[NumpyCodec.encode_output(name, array) for name, array in zip(self._outputs, results, strict=True)],
        )
