"""Input checks shared by the apps' services."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from core.errors import InvalidInput


def clean_percent(field: str, value: Any) -> Decimal | None:
    """A percentage from 0 to 100 with at most two decimals (quantized to two), or None for
    an empty value; InvalidInput naming ``field`` otherwise."""
    if value is None or str(value).strip() == "":
        return None
    try:
        percent = Decimal(str(value))
    except InvalidOperation:
        raise InvalidInput(field, "Give a percentage from 0 to 100.") from None
    if not percent.is_finite() or not 0 <= percent <= 100 or percent != percent.quantize(Decimal("0.01")):
        raise InvalidInput(field, "Give a percentage from 0 to 100, at most two decimals.")
    return percent.quantize(Decimal("0.01"))


def nul_path(value: object, path: str = "") -> str | None:
    """Where a NUL character hides in a JSON-like value (a string, or a key or string inside
    dicts and lists), as a dotted path from ``path``; None when there is none. PostgreSQL
    refuses NUL in text and JSON alike, so a value headed for the database is checked first."""
    stack: list[tuple[object, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return where
        elif isinstance(item, dict):
            for key, inner in item.items():
                if isinstance(key, str) and "\x00" in key:
                    return f"{where} (a key)" if where else "(a key)"
                stack.append((inner, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, list | tuple):
            stack.extend((inner, f"{where}[{i}]") for i, inner in enumerate(item))
    return None


def without_nul(value: Any) -> Any:
    """``value`` with every NUL in its strings (and keys) replaced by U+FFFD, the replacement
    character: for what the platform must store but did not choose (an engine's answer)."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_nul(v) for v in value]
    return value
