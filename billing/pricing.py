"""What a request costs: prices per million tokens, exact costs, and the limiter's micro-units.

Money is Decimal end to end. A request's cost is exact: tokens * price per million /
10^6 (12 decimal places at most; nothing is rounded per request). Invoices round once per
line (``billing.invoicing``). The limiter counts spend in integer micro-units (exact in
Redis's Lua doubles): a request's cost there is rounded *up* to the micro-unit, so a spend
cap can only be reached a little early, never overshot by rounding.

Input tokens are the prompt tokens not served from a cache; cached ones are priced apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal

from billing.models import Price

MICRO = Decimal("0.000001")
SPEND_MICRO = 1_000_000
PER_MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class PriceQuote:
    """A price as the gateway holds it (from the routing snapshot), effective [start, end)."""

    price_id: int
    version_id: int | None  # None: the model's price, for versions without one of their own
    input_per_million: Decimal
    output_per_million: Decimal
    cached_input_per_million: Decimal
    currency: str
    effective_from: float  # unix time
    effective_to: float | None

    @classmethod
    def of(cls, price: Price) -> PriceQuote:
        return cls(
            price_id=price.pk,
            version_id=price.version_id,
            input_per_million=price.input_per_million,
            output_per_million=price.output_per_million,
            cached_input_per_million=price.cached_input_per_million,
            currency=price.currency,
            effective_from=price.effective_from.timestamp(),
            effective_to=price.effective_to.timestamp() if price.effective_to else None,
        )

    def in_effect(self, when: float) -> bool:
        return self.effective_from <= when and (self.effective_to is None or when < self.effective_to)

    def cost(self, *, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> Decimal:
        return request_cost(
            input_per_million=self.input_per_million,
            output_per_million=self.output_per_million,
            cached_input_per_million=self.cached_input_per_million,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cached_tokens=cached_tokens,
        )


def price_in_effect(quotes: tuple[PriceQuote, ...], *, version_id: int, when: float) -> PriceQuote | None:
    """The version's own price in effect at ``when``, else the model's, else None (unpriced)."""
    own = next((q for q in quotes if q.version_id == version_id and q.in_effect(when)), None)
    return own or next((q for q in quotes if q.version_id is None and q.in_effect(when)), None)


def request_cost(
    *,
    input_per_million: Decimal,
    output_per_million: Decimal,
    cached_input_per_million: Decimal,
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int = 0,
) -> Decimal:
    """The exact cost of some tokens at a price (no rounding)."""
    total = (
        input_tokens * input_per_million + output_tokens * output_per_million + cached_tokens * cached_input_per_million
    )
    return total / PER_MILLION


def micros_up(amount: Decimal) -> int:
    """A cost in the limiter's integer micro-units, rounded up."""
    return int((amount / MICRO).to_integral_value(rounding=ROUND_CEILING))


def to_micros(amount: Decimal | None) -> int:
    """A money amount (or None for "no cap") as micro-units (0 for none); caps have 6 decimals."""
    return int(amount * SPEND_MICRO) if amount is not None else 0


def from_micros(micros: Decimal | int) -> Decimal:
    return Decimal(micros) / SPEND_MICRO
