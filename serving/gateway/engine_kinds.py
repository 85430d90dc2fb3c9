"""Engine kinds: what the platform knows of each kind of engine a replica runs.

A kind owns the frameworks it serves, the command line that starts one of its replicas, and
how that replica is watched: the path of its health probe and the metrics whose sum says it
is busy (a draining replica stops once they are zero). The supervisor starts and watches
replicas through their kind (``serving.supervisor``); the first kind in ``KINDS`` that serves
a version's framework is its kind. Today: the platform's own predict workers (small models:
ONNX, TorchScript), external upstreams (``openai-upstream``: an OpenAI-compatible server the
platform does not run, ``registry.upstreams``) and vLLM's OpenAI server (every other framework).

Adding a kind: docs/architecture.md, "Adding an engine kind".
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from registry.models import Deployment
from registry.signatures import is_predict_framework
from registry.upstreams import is_upstream_framework


@dataclass(frozen=True)
class EngineKind:
    name: str
    serves: Callable[[str], bool]  # a version's framework -> whether this kind serves it
    # (deployment, port, its artifact's local folder) -> argv of one replica; None: no process
    # of ours (an external upstream). The supervisor fetches the folder (serving.supervisor.weights).
    command: Callable[[Deployment, int, Path], list[str]] | None
    busy_metrics: tuple[str, ...]  # Prometheus series whose sum is the requests in flight
    # In its command line: a pid an earlier supervisor recorded is one of ours to kill only
    # when its command line has it (a reused pid is a stranger's). Empty: no process.
    process_mark: bytes
    health_path: str = "/health"  # 200 when the replica serves
    metrics_path: str = "/metrics"
    # What a replica takes of its host's slots: "own" (a slot no other such replica holds),
    # "shared" (a slot shared with up to WORKER_PREDICT_PER_SLOT - 1 others), "none".
    slot_use: str = "own"
    # Its context is the version's max_seq_len at most ENGINE_MAX_MODEL_LEN (the platform
    # starts it so); False: the declared one (another's server).
    capped_context: bool = True
    # Requests tried in turn, (path, body without "model"), once it is healthy and before it is
    # routed or promoted: the first that is not refused as unsupported (400/404) warms it up.
    # A fresh vLLM engine's first request pays first-run costs the first customer should not.
    warm_up: tuple[tuple[str, dict[str, object]], ...] = ()

    @property
    def runs_process(self) -> bool:
        return self.command is not None

    def context_length(self, config: dict[str, object]) -> int:
        return served_context_length(config, capped=self.capped_context)


def served_context_length(config: dict[str, object], *, capped: bool = True) -> int:
    """The context a replica of this version is started with (``_vllm_command``), and routed by:
    its ``max_seq_len``, at most ENGINE_MAX_MODEL_LEN. An external upstream's (``capped``
    False) is its declared one: the platform does not start it."""
    declared = config.get("max_seq_len")
    limit = settings.ENGINE_MAX_MODEL_LEN
    if not (isinstance(declared, int | str) and str(declared).isdigit()):
        return limit
    return min(int(declared), limit) if capped else int(declared)


def _predict_command(deployment: Deployment, port: int, path: Path) -> list[str]:
    version = deployment.version
    return [
        sys.executable, "-m", "serving.predict.worker",
        "--name", version.model.name,
        "--version", version.version,
        "--artifact", str(path),
        "--config", json.dumps(version.config),
        "--host", settings.WORKER_ENGINE_HOST,
        "--port", str(port),
        "--threads", str(settings.WORKER_PREDICT_THREADS),
        "--framework", version.framework.strip().lower(),
        # On a GPU host each slot is one GPU (CUDA_VISIBLE_DEVICES): the model runs there.
        "--device", "cpu" if settings.WORKER_DEVICE == "cpu" else "cuda",
    ]  # fmt: skip


def _vllm_command(deployment: Deployment, port: int, path: Path) -> list[str]:
    version = deployment.version
    model = version.model
    launcher = shlex.split(settings.WORKER_ENGINE_LAUNCHER) or [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    command = [
        *launcher,
        "--model", str(path),
        "--served-model-name", model.name,
        "--host", settings.WORKER_ENGINE_HOST,
        "--port", str(port),
        "--max-model-len", str(served_context_length(version.config)),
        "--uvicorn-log-level", "warning",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if model.task == "embedding":
        command += ["--runner", "pooling"]
    elif deployment.max_adapters > 0:
        # LoRA adapters of this version, loaded while it runs (serving.supervisor.adapters).
        command += [
            "--enable-lora", "--max-loras", str(deployment.max_adapters),
            "--max-lora-rank", str(settings.LORA_MAX_RANK),
        ]  # fmt: skip
    # Interactive requests before batch jobs' lines (serving.batches sends theirs a priority).
    command += ["--scheduling-policy", settings.ENGINE_SCHEDULING_POLICY]
    if settings.WORKER_DEVICE == "cpu":
        # Eager mode starts in ~35 s instead of ~3 min and serves about as fast on CPU.
        command += ["--enforce-eager"]
    else:
        command += ["--gpu-memory-utilization", str(settings.VLLM_GPU_MEMORY_UTILIZATION)]
    return command + shlex.split(settings.ENGINE_EXTRA_ARGS)


PREDICT = EngineKind(
    name="predict",
    serves=is_predict_framework,
    command=_predict_command,
    busy_metrics=("predict:num_requests_running", "predict:num_requests_waiting"),
    process_mark=b"serving.predict.worker",
    slot_use="shared",
)
EXTERNAL = EngineKind(
    name="external",
    serves=is_upstream_framework,
    command=None,
    busy_metrics=(),  # another's server: its load is not only ours, and drains nothing of ours
    process_mark=b"",
    # The OpenAI API's own listing (an upstream need not have /health): 200 with the model in it.
    health_path="/v1/models",
    metrics_path="",
    slot_use="none",
    capped_context=False,
)
VLLM = EngineKind(
    name="vllm",
    serves=lambda framework: not is_predict_framework(framework) and not is_upstream_framework(framework),
    command=_vllm_command,
    busy_metrics=("vllm:num_requests_running", "vllm:num_requests_waiting"),
    process_mark=b"--served-model-name",
    # A generative model answers the first, a pooling (embedding) one the second.
    warm_up=(("/v1/completions", {"prompt": "Hello", "max_tokens": 1}), ("/v1/embeddings", {"input": "Hello"})),
)
KINDS: tuple[EngineKind, ...] = (PREDICT, EXTERNAL, VLLM)
# The marks of the kinds that run a process (an external upstream has none).
PROCESS_MARKS: tuple[bytes, ...] = tuple(kind.process_mark for kind in KINDS if kind.process_mark)


def kind_of(framework: str) -> EngineKind:
    """The kind of engine that serves a version of this framework."""
    for kind in KINDS:
        if kind.serves(framework):
            return kind
    raise LookupError(f"no engine kind serves the framework {framework!r}")
