"""The portal's usage page, as data: an organisation's daily rollups summed into totals, rows per
model or per key, plotly figures, its budget status for the month, and the month's invoice so far.

Usage is read through ``billing.usage_selectors`` (daily rollups, never raw usage records),
so the page shows what ``GET /api/orgs/{id}/usage/`` reports for the same days. The invoice
preview is the exception: an invoice bills usage records, each at its own price, so the
preview is what ``billing.invoicing`` computes from them when it drafts one.
"""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import plotly.graph_objects as go
from django.conf import settings

from accounts.models import ApiKey, Organization
from billing import invoicing
from billing.ledger import ALERT_THRESHOLDS
from billing.models import BudgetAlert, Invoice
from billing.selectors import budget_alerts_of
from billing.usage_selectors import DailyUsage, UsageCursor, usage_daily_for_organization
from console.pages import charts
from console.pages.invoice_lines import LineRow, billed_rows, used_before_rounding
from core import formats

# Rows read per selector call; a 90-day window of a few models is one or two pages.
_PAGE = 500


def money_text(amount: Decimal) -> str:
    """An amount in the platform's currency, the house format (core.formats.money)."""
    return formats.money(amount, str(settings.BILLING_CURRENCY))


def limit_text(amount: Decimal) -> str:
    """A spend cap in the platform's currency, exactly as configured (core.formats.unit_price)."""
    return formats.unit_price(amount, str(settings.BILLING_CURRENCY))


@dataclass
class UsageTotals:
    requests: int = 0
    errors: int = 0  # not a client's cancel (billing.outcomes)
    cancelled: int = 0  # of ``requests``: cancelled by their clients, not errors
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    inferences: int = 0
    cost: Decimal = field(default_factory=lambda: Decimal(0))

    @property
    def cost_text(self) -> str:
        return money_text(self.cost)

    @property
    def tokens(self) -> int:
        """Every token the requests used: input, cached input and output."""
        return self.input_tokens + self.cached_tokens + self.output_tokens

    def add(self, row: DailyUsage) -> None:
        self.requests += row.requests
        self.errors += row.errors
        self.cancelled += row.cancelled
        self.input_tokens += row.input_tokens
        self.output_tokens += row.output_tokens
        self.cached_tokens += row.cached_tokens
        self.inferences += row.inferences
        self.cost += row.cost


def daily_usage(*, organization_id: int, start: date, end: date, api_key_id: int | None = None,
                by_key: bool = False) -> list[DailyUsage]:  # fmt: skip
    """Every (day, model) row of the window (with ``by_key``, every (day, model, key) row),
    both days inclusive, oldest first."""
    rows: list[DailyUsage] = []
    after: UsageCursor | None = None
    while True:
        page = usage_daily_for_organization(
            organization_id=organization_id,
            start=start,
            end=end,
            api_key_id=api_key_id,
            by_key=by_key,
            limit=_PAGE,
            after=after,
        )
        rows.extend(page.rows)
        after = page.next_page
        if after is None:
            return rows


def totals_of(rows: Iterable[DailyUsage]) -> UsageTotals:
    totals = UsageTotals()
    for row in rows:
        totals.add(row)
    return totals


def by_model(rows: Iterable[DailyUsage]) -> dict[str, UsageTotals]:
    """Totals per model, models in name order."""
    models: dict[str, UsageTotals] = defaultdict(UsageTotals)
    for row in rows:
        models[row.model].add(row)
    return dict(sorted(models.items()))


@dataclass(frozen=True)
class KeyUsage:
    """One API key's totals over the window, the key shown as people see it (``sk-…abcd``)."""

    api_key_id: int
    name: str
    masked: str
    active: bool
    totals: UsageTotals

    @property
    def label(self) -> str:
        return f"{self.name} ({self.masked})"


