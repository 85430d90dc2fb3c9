"""Small models' predictions (serving.predict): the Open Inference Protocol over HTTP and gRPC."""

from __future__ import annotations

from .env import envfloat, envint

# The worker's own batcher deadline, the version's batcher.timeout_s, usually ends it first.
#: A predict request's answer is due from its worker within this (seconds).
PREDICT_REQUEST_TIMEOUT = envfloat("PREDICT_REQUEST_TIMEOUT", 30.0)
#: The port of the Open Inference Protocol's gRPC service (manage.py rungrpc, started by runplatform).
GRPC_PORT = envint("GRPC_PORT", 8001)
#: How long the exact result cache keeps a deterministic small model's answer (seconds; 0: off).
PREDICT_RESULT_CACHE_TTL_SECONDS = envint("PREDICT_RESULT_CACHE_TTL_SECONDS", 3600)
# Larger bodies have their tensors read in one of PREDICT_DECODE_THREADS worker threads, off
# the event loop, after paying their place in the key's per-minute request bucket (as large
# prompts do: PROMPT_COUNT_INLINE_BYTES).
#: Predict bodies up to this size have their tensors read on the event loop (bytes).
PREDICT_DECODE_INLINE_BYTES = envint("PREDICT_DECODE_INLINE_BYTES", 32 * 1024)
#: Worker threads that read larger predict bodies (a count).
PREDICT_DECODE_THREADS = envint("PREDICT_DECODE_THREADS", 2)
