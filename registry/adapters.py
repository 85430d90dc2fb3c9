"""LoRA adapters: versions whose artifact is a PEFT LoRA adapter folder on a named base version.

An adapter's artifact is what ``peft``'s ``save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors`` (or the older ``adapter_model.bin``). Its version has the
framework ``lora`` and a ``registry.Adapter`` row naming its base, a chat or completion version
served by the platform's own engines (vLLM loads adapters beside the base it was started with,
``--enable-lora``, each known by ``lora_name``). What is read here is checked before any row is
written, so an adapter that an engine would refuse is never registered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings

from core.errors import InvalidInput
from registry.signatures import is_predict_framework
from registry.upstreams import is_upstream_framework

if TYPE_CHECKING:
    from registry.models import ModelVersion

ADAPTER_FRAMEWORK = "lora"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# A PEFT adapter config is a few hundred bytes; anything this large is not one.
MAX_CONFIG_BYTES = 64 * 1024
# The tasks an adapter's base may have: adapters are for generative LLMs.
GENERATIVE_TASKS = frozenset({"chat", "completion"})


def is_adapter_framework(framework: str) -> bool:
    return framework.strip().lower() == ADAPTER_FRAMEWORK


@dataclass(frozen=True)
class AdapterFacts:
    """What the registry keeps of an adapter's config: its rank, scaling and target modules."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]


def read_adapter(folder: Path) -> AdapterFacts:
    """The facts of the PEFT LoRA adapter in ``folder``; an ``InvalidInput`` on ``artifact_uri``
    when it is not one an engine would load (``settings.LORA_MAX_RANK`` bounds its rank)."""
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        raise InvalidInput("artifact_uri", f"A LoRA adapter's artifact holds {ADAPTER_CONFIG}; this one has none.")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise InvalidInput(
            "artifact_uri", f"{ADAPTER_CONFIG} is over {MAX_CONFIG_BYTES // 1024} KiB: not a PEFT adapter config."
        )
    try:
        config = json.loads(config_path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput("artifact_uri", f"{ADAPTER_CONFIG} is not valid JSON ({exc}).") from exc
    if not isinstance(config, dict):
        raise InvalidInput("artifact_uri", f"{ADAPTER_CONFIG} must hold a JSON object.")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise InvalidInput("artifact_uri", f"Only LoRA adapters are served: peft_type is {peft_type!r}, not 'LORA'.")
    rank, most = config.get("r"), settings.LORA_MAX_RANK
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= most:
        raise InvalidInput(
            "artifact_uri",
            f"The adapter's rank r is {rank!r}: it must be a whole number from 1 to {most} (LORA_MAX_RANK).",
        )
    if not any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
        raise InvalidInput("artifact_uri", f"The adapter has no weights: {' or '.join(ADAPTER_WEIGHTS)} is missing.")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise InvalidInput("artifact_uri", f"The adapter's lora_alpha is {alpha!r}, not a number.")
    targets = config.get("target_modules") or ()
    if isinstance(targets, str):  # PEFT allows a regular expression (or "all-linear") here
        targets = (targets,)
    if not isinstance(targets, list | tuple) or not all(isinstance(t, str) for t in targets):
        raise InvalidInput("artifact_uri", "The adapter's target_modules must be a list of module names.")
    return AdapterFacts(rank=rank, alpha=alpha, target_modules=tuple(sorted(targets)))


def base_refusal(base: ModelVersion) -> str | None:
    """Why ``base`` cannot carry adapters, or None when it can (the console offers the bases
    this accepts): a generative model served from an artifact by the platform's engines."""
    if is_adapter_framework(base.framework):
        return f"{base} is itself an adapter; an adapter's base is a full model."
    if is_upstream_framework(base.framework):
        return f"{base} is served by an external upstream: the platform cannot load an adapter into it."
    if is_predict_framework(base.framework):
        return f"{base} is a small model ({base.framework}): adapters are for generative LLMs."
    if base.model.task not in GENERATIVE_TASKS:
        return f"{base} is a {base.model.task} model: adapters are for chat or completion LLMs."
    return None


def clean_base(base_version: ModelVersion) -> ModelVersion:
    """``base_version``, or an ``InvalidInput`` on ``base`` when it cannot carry adapters."""
    refusal = base_refusal(base_version)
    if refusal is not None:
        raise InvalidInput("base", refusal)
    return base_version


def lora_name(version: ModelVersion) -> str:
    """The name an engine knows the adapter by (``--lora-modules NAME=PATH``, a request's model)."""
    return f"{version.model.name}@{version.version}"


def base_label(version: ModelVersion) -> str:
    """How a base is written in the API and in an adapter's config: ``model:version``."""
    return f"{version.model.name}:{version.version}"