def _rollup_key(row: DailyUsage) -> str:
    """A key known only by its rollup row (no longer among the organisation's): its prefix, masked."""
    return f"{row.api_key_prefix}…" if row.api_key_prefix else ""


def by_key(rows: Iterable[DailyUsage], keys: Mapping[int, ApiKey]) -> list[KeyUsage]:
    """Totals per key (``rows`` read with ``by_key``), keys in name order; ``keys``: the
    organisation's keys by id, for their masked form."""
    sums: dict[int, UsageTotals] = defaultdict(UsageTotals)
    seen: dict[int, DailyUsage] = {}
    for row in rows:
        key_id = row.api_key_id or 0
        sums[key_id].add(row)
        seen.setdefault(key_id, row)
    found = []
    for key_id, totals in sums.items():
        api_key = keys.get(key_id)
        if api_key is not None:
            found.append(KeyUsage(key_id, api_key.name, api_key.masked, api_key.is_active, totals))
        else:  # not one of the organisation's keys as listed: the rollup's own name and prefix
            row = seen[key_id]
            found.append(KeyUsage(key_id, row.api_key_name, _rollup_key(row), False, totals))
    return sorted(found, key=lambda k: (k.name.lower(), k.masked, k.api_key_id))


def _days(start: date, end: date) -> list[date]:
    return [start + timedelta(days=n) for n in range((end - start).days + 1)]


def _layout(title: str, y_title: str, **more: Any) -> dict[str, Any]:
    """The house layout (``charts.layout``) with a title, stacked bars and a legend that names
    the model even when there is one."""
    return charts.layout(
        height=320, legend=True, title={"text": title, "font": {"size": 15}}, barmode="stack",
        margin={"l": 56, "r": 16, "t": 44, "b": 40}, yaxis=charts.axis(title={"text": y_title}, rangemode="tozero"),
        **more,
    )  # fmt: skip


# The cost axis's labels by the step between ticks, as ``core.formats.money`` reads amounts:
# steps under a cent by their significant digits ($0.0005, $0.004), cents from a cent ($0.05,
# $1.50), whole amounts from a unit ($20, $1,000). Steps are 1, 2 or 5 times a power of ten.
COST_TICK_FORMATS = [
    {"dtickrange": [None, 0.009], "value": ",~r"},
    {"dtickrange": [0.009, 0.9], "value": ",.2f"},
    {"dtickrange": [0.9, None], "value": ",.0f"},
]


