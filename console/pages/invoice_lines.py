"""An invoice's lines as people read them, one way for an invoice (console and portal) and
for the portal's month-to-date preview: what is counted (tokens or inferences), what the unit
price is for ("1M tokens", "1k inferences"), usage with no price said so, never $0.00, and
what a line under a cent was rounded from, so it reads as the usage pages' figure does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from typing import Any, Protocol

from billing import invoicing
from billing.models import Invoice, InvoiceLine


class Line(Protocol):
    """What a saved ``InvoiceLine`` and a computed ``invoicing.LineDraft`` both have."""

    @property
    def kind(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def token_kind(self) -> str: ...
    @property
    def batch(self) -> bool: ...
    @property
    def usage_period(self) -> date | None: ...
    @property
    def price_id(self) -> int | None: ...
    @property
    def quantity(self) -> int: ...
    @property
    def unit_price(self) -> Decimal: ...
    @property
    def amount(self) -> Decimal: ...
    @property
    def description(self) -> str: ...


@dataclass(frozen=True)
class LineRow:
    """One billed line (usage or late usage; the plan's credit is shown with the totals)."""

    model: str
    item: str  # "Input tokens", "Batch output tokens"…
    note: str  # "late usage of 2026-10" for an adjustment
    quantity: int
    unit: str  # what the quantity counts: tokens or inferences
    per: str  # what the unit price is for: "1M tokens", "1k inferences"
    unit_price: Decimal | None  # None where no price was in effect
    amount: Decimal  # charged, in cents
    priced: bool
    exact: Decimal = Decimal(0)  # what the usage came to before rounding to cents

    @property
    def rounded_from(self) -> Decimal | None:
        """The exact amount where rounding to cents changed how it reads (a line under a cent:
        $0.0043 charged as $0.00); None where the cents say it."""
        if self.priced and self.exact != self.amount and abs(self.exact) < invoicing.CENT:
            return self.exact
        return None


def used_before_rounding(rows: Sequence[LineRow]) -> Decimal:
    """What the priced lines' usage comes to before each is rounded to cents."""
    return sum((row.exact for row in rows if row.priced), Decimal(0))


def line_row(line: Line) -> LineRow:
    token_kind = InvoiceLine.TokenKind(line.token_kind)
    item = f"{'Batch ' if line.batch else ''}{token_kind.label.lower()}"
    per = invoicing.price_per(line.token_kind)
    unit = "inferences" if per == 1000 else "tokens"
    period = line.usage_period
    note = (
        f"late usage of {invoicing.period_label(period)}" if line.kind == InvoiceLine.Kind.ADJUSTMENT and period else ""
    )
    priced = line.price_id is not None
    return LineRow(
        model=line.model,
        item=item[:1].upper() + item[1:],
        note=note,
        quantity=line.quantity,
        unit=unit,
        per=f"1M {unit}" if per == 1_000_000 else f"1k {unit}",
        unit_price=line.unit_price if priced else None,
        amount=line.amount,
        priced=priced,
        exact=invoicing.exact_amount(
            quantity=line.quantity, unit_price=line.unit_price, exponent=invoicing.price_exponent(line.token_kind)
        ),
    )


def billed_rows(lines: Sequence[Line]) -> tuple[list[LineRow], str]:
    """The usage lines as rows, and the credit line's description (shown with the totals)."""
    rows = [line_row(line) for line in lines if line.kind != InvoiceLine.Kind.CREDIT]
    credit = next((line.description for line in lines if line.kind == InvoiceLine.Kind.CREDIT), "")
    return rows, credit or "Included credit"


def invoice_lines_context(invoice: Invoice) -> dict[str, Any]:
    """What ``console/_invoice_lines.html`` shows of a saved invoice (console and portal)."""
    rows, credit_label = billed_rows(list(invoice.lines.order_by("id")))
    return {"rows": rows, "credit_label": credit_label, "used": used_before_rounding(rows)}
