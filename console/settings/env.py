"""Reading settings from the environment: the helpers every settings module uses."""

from __future__ import annotations

import os


def envbool(name: str, default: str) -> bool:
    return os.environ.get(name, default).lower() in {"1", "true", "yes", "on"}


def envint(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


def envfloat(name: str, default: float) -> float:
    return float(os.environ.get(name, str(default)))


def envlist(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]