def figures(
    rows: list[DailyUsage], *, start: date, end: date, currency: str, keys: Mapping[int, str] | None = None
) -> dict[str, dict[str, Any]]:
    """Cost and requests per day (a stacked bar per model) and tokens per model, as plotly
    figure dicts for ``Plotly.newPlot``; with ``keys`` (key id → its label, ``rows`` read
    with ``by_key``), a bar per key instead. Every day of the window is on the axis, used or not.

    Chart values are floats (plotly.js draws numbers); the totals on the page stay Decimal.
    """
    days = _days(start, end)
    # Half a day either side: a day's bar is centred on its midnight, so the first and the last
    # (today's) are drawn whole. Dates would drop the hours: datetimes.
    first, last = (datetime.combine(d, time.min) for d in (start, end))
    day_axis = charts.axis(
        type="date", range=[(first - timedelta(hours=12)).isoformat(), (last + timedelta(hours=12)).isoformat()]
    )

    def series_of(row: DailyUsage) -> str:
        if keys is None:
            return row.model
        return keys.get(row.api_key_id or 0) or f"{row.api_key_name} ({_rollup_key(row)})"

    cost: dict[str, dict[date, Decimal]] = defaultdict(dict)
    requests: dict[str, dict[date, int]] = defaultdict(dict)
    tokens: dict[str, UsageTotals] = defaultdict(UsageTotals)
    for row in rows:
        name = series_of(row)
        cost[name][row.date] = cost[name].get(row.date, Decimal(0)) + row.cost
        requests[name][row.date] = requests[name].get(row.date, 0) + row.requests
        tokens[name].add(row)
    names = sorted(cost)
    # Models drawn together never share a colour (charts.model_colours); keys take the palette
    # in turn, so no two of a few keys share one.
    colours = (
        charts.model_colours(names)
        if keys is None
        else {name: charts.PALETTE[i % len(charts.PALETTE)] for i, name in enumerate(names)}
    )
    by = "model" if keys is None else "key"
    cost_figure = go.Figure(
        [
            go.Bar(
                name=n,
                x=[str(d) for d in days],
                y=[float(cost[n].get(d, 0)) for d in days],
                # The hover reads the day's cost as the page's cards and tables do (core.formats.money).
                customdata=[formats.money(cost[n].get(d, Decimal(0)), currency) for d in days],
                hovertemplate="%{x}: %{customdata}<extra>%{fullData.name}</extra>",
                marker_color=colours[n],
            )
            for n in names
        ],
        layout=_layout("Cost per day", currency, xaxis=day_axis),
    )
    # Money on the axis as money: the currency's sign, decimals (plotly would write 500µ).
    sign = formats.SIGNS.get(currency.upper(), "")
    cost_figure.update_yaxes(tickprefix=sign, ticksuffix="" if sign else f" {currency}", exponentformat="none",
                             tickformatstops=COST_TICK_FORMATS)  # fmt: skip
    requests_figure = go.Figure(
        [
            go.Bar(name=n, x=[str(d) for d in days], y=[requests[n].get(d, 0) for d in days], marker_color=colours[n])
            for n in names
        ],
        layout=_layout("Requests per day", "requests", xaxis=day_axis),
    )
    per = [tokens[n] for n in names]
    drawn = [("cost", cost_figure), ("requests", requests_figure)]
    # Tokens for token models; inferences for small models (a classifier-only organisation has
    # no token axis to show): each chart only when there is something on it.
    if any(t.tokens for t in per) or not any(t.inferences for t in per):
        drawn.append(("tokens", go.Figure(
            [
                go.Bar(name="Input", x=names, y=[t.input_tokens for t in per]),
                go.Bar(name="Cached input", x=names, y=[t.cached_tokens for t in per]),
                go.Bar(name="Output", x=names, y=[t.output_tokens for t in per]),
            ],
            layout=_layout(f"Tokens per {by}", "tokens", xaxis=charts.axis(type="category")),
        )))  # fmt: skip
    if any(t.inferences for t in per):
        drawn.append(("inferences", go.Figure(
            [go.Bar(name="Inferences", x=names, y=[t.inferences for t in per],
                    marker_color=[colours[n] for n in names])],
            layout=_layout(f"Inferences per {by}", "inferences", xaxis=charts.axis(type="category")),
        )))  # fmt: skip
    return {name: json.loads(figure.to_json()) for name, figure in drawn}


@dataclass(frozen=True)
class BudgetLine:
    """One monthly budget of the organisation: its limit, what is used, the share used."""

    label: str
    limit: Decimal | int | None
    used: Decimal | int
    unit: str

    @property
    def used_text(self) -> str:
        return money_text(Decimal(self.used)) if self.unit == "currency" else f"{self.used:,}"

    @property
    def limit_text(self) -> str:
        if self.limit is None:
            return ""
        return limit_text(Decimal(self.limit)) if self.unit == "currency" else f"{self.limit:,}"

    @property
    def percent(self) -> int | None:
        if not self.limit:
            return None
        return min(999, int(Decimal(self.used) * 100 / Decimal(self.limit)))


@dataclass(frozen=True)
class BudgetStatus:
    month: str  # YYYY-MM, UTC
    lines: list[BudgetLine]
    alert_percent: int
    alerts: list[BudgetAlert]
    spent: Decimal

    @property
    def alert_thresholds_text(self) -> str:
        """Where alerts are raised, each share once: "50, 80 and 100 %" (the organisation's own
        threshold among the fixed ones, as the limiter raises them: billing.ledger)."""
        shares = [str(share) for share in sorted({*ALERT_THRESHOLDS, self.alert_percent})]
        return f"{', '.join(shares[:-1])} and {shares[-1]} %"


