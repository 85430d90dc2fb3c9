"""How money and time read, everywhere: one format for pages, documents and exports.

Money (``Decimal`` amounts, a currency code):

- ``money``: amounts people add up (costs, spend, savings, invoice totals) with the
  currency's sign and thousands grouped. From a cent up, in cents: ``$1,234.56``, ``$0.01``;
  zero is ``$0.00``. A real amount under a cent shows the digits that say how much: two
  significant digits, at most six decimals (``$0.0043``, ``$0.00023``, ``$0.000001``), and
  ``< $0.000001`` below a millionth. It is never rounded to ``$0.00``, nor hidden as
  ``< $0.01``: a card, a chart's hover and a table read the same figure;
- ``unit_price``: a figure as configured or charged per request: prices, spend caps and
  budget limits, one request's cost. Exact to six decimals, at least two: ``$0.0006``,
  ``$0.000598``, ``$0.0002`` (a cap of 0.0002), ``$2.50``, ``$1,234.56``.

An invoice's lines and totals are charged in cents (``billing.invoicing``): ``money`` reads
them as they are; where a line under a cent was rounded, the table shows what was used too. A
column uses one of the two, never both. A currency without a sign reads ``12.34 CHF``.

Quantities (limits, token counts in prose): ``quantity`` reads ``60``, ``1,500``, ``100k``,
``1M``, ``2.5M`` (exact below 10,000; above, three significant digits at most).

Time: every time shown is UTC and says so once per page (the base template's footer);
``utc`` reads ``2026-11-26 23:54``, ``utc_date`` ``2026-11-26``, ``utc_month`` ``2026-11``.
"""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import ROUND_HALF_UP, Decimal

SIGNS = {"USD": "$", "EUR": "€", "GBP": "£", "JPY": "¥"}
CENT = Decimal("0.01")
_UNIT_PLACES = Decimal("0.000001")
MISSING = "—"


def _with_currency(number: str, currency: str, *, negative: bool) -> str:
    sign = SIGNS.get(currency.upper())
    text = f"{sign}{number}" if sign else f"{number} {currency.upper()}"
    return f"-{text}" if negative else text


def money(amount: Decimal | int | float | str | None, currency: str = "USD") -> str:
    """An amount people add up: ``$1,234.56``; under a cent, two significant digits
    (``$0.0043``), ``< $0.000001`` below a millionth."""
    if amount is None or amount == "":
        return MISSING
    value = Decimal(str(amount))
    if value != 0 and abs(value) < CENT:
        return _under_a_cent(value, currency)
    rounded = value.quantize(CENT, rounding=ROUND_HALF_UP)
    return _with_currency(f"{abs(rounded):,.2f}", currency, negative=rounded < 0)


def _under_a_cent(value: Decimal, currency: str) -> str:
    if abs(value) < _UNIT_PLACES:
        bound = _with_currency("0.000001", currency, negative=value < 0)
        return f"< {bound}" if value > 0 else f"> {bound}"
    # Two significant digits (0.0043: the first is at 10^-3, so four places), at most six.
    places = min(6, 1 - value.adjusted())
    rounded = value.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)
    if abs(rounded) >= CENT:  # 0.00996 rounds up to a cent
        return _with_currency("0.01", currency, negative=rounded < 0)
    return _with_currency(f"{abs(rounded):f}".rstrip("0"), currency, negative=rounded < 0)


def unit_price(amount: Decimal | int | float | str | None, currency: str = "USD") -> str:
    """A price, a cap or limit as configured, one request's cost: exact to six decimals."""
    if amount is None or amount == "":
        return MISSING
    value = Decimal(str(amount)).quantize(_UNIT_PLACES, rounding=ROUND_HALF_UP)
    whole, _, fraction = f"{abs(value):,f}".partition(".")
    fraction = fraction.rstrip("0").ljust(2, "0")
    return _with_currency(f"{whole}.{fraction}", currency, negative=value < 0)


def _utc(moment: datetime | date) -> datetime | date:
    if isinstance(moment, datetime):
        return moment.astimezone(UTC) if moment.tzinfo else moment.replace(tzinfo=UTC)
    return moment


def utc(moment: datetime | date | None, *, seconds: bool = False) -> str:
    """``2026-11-26 23:54`` (UTC; with ``seconds``, ``23:54:07``)."""
    if moment is None:
        return MISSING
    moment = _utc(moment)
    if not isinstance(moment, datetime):
        return moment.isoformat()
    return moment.strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")


def utc_date(moment: datetime | date | None) -> str:
    """``2026-11-26`` (the UTC day)."""
    return MISSING if moment is None else _utc(moment).strftime("%Y-%m-%d")


def utc_month(moment: datetime | date | None) -> str:
    """``2026-11`` (the UTC month)."""
    return MISSING if moment is None else _utc(moment).strftime("%Y-%m")


def quantity(number: int | float | None) -> str:
    """A count for people: ``60``, ``1,500``, ``100k``, ``1M``, ``2.5M``, ``1.25B``."""
    if number is None:
        return MISSING
    value = float(number)
    if abs(value) < 10_000:
        return f"{value:,.0f}" if value == int(value) else f"{value:,.2f}".rstrip("0").rstrip(".")
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            scaled = value / size
            digits = 0 if abs(scaled) >= 100 else 1 if abs(scaled) >= 10 else 2
            text = f"{scaled:.{digits}f}"
            return (text.rstrip("0").rstrip(".") if "." in text else text) + suffix
    return f"{value:,.0f}"  # unreachable


def counted(count: int, noun: str, plural: str = "") -> str:
    """A count with its noun, singular for one: ``1 replica``, ``3 replicas``, ``0 replicas``
    (``plural`` when adding an s is wrong: ``counted(2, "entry", "entries")``)."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"
