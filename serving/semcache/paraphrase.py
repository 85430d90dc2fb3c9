"""PLACEHOLDER until the verifier build lands (i39-model): the local models' interface."""

from __future__ import annotations

from collections.abc import Callable


class LocalModels:
    def embed(self, texts: list[str]) -> list[list[float]]:
        raise NotImplementedError

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        raise NotImplementedError

    def threshold_for(self, delta: float) -> float:
        raise NotImplementedError

    def curve(self) -> Callable[[float], float]:
        raise NotImplementedError


_override: LocalModels | None = None


def local_models() -> LocalModels | None:
    return _override
