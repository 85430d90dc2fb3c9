"""What a request costs, for spend caps.

Spend is counted in integer micro-units. Models have no prices yet, so until they do one
token costs one unit: a spend cap of 1000 allows 1000 tokens a month.
"""

from __future__ import annotations

from decimal import Decimal

SPEND_MICRO = 1_000_000


def cost_micros(*, tokens: int) -> int:
    return tokens * SPEND_MICRO


def to_micros(amount: Decimal | None) -> int:
    """A money amount (or None for "no cap") as micro-units (0 for none)."""
    return int(amount * SPEND_MICRO) if amount is not None else 0


def from_micros(micros: Decimal | int) -> Decimal:
    return Decimal(micros) / SPEND_MICRO
