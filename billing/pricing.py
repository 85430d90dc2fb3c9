"""What a request costs: prices per million tokens, exact costs, and the limiter's micro-units.

Money is Decimal end to end. A request's cost is exact: tokens * price per million /
10^6 (12 decimal places at most; nothing is rounded per request). Invoices round once per
line (``billing.invoicing``). The limiter counts spend in integer micro-units (exact in
Redis's Lua doubles): a request's cost there is rounded *up* to the micro-unit, so a spend
cap can only be reached a little early, never overshot by rounding.

What a request is charged for is one rule, written here once (``ChargedTokens.of``) and
stated here in SQL for the rollups and invoices (``CHARGED_TOKENS_SQL``): input tokens are
the prompt tokens not served from an engine's prefix cache, priced at the input price;
those served from it at the cached input price; a request answered from the semantic cache
is charged whole (prompt and answer) at the cached input price. A small model's request is
charged by its inferences (the items it carried) at the price per thousand inferences, or
at the cached price per thousand when the exact result cache answered it. ``PriceQuote`` answers
every cost question the gateway asks (reservation, charge, savings).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from decimal import ROUND_CEILING, Decimal

from billing.models import CacheOutcome, Price

MICRO = Decimal("0.000001")
SPEND_MICRO = 1_000_000
PER_MILLION = Decimal(1_000_000)
PER_THOUSAND = Decimal(1_000)


@dataclass(frozen=True)
class ChargedTokens:
    """A request's tokens (and inferences) by the price each is charged at."""

    input: int
    output: int
    cached: int
    inferences: int = 0
    cached_inferences: int = 0

    @classmethod
    def of(cls, *, prompt: int, completion: int, cached: int, cache_hit: bool, inferences: int = 0) -> ChargedTokens:
        """The rule. ``cached``: the prompt tokens an engine served from its prefix cache (a
        semantic-cache hit reports its whole prompt so); never more than the prompt.
        ``inferences``: a predict request's items, all at the cached price on a cache hit."""
        if cache_hit:
            return cls(input=0, output=0, cached=prompt + completion, cached_inferences=inferences)
        from_cache = min(prompt, max(0, cached))
        return cls(input=prompt - from_cache, output=completion, cached=from_cache, inferences=inferences)


def charged_tokens_sql(records: str) -> dict[str, str]:
    """The rule over usage records (``records``: their table or alias), as SQL for queries
    that sum it: the hourly rollups and the invoices' lines. A test holds it to
    ``ChargedTokens.of`` on every kind of record."""
    hit = f"{records}.cache <> '{CacheOutcome.MISS.value}'"
    prompt, completion = f"{records}.prompt_tokens", f"{records}.completion_tokens"
    from_cache = f"least(greatest({records}.cached_tokens, 0), {prompt})"
    return {
        "input": f"CASE WHEN {hit} THEN 0 ELSE {prompt} - {from_cache} END",
        "output": f"CASE WHEN {hit} THEN 0 ELSE {completion} END",
        "cached": f"CASE WHEN {hit} THEN {prompt} + {completion} ELSE {from_cache} END",
        "inferences": f"CASE WHEN {hit} THEN 0 ELSE {records}.inferences END",
        "cached_inferences": f"CASE WHEN {hit} THEN {records}.inferences ELSE 0 END",
    }


def saved_sql(records: str, prices: str) -> str:
    """``PriceQuote.saved`` over usage records joined to their prices (aliases): what a
    cache hit saved; 0 for a request an engine answered."""
    return (
        f"CASE WHEN {records}.cache <> '{CacheOutcome.MISS.value}' THEN ({records}.prompt_tokens * "
        f"{prices}.input_per_million + {records}.completion_tokens * {prices}.output_per_million) / 1000000"
        f" + {records}.inferences * {prices}.per_thousand_inferences / 1000"
        f" - {records}.cost ELSE 0 END"
    )


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
    per_thousand_inferences: Decimal = Decimal(0)
    cached_per_thousand_inferences: Decimal = Decimal(0)
    batch_percent: Decimal = Decimal(100)

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
            per_thousand_inferences=price.per_thousand_inferences,
            cached_per_thousand_inferences=price.cached_per_thousand_inferences,
            batch_percent=price.batch_percent,
        )

    def for_batch(self) -> PriceQuote:
        """The same price as a batch job's line pays it: each unit price at ``batch_percent``
        (``batch_unit_price``, as its invoice line has it)."""
        pct = self.batch_percent
        return replace(
            self,
            input_per_million=batch_unit_price(self.input_per_million, pct),
            output_per_million=batch_unit_price(self.output_per_million, pct),
            cached_input_per_million=batch_unit_price(self.cached_input_per_million, pct),
            per_thousand_inferences=batch_unit_price(self.per_thousand_inferences, pct),
            cached_per_thousand_inferences=batch_unit_price(self.cached_per_thousand_inferences, pct),
        )

    def in_effect(self, when: float) -> bool:
        return self.effective_from <= when and (self.effective_to is None or when < self.effective_to)

    def reservation(self, *, prompt_tokens: int, output_tokens: int, inferences: int = 0) -> Decimal:
        """The most a request may cost before it runs: every prompt token at the input price
        (an engine's prefix cache can only lower it), its output bound, and its inferences."""
        return self.cost(input_tokens=prompt_tokens, output_tokens=output_tokens, inferences=inferences)

    def charge(self, *, prompt: int, completion: int, cached: int, cache_hit: bool, inferences: int = 0) -> Decimal:
        """What a request is charged (``ChargedTokens.of``, the one rule)."""
        tokens = ChargedTokens.of(
            prompt=prompt, completion=completion, cached=cached, cache_hit=cache_hit, inferences=inferences
        )
        return self.cost(
            input_tokens=tokens.input,
            output_tokens=tokens.output,
            cached_tokens=tokens.cached,
            inferences=tokens.inferences,
            cached_inferences=tokens.cached_inferences,
        )

    def saved(self, *, prompt: int, completion: int, charged: Decimal, inferences: int = 0) -> Decimal:
        """What a cache hit saved: its tokens (or inferences) as an engine's answer, less its charge."""
        return self.cost(input_tokens=prompt, output_tokens=completion, inferences=inferences) - charged

    def cost(
        self,
        *,
        input_tokens: int,
        output_tokens: int,
        cached_tokens: int = 0,
        inferences: int = 0,
        cached_inferences: int = 0,
    ) -> Decimal:
        return (
            request_cost(
                input_per_million=self.input_per_million,
                output_per_million=self.output_per_million,
                cached_input_per_million=self.cached_input_per_million,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                cached_tokens=cached_tokens,
            )
            + (inferences * self.per_thousand_inferences + cached_inferences * self.cached_per_thousand_inferences)
            / PER_THOUSAND
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


def batch_unit_price(unit_price: Decimal, percent: Decimal) -> Decimal:
    """A unit price as batch jobs pay it: ``percent`` of it, exact (no rounding)."""
    return unit_price * percent / 100


def micros_up(amount: Decimal) -> int:
    """A cost in the limiter's integer micro-units, rounded up."""
    return int((amount / MICRO).to_integral_value(rounding=ROUND_CEILING))


def to_micros(amount: Decimal | None) -> int:
    """A money amount (or None for "no cap") as micro-units (0 for none); caps have 6 decimals."""
    return int(amount * SPEND_MICRO) if amount is not None else 0


def from_micros(micros: Decimal | int) -> Decimal:
    return Decimal(micros) / SPEND_MICRO