def budget_status(*, organization: Organization, today: date) -> BudgetStatus:
    """The organisation's spend cap and token quota for the UTC month of ``today``, with
    what the daily rollups hold for the month so far and the alerts crossed.

    The limiter also counts requests in flight and the last minute not rolled up yet, so it
    may be a little ahead of these figures; they agree with the usage API's."""
    first = invoicing.month_start(today)
    month = totals_of(daily_usage(organization_id=organization.pk, start=first, end=today))
    label = invoicing.period_label(first)
    return BudgetStatus(
        month=label,
        lines=[
            BudgetLine("Spend", organization.monthly_spend_cap, month.cost, "currency"),
            BudgetLine("Tokens", organization.monthly_token_quota, month.tokens, "tokens"),
        ],
        alert_percent=organization.budget_alert_percent,
        alerts=list(budget_alerts_of(organization_id=organization.pk, month=label)[:50]),
        spent=month.cost,
    )


CSV_COLUMNS = ("date", "model", "api_key", "api_key_name", "requests", "errors", "cancelled", "input_tokens",
               "output_tokens", "cached_tokens", "cost", "currency")  # fmt: skip


def usage_csv(rows: Iterable[DailyUsage], *, currency: str, keys: Mapping[int, ApiKey] | None = None) -> str:
    """The window's rows per UTC day, model and key, as CSV (exact costs, unrounded); a key
    of ``keys`` (by id) as people see it, ``sk-…abcd``."""
    keys = keys or {}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        known = keys.get(row.api_key_id or 0)
        key = known.masked if known is not None else _rollup_key(row)
        counts = (row.requests, row.errors, row.cancelled, row.input_tokens, row.output_tokens, row.cached_tokens)
        writer.writerow(
            [row.date.isoformat(), row.model, key, row.api_key_name, *counts, f"{row.cost.normalize():f}", currency]
        )
    return out.getvalue()


# --- This month so far: the invoice as it would be drafted now ----------------------------


@dataclass(frozen=True)
class MonthPreview:
    """The organisation's invoice of this UTC month if it were drafted now."""

    period: date
    as_of: datetime
    lines: list[LineRow]  # usage and adjustments; the plan's credit is ``credit_label`` and the totals'
    credit_label: str
    totals: invoicing.Totals
    currency: str
    draft: str  # the number of the month's draft, if one is already open

    @property
    def unpriced(self) -> int:
        return sum(1 for line in self.lines if not line.priced)

    @property
    def used(self) -> Decimal:
        """The priced usage before each line is rounded to cents (what budgets and usage count)."""
        return used_before_rounding(self.lines)

    @property
    def tax_percent(self) -> str:
        # The invoice's own reading of a rate (0.0750 → "7.5"); the Invoice is never saved.
        return Invoice(tax_rate=self.totals.tax_rate).tax_percent


def month_preview(*, organization: Organization, now: datetime) -> MonthPreview | None:
    """What the invoice of ``now``'s UTC month would say if drafted now, line for line
    (``billing.invoicing.invoice_preview``: the drafting's own computation, read only).
    None once the month's invoice is finalized."""
    preview = invoicing.invoice_preview(organization=organization, period=invoicing.month_start(now))
    if preview is None:
        return None
    rows, credit = billed_rows(preview.figures.lines)
    return MonthPreview(
        period=preview.period,
        as_of=now,
        lines=rows,
        credit_label=credit,
        totals=preview.figures.totals,
        currency=str(settings.BILLING_CURRENCY),
        draft=invoicing.display_number(preview.draft) if preview.draft is not None else "",
    )
