"""How a model version's requests are batched: the ``batcher`` key of its config, checked
when the version is registered and read by the worker that serves it
(``serving.predict.batcher.DynamicBatcher``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from core.errors import InvalidInput

# What a version gets when its config says nothing; bounds on what it may say.
MAX_BATCH_SIZE_LIMIT = 4096
MAX_QUEUE_DELAY_US_LIMIT = 1_000_000  # a second: past it, batching costs more latency than it saves
MAX_QUEUE_SIZE_LIMIT = 1_000_000
MAX_INSTANCES = 64


@dataclass(frozen=True)
class BatcherConfig:
    """How a version's requests are batched (the keys of ``config["batcher"]``)."""

    max_batch_size: int = 32
    max_queue_delay_us: int = 0  # as Triton's: a batch goes when the model is free (docs/architecture.md)
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 1_024
    timeout_s: float = 10.0
    instances: int = 1

    @classmethod
    def from_json(cls, value: object) -> BatcherConfig:
        """Checked: an unknown key or a bad value is an ``InvalidInput`` naming it."""
        if value is None:
            return cls()
        if not isinstance(value, Mapping):
            raise InvalidInput("batcher", "Must be an object.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidInput(
                f"batcher.{unknown[0]}", f"Unknown key; the batcher's keys are {', '.join(sorted(known))}."
            )
        config = cls(
            max_batch_size=_integer(value, "max_batch_size", cls.max_batch_size, 1, MAX_BATCH_SIZE_LIMIT),
            max_queue_delay_us=_integer(
                value, "max_queue_delay_us", cls.max_queue_delay_us, 0, MAX_QUEUE_DELAY_US_LIMIT
            ),
            preferred_batch_sizes=_sizes(value.get("preferred_batch_sizes", ())),
            max_queue_size=_integer(value, "max_queue_size", cls.max_queue_size, 1, MAX_QUEUE_SIZE_LIMIT),
            timeout_s=_seconds(value.get("timeout_s", cls.timeout_s)),
            instances=_integer(value, "instances", cls.instances, 1, MAX_INSTANCES),
        )
        too_big = [size for size in config.preferred_batch_sizes if size > config.max_batch_size]
        if too_big:
            raise InvalidInput(
                "batcher.preferred_batch_sizes", f"{too_big[0]} is over max_batch_size ({config.max_batch_size})."
            )
        if config.max_queue_size < config.max_batch_size:
            raise InvalidInput("batcher.max_queue_size", f"Must be at least max_batch_size ({config.max_batch_size}).")
        return config

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["preferred_batch_sizes"] = list(self.preferred_batch_sizes)
        return data


def _integer(value: Mapping[str, object], key: str, default: int, low: int, high: int) -> int:
    number = value.get(key, default)
    if isinstance(number, bool) or not isinstance(number, int):
        raise InvalidInput(f"batcher.{key}", "Must be a whole number.")
    if not low <= number <= high:
        raise InvalidInput(f"batcher.{key}", f"Must lie between {low} and {high}.")
    return number


def _sizes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise InvalidInput("batcher.preferred_batch_sizes", "Must be a list of whole numbers.")
    if any(v < 1 for v in value):
        raise InvalidInput("batcher.preferred_batch_sizes", "Every size must be at least 1.")
    return tuple(sorted(set(value)))


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
        raise InvalidInput("batcher.timeout_s", "Must be a number of seconds above 0, at most 3600.")
    return float(value)
