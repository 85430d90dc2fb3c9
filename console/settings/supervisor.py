"""Engine workers: the supervisor (manage.py runworkers) and the vLLM and predict replicas it starts."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from core import embedded

from .env import envfloat, envint, envlist

#: This host's name, as its replicas and its lease are registered (default: the hostname).
WORKER_HOST = os.environ.get("WORKER_HOST") or socket.gethostname()
# "cpu": one replica per listed core (VLLM_CPU_OMP_THREADS_BIND); "gpu": one per GPU index.
#: What the replicas run on: "cpu" or "gpu".
WORKER_DEVICE = os.environ.get("WORKER_DEVICE", "cpu")


def _gpus_given() -> int:
    """How many GPUs this process was given (a container's, by NVIDIA's device plugin or runtime):
    the entries of CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES (0 when neither lists any)."""
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = os.environ.get(name, "").strip()
        if value and value not in ("all", "none", "void"):
            return len([entry for entry in value.split(",") if entry.strip()])
    return 0


#: The slots replicas are placed on: core numbers or GPU indexes (a comma-separated list; default
#: every core, or with WORKER_DEVICE=gpu every GPU the process was given, 0 … n-1).
WORKER_SLOTS = envlist(
    "WORKER_SLOTS",
    ",".join(str(i) for i in range((WORKER_DEVICE == "gpu" and _gpus_given()) or os.cpu_count() or 1)),
)
#: The address the replicas listen on and gateways reach them at (a host name or IP).
WORKER_ENGINE_HOST = os.environ.get("WORKER_ENGINE_HOST", "127.0.0.1")
#: How often the supervisor heart-beats each replica (seconds).
WORKER_HEARTBEAT_SECONDS = envfloat("WORKER_HEARTBEAT_SECONDS", 3.0)
#: How long a replica may take to become ready (seconds).
WORKER_STARTUP_TIMEOUT = envfloat("WORKER_STARTUP_TIMEOUT", 600.0)
#: How long a replica being stopped may take to finish its requests (seconds).
WORKER_DRAIN_TIMEOUT = envfloat("WORKER_DRAIN_TIMEOUT", 30.0)
#: The longest wait before restarting a replica that keeps failing (seconds).
WORKER_MAX_BACKOFF = envfloat("WORKER_MAX_BACKOFF", 60.0)
# One supervisor per host name: it holds the host's lease (registry.HostLease), renewed on
# every pass (0.5 s); a second one refuses to start while it runs. One killed with SIGKILL
# can be succeeded this long after its last renewal.
#: How long a supervisor's host lease outlives its last renewal (seconds).
WORKER_HOST_LEASE_SECONDS = envfloat("WORKER_HOST_LEASE_SECONDS", 15.0)
#: Where the replicas' logs are written (a folder).
WORKER_LOG_DIR = Path(os.environ.get("WORKER_LOG_DIR", str(embedded.VAR_DIR / "engines")))
#: vLLM's KV cache per CPU replica (GiB).
VLLM_CPU_KVCACHE_SPACE = envint("VLLM_CPU_KVCACHE_SPACE", 1)
#: The share of a GPU's memory a vLLM replica may use (a fraction).
VLLM_GPU_MEMORY_UTILIZATION = envfloat("VLLM_GPU_MEMORY_UTILIZATION", 0.85)
# The model's own max_seq_len applies when smaller.
#: Upper bound on a replica's context (tokens).
ENGINE_MAX_MODEL_LEN = envint("ENGINE_MAX_MODEL_LEN", 8192)
# vLLM's --max-lora-rank takes only these values; an adapter of a higher rank is refused at
# registration (registry.adapters.read_adapter), so every registered adapter can be loaded.
#: The highest LoRA adapter rank accepted and served (vLLM's --max-lora-rank: 1, 8, 16, 32, 64, 128, 256, 320 or 512).
LORA_MAX_RANK = envint("LORA_MAX_RANK", 16)
if LORA_MAX_RANK not in (1, 8, 16, 32, 64, 128, 256, 320, 512):
    raise ImproperlyConfigured(
        f"LORA_MAX_RANK must be one of vLLM's --max-lora-rank values (1, 8, 16, 32, 64, 128, 256, 320, 512), "
        f"not {LORA_MAX_RANK}"
    )
#: Extra command-line arguments for every vLLM replica (a shell-quoted string).
ENGINE_EXTRA_ARGS = os.environ.get("ENGINE_EXTRA_ARGS", "")
# "priority" lets interactive requests (priority 0) go before batch jobs' lines
# (BATCH_ENGINE_PRIORITY), which vLLM preempts for them; "fcfs" is vLLM's default (first
# come, first served).
#: vLLM's scheduling policy for the engines runworkers starts: "priority" or "fcfs".
ENGINE_SCHEDULING_POLICY = os.environ.get("ENGINE_SCHEDULING_POLICY", "priority")
if ENGINE_SCHEDULING_POLICY not in ("priority", "fcfs"):
    raise ValueError("ENGINE_SCHEDULING_POLICY must be priority or fcfs")
# Its arguments follow.
#: The program a replica runs (a command; empty: vLLM's OpenAI server).
WORKER_ENGINE_LAUNCHER = os.environ.get("WORKER_ENGINE_LAUNCHER", "")
# Small models (framework onnx) run in the platform's predict worker, not vLLM: each uses
# WORKER_PREDICT_THREADS ONNX Runtime threads, and up to WORKER_PREDICT_PER_SLOT of them share
# a slot (with each other and with a vLLM engine): a small model rarely needs a core of its own.
#: ONNX Runtime threads per small-model replica (a count).
WORKER_PREDICT_THREADS = envint("WORKER_PREDICT_THREADS", 1)
#: Small-model replicas that may share one slot (a count).
WORKER_PREDICT_PER_SLOT = envint("WORKER_PREDICT_PER_SLOT", 4)
