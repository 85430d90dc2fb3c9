"""An MLServer runtime that serves an ONNX graph with ONNX Runtime, as MLServer's users write
one (MLServer ships no ONNX runtime): the baseline of bench/predict_suite.py. MLServer's
adaptive batching (max_batch_size, max_batch_time in model-settings.json) merges requests
along the first dimension before ``predict`` and splits the answer after it."""

from __future__ import annotations

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
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {tensor.name: NumpyCodec.decode_input(tensor) for tensor in payload.inputs}
        results = self._session.run(self._outputs, feeds)
        return InferenceResponse(
            model_name=self.name,
            outputs=[NumpyCodec.encode_output(name, array) for name, array in zip(self._outputs, results, strict=True)],
        )
