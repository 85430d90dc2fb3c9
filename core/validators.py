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
