"""Invoice arithmetic and reads: which usage a month's invoice bills, its lines and totals,
and the invoice side of reconciliation.

The rounding rule (docs/architecture.md, "The money path"):

- a line is one model's tokens of one kind (input = prompt - cached, output, cached) at
  one price, for one month; batch jobs' usage (``UsageRecord.batch``) has lines of its own,
  at the price's ``batch_percent`` of each unit price; its amount = quantity * unit price per million / 10^6,
  computed exactly in Decimal and rounded **once, half up, to cents**;
- subtotal = the sum of the rounded usage and adjustment lines (no further rounding);
- credit = min(subtotal, the plan's ``included_credit``), shown as a ``credit`` line of
  -credit;
- tax = (subtotal - credit) * the organisation's tax rate, rounded half up to cents;
- total = subtotal - credit + tax.

A request's cost is never rounded (``billing.pricing``); only these lines are. Unpriced
usage (no price when it was admitted) is a line at 0, so it is still visible.

Which usage: each record belongs on its own month's invoice (the UTC month it was
admitted in). A month's invoice takes the organisation's records of that month that no
invoice holds yet (``usage`` lines), and the unbilled records of earlier months whose own
invoice is already finalized or paid: they arrived too late for it and become
``adjustment`` lines of their month (``usage_period``), so late usage is never lost. An
earlier month still open (no invoice yet, or a draft) keeps its records for its own
invoice, with its own plan credit: drafting November first takes nothing of October.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Context, Decimal, localcontext

from django.conf import settings
from django.db.models import Count, DateField, Exists, OuterRef, Q, QuerySet, Sum
from django.db.models.expressions import RawSQL
from django.db.models.functions import TruncMonth

from accounts.models import Organization, Plan
from billing.models import Invoice, InvoiceLine, Price, UsageRecord
from billing.pricing import batch_unit_price, charged_tokens_sql

CENT = Decimal("0.01")
ZERO = Decimal("0.00")
PER_MILLION_EXPONENT = -6
# Wide enough for any quantity (a 64-bit count) times any price (18 digits): the product
# is exact, so the only rounding is the one to cents.
_EXACT = Context(prec=80)
# Token kinds in the order their lines are listed, with the price field of each.
PER_THOUSAND_EXPONENT = -3
# Each line kind, the price field its unit price comes from, and the units that price is per.
TOKEN_KIND_PRICE_FIELDS = (
    (InvoiceLine.TokenKind.INPUT, "input_per_million", PER_MILLION_EXPONENT),
    (InvoiceLine.TokenKind.OUTPUT, "output_per_million", PER_MILLION_EXPONENT),
    (InvoiceLine.TokenKind.CACHED, "cached_input_per_million", PER_MILLION_EXPONENT),
    (InvoiceLine.TokenKind.INFERENCES, "per_thousand_inferences", PER_THOUSAND_EXPONENT),
    (InvoiceLine.TokenKind.CACHED_INFERENCES, "cached_per_thousand_inferences", PER_THOUSAND_EXPONENT),
)
BILLED_KINDS = (InvoiceLine.Kind.USAGE, InvoiceLine.Kind.ADJUSTMENT)


def round_cents(amount: Decimal) -> Decimal:
    """``amount`` rounded half up to cents (0.005 → 0.01, -0.005 → -0.01)."""
    with localcontext(_EXACT):
        return amount.quantize(CENT, rounding=ROUND_HALF_UP)


def exact_amount(*, quantity: int, unit_price: Decimal, exponent: int = PER_MILLION_EXPONENT) -> Decimal:
    """What a line's usage comes to before rounding: quantity * price per million / 10^6
    (per thousand / 10^3 for inferences: ``exponent``), exact."""
    with localcontext(_EXACT):
        return (Decimal(quantity) * unit_price).scaleb(exponent)


def line_amount(*, quantity: int, unit_price: Decimal, exponent: int = PER_MILLION_EXPONENT) -> Decimal:
    """A line's amount: ``exact_amount`` rounded once to cents."""
    with localcontext(_EXACT):
        exact = exact_amount(quantity=quantity, unit_price=unit_price, exponent=exponent)
        return exact.quantize(CENT, rounding=ROUND_HALF_UP)


def price_exponent(token_kind: str) -> int:
    """The power of ten a line's unit price is for: -6 (per million tokens) or -3 (per thousand inferences)."""
    return next((e for kind, _, e in TOKEN_KIND_PRICE_FIELDS if kind == token_kind), PER_MILLION_EXPONENT)


def price_per(token_kind: str) -> int:
    """How many units a line's unit price is for: a million tokens, or a thousand inferences."""
    return int(10 ** -price_exponent(token_kind))


# --- Months (UTC) ----------------------------------------------------------------------


def month_start(when: dt.date | dt.datetime) -> dt.date:
    """The first day of the UTC month of ``when`` (an aware datetime is taken in UTC)."""
    if isinstance(when, dt.datetime):
        if when.tzinfo is None:
            raise ValueError("a datetime must be aware")
        when = when.astimezone(dt.UTC).date()
    return when.replace(day=1)


def next_month(period: dt.date) -> dt.date:
    return dt.date(period.year + period.month // 12, period.month % 12 + 1, 1)


def previous_month(period: dt.date) -> dt.date:
    return dt.date(period.year - (period.month == 1), (period.month - 2) % 12 + 1, 1)


def month_bounds(period: dt.date) -> tuple[dt.datetime, dt.datetime]:
    """[start, end) of the UTC month that starts on ``period``."""
    start = dt.datetime(period.year, period.month, 1, tzinfo=dt.UTC)
    following = next_month(period)
    return start, dt.datetime(following.year, following.month, 1, tzinfo=dt.UTC)


def parse_period(text: str) -> dt.date:
    """'YYYY-MM' as the first day of that month (ValueError otherwise)."""
    try:
        parsed = dt.datetime.strptime(text.strip(), "%Y-%m")  # noqa: DTZ007 - a calendar month, not a moment
    except ValueError:
        raise ValueError(f"{text!r} is not a month: use YYYY-MM") from None
    return parsed.date()


def period_label(period: dt.date) -> str:
    return f"{period:%Y-%m}"


def display_number(invoice: Invoice) -> str:
    """How an invoice number is printed on documents and emails."""
    return f"INV-{invoice.number:06d}"


# --- Lines and totals -------------------------------------------------------------------


@dataclass(frozen=True)
class LineDraft:
    """One computed invoice line (saved as an InvoiceLine by ``billing.services``)."""

    kind: str
    model: str
    token_kind: str
    usage_period: dt.date | None
    price_id: int | None
    quantity: int
    unit_price: Decimal
    amount: Decimal
    description: str
    batch: bool = False

    def as_line(self, invoice: Invoice) -> InvoiceLine:
        return InvoiceLine(
            invoice=invoice,
            kind=self.kind,
            model=self.model,
            token_kind=self.token_kind,
            batch=self.batch,
            usage_period=self.usage_period,
            price_id=self.price_id,
            quantity=self.quantity,
            unit_price=self.unit_price,
            amount=self.amount,
            description=self.description,
        )


@dataclass(frozen=True)
class Totals:
    subtotal: Decimal
    credit: Decimal
    tax_rate: Decimal
    tax: Decimal
    total: Decimal


def _description(
    *, model: str, token_kind: str, period: dt.date, kind: str, price: Price | None, batch: bool = False
) -> str:
    # The unit price has its own column; lines of one model at two prices differ there.
    what = f"{model}, {'batch ' if batch else ''}{InvoiceLine.TokenKind(token_kind).label.lower()}"
    late = f", late usage of {period_label(period)}" if kind == InvoiceLine.Kind.ADJUSTMENT else ""
    unpriced = ", unpriced" if price is None else ""
    return f"{what}{late}{unpriced}"[:255]


_CHARGED = charged_tokens_sql(UsageRecord._meta.db_table)


def usage_lines(records: QuerySet[UsageRecord], *, period: dt.date) -> list[LineDraft]:
    """The usage and adjustment lines of ``records`` on the invoice of ``period``.

    One line per usage month, model, price and token kind with tokens in it, unit price
    from the record's price (the one in effect when it was admitted), rounded once.
    """
    groups = (
        records.annotate(month=TruncMonth("created_at", tzinfo=dt.UTC))
        .values("month", "model", "price_id", "batch")
        .annotate(
            # Tokens by the price each is charged at: billing.pricing's one rule.
            **{kind: Sum(RawSQL(sql, ())) for kind, sql in _CHARGED.items()},
        )
        .order_by()
    )
    rows = list(groups)
    prices = Price.objects.in_bulk({row["price_id"] for row in rows if row["price_id"] is not None})
    lines: list[LineDraft] = []
    for row in rows:
        usage_period = month_start(row["month"])
        kind = InvoiceLine.Kind.USAGE if usage_period == period else InvoiceLine.Kind.ADJUSTMENT
        price = prices.get(row["price_id"]) if row["price_id"] is not None else None
        quantities = {
            InvoiceLine.TokenKind.INPUT: row["input"],
            InvoiceLine.TokenKind.OUTPUT: row["output"],
            InvoiceLine.TokenKind.CACHED: row["cached"],
            InvoiceLine.TokenKind.INFERENCES: row["inferences"],
            InvoiceLine.TokenKind.CACHED_INFERENCES: row["cached_inferences"],
        }
        for token_kind, price_field, exponent in TOKEN_KIND_PRICE_FIELDS:
            quantity = int(quantities[token_kind] or 0)
            if quantity == 0:
                continue
            unit_price: Decimal = getattr(price, price_field) if price is not None else Decimal(0)
            if row["batch"] and price is not None:
                unit_price = batch_unit_price(unit_price, price.batch_percent)
            lines.append(
                LineDraft(
                    kind=kind,
                    model=row["model"],
                    token_kind=token_kind,
                    batch=row["batch"],
                    usage_period=usage_period,
                    price_id=price.pk if price is not None else None,
                    quantity=quantity,
                    unit_price=unit_price,
                    amount=line_amount(quantity=quantity, unit_price=unit_price, exponent=exponent),
                    description=_description(
                        model=row["model"],
                        token_kind=token_kind,
                        period=usage_period,
                        kind=kind,
                        price=price,
                        batch=row["batch"],
                    ),
                )
            )
    kind_order = {InvoiceLine.Kind.USAGE: 0, InvoiceLine.Kind.ADJUSTMENT: 1}
    token_order = {kind: i for i, (kind, _, _) in enumerate(TOKEN_KIND_PRICE_FIELDS)}
    effective = {pk: price.effective_from for pk, price in prices.items()}
    epoch = dt.datetime.min.replace(tzinfo=dt.UTC)
    lines.sort(
        key=lambda line: (
            kind_order[InvoiceLine.Kind(line.kind)],
            line.usage_period or period,
            line.model,
            effective.get(line.price_id, epoch) if line.price_id is not None else epoch,
            line.price_id or 0,
            line.batch,
            token_order[InvoiceLine.TokenKind(line.token_kind)],
        )
    )
    return lines


def included_credit(organization: Organization) -> Decimal:
    """The monthly credit of the organisation's plan (0 without a plan row)."""
    plan = Plan.objects.filter(tier=organization.tier).first()
    return plan.included_credit if plan is not None else ZERO


def totals(amounts: Iterable[Decimal], *, credit_available: Decimal, tax_rate: Decimal) -> Totals:
    """Subtotal, credit, tax and total from the rounded usage and adjustment line amounts."""
    subtotal = sum(amounts, ZERO)
    credit = min(subtotal, credit_available) if subtotal > 0 else ZERO
    tax = round_cents((subtotal - credit) * tax_rate)
    return Totals(subtotal=subtotal, credit=credit, tax_rate=tax_rate, tax=tax, total=subtotal - credit + tax)


def credit_line(*, credit: Decimal, plan_name: str) -> LineDraft:
    return LineDraft(
        kind=InvoiceLine.Kind.CREDIT,
        model="",
        token_kind="",
        usage_period=None,
        price_id=None,
        quantity=0,
        unit_price=Decimal(0),
        amount=-credit,
        description=f"Included credit ({plan_name})"[:255],
    )


@dataclass(frozen=True)
class InvoiceFigures:
    """An invoice's lines (usage and adjustments, then the credit line if any) and totals."""

    lines: list[LineDraft]
    totals: Totals


def invoice_figures(records: QuerySet[UsageRecord], *, organization: Organization, period: dt.date) -> InvoiceFigures:
    """The lines and totals of the invoice of ``period`` that bills ``records``: what drafting
    writes (``billing.services.invoices``) and what a preview shows, from one computation."""
    drafts = usage_lines(records, period=period)
    plan = Plan.objects.filter(tier=organization.tier).first()
    sums = totals(
        (line.amount for line in drafts),
        credit_available=plan.included_credit if plan is not None else ZERO,
        tax_rate=organization.tax_rate,
    )
    if sums.credit > 0 and plan is not None:
        drafts.append(credit_line(credit=sums.credit, plan_name=plan.name))
    return InvoiceFigures(lines=drafts, totals=sums)


# --- Reads ------------------------------------------------------------------------------


def invoices_of(*, organization: Organization) -> QuerySet[Invoice]:
    return Invoice.objects.filter(organization=organization).select_related("organization", "reissue_of", "reissued_as")


# An invoice in these states never changes: usage of its month that arrives later is an
# adjustment on a later invoice.
CLOSED_STATUSES = (Invoice.Status.FINALIZED, Invoice.Status.PAID)


def _billable_by(period: dt.date) -> QuerySet[UsageRecord]:
    """Unbilled records an invoice of ``period`` takes: its own month's, and earlier months'
    whose own invoice is closed (finalized or paid), as adjustments."""
    start, end = month_bounds(period)
    own_month_closed = Exists(
        Invoice.objects.filter(
            organization_id=OuterRef("organization_id"), period=OuterRef("usage_month"), status__in=CLOSED_STATUSES
        )
    )
    return (
        UsageRecord.objects.filter(invoice__isnull=True, created_at__lt=end)
        .annotate(usage_month=TruncMonth("created_at", tzinfo=dt.UTC, output_field=DateField()))
        .filter(Q(created_at__gte=start) | Q(own_month_closed))
    )


def uninvoiced_usage(*, organization_id: int, period: dt.date) -> QuerySet[UsageRecord]:
    """Records an invoice of ``period`` would take (see the module docstring)."""
    billable = _billable_by(period).filter(organization_id=organization_id)
    return UsageRecord.objects.filter(pk__in=billable.values("pk"))


@dataclass(frozen=True)
class InvoicePreview:
    """What an organisation's invoice of ``period`` would say if it were drafted now."""

    period: dt.date
    figures: InvoiceFigures
    draft: Invoice | None  # the month's draft that drafting would refresh, if there is one


def invoice_preview(*, organization: Organization, period: dt.date) -> InvoicePreview | None:
    """The lines and totals ``billing.services.invoice_draft`` would give the organisation's
    invoice of the UTC month of ``period`` now: the records a draft holds already and those it
    would take, through the same ``invoice_figures``. Reads only: no invoice is made or
    changed and no record is assigned. None when the month's invoice is finalized or paid
    (it never changes again)."""
    period = month_start(period)
    invoice = (
        Invoice.objects.filter(organization=organization, period=period).exclude(status=Invoice.Status.VOID).first()
    )
    if invoice is not None and invoice.status != Invoice.Status.DRAFT:
        return None
    taken = uninvoiced_usage(organization_id=organization.pk, period=period)
    records = (
        taken if invoice is None else UsageRecord.objects.filter(Q(pk__in=taken.values("pk")) | Q(invoice=invoice))
    )
    figures = invoice_figures(records, organization=organization, period=period)
    return InvoicePreview(period=period, figures=figures, draft=invoice)


def organizations_to_invoice(*, period: dt.date) -> QuerySet[Organization]:
    """Organisations with usage an invoice of ``period`` would bill, or a draft for it."""
    with_usage = _billable_by(period).values("organization_id")
    with_draft = Invoice.objects.filter(period=period, status=Invoice.Status.DRAFT).values("organization_id")
    return Organization.objects.filter(pk__in=with_usage.union(with_draft)).order_by("name")


# --- Reconciliation ---------------------------------------------------------------------


@dataclass
class InvoicedUsage:
    """The invoice side of a month's reconciliation.

    ``invoiced``: the usage and adjustment lines of the live (not void) invoices of the
    month, as stored. ``priced``: the same usage re-priced now, line by line with the same
    rounding, from the UsageRecord rows those invoices hold and each record's price. They
    are equal unless a line no longer matches its records. ``records_cost``: the exact
    (unrounded) sum of those records' stored costs, for a bound on rounding.
    """

    invoiced: Decimal = ZERO
    priced: Decimal = ZERO
    records: int = 0
    records_cost: Decimal = Decimal(0)
    invoices: int = 0
    # invoice number → (invoiced, priced), for each invoice whose two differ.
    mismatches: dict[int, tuple[Decimal, Decimal]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.invoiced == self.priced


def invoiced_usage(*, period: dt.date, organization: Organization | None = None) -> InvoicedUsage:
    """Invoiced usage of the month ``period`` against the same usage re-priced from its records,
    for one organisation or (None) all of them. Reads only."""
    live = Invoice.objects.filter(period=month_start(period)).exclude(status=Invoice.Status.VOID)
    if organization is not None:
        live = live.filter(organization=organization)
    result = InvoicedUsage()
    for invoice in live.order_by("number"):
        stored = InvoiceLine.objects.filter(invoice=invoice, kind__in=BILLED_KINDS).aggregate(s=Sum("amount"))["s"]
        held = UsageRecord.objects.filter(invoice=invoice)
        repriced = sum((line.amount for line in usage_lines(held, period=invoice.period)), ZERO)
        aggregate = held.aggregate(n=Count("pk"), cost=Sum("cost"))
        invoiced = stored if stored is not None else ZERO
        result.invoices += 1
        result.invoiced += invoiced
        result.priced += repriced
        result.records += int(aggregate["n"] or 0)
        result.records_cost += aggregate["cost"] or Decimal(0)
        if invoiced != repriced:
            result.mismatches[invoice.number] = (invoiced, repriced)
    return result


def misbilled_records(*, period: dt.date, limit: int = 500) -> list[dict[str, str]]:
    """Records on a live invoice of the month ``period`` that belong on another: from a later
    month, or from an earlier month whose own invoice is not closed (a record is an
    adjustment only when its month was already finalized). Reads only; at most ``limit``."""
    start, end = month_bounds(month_start(period))
    own_month_closed = Exists(
        Invoice.objects.filter(
            organization_id=OuterRef("organization_id"), period=OuterRef("usage_month"), status__in=CLOSED_STATUSES
        )
    )
    wrong = (
        UsageRecord.objects.filter(invoice__period=month_start(period))
        .exclude(invoice__status=Invoice.Status.VOID)
        .exclude(created_at__gte=start, created_at__lt=end)
        .annotate(usage_month=TruncMonth("created_at", tzinfo=dt.UTC, output_field=DateField()))
        .filter(Q(created_at__gte=end) | ~Q(own_month_closed))
        .order_by("created_at")
        .values("request_id", "created_at", "invoice__number", "organization_id")[:limit]
    )
    return [
        {
            "request_id": str(row["request_id"]),
            "created_at": row["created_at"].isoformat(),
            "invoice": str(row["invoice__number"]),
            "organization": str(row["organization_id"]),
        }
        for row in wrong
    ]


@dataclass(frozen=True)
class Payment:
    """Where an invoice stands for its payer: ``key`` for the badge's colour, ``text`` to read,
    ``due`` (the day it is due, once finalized)."""

    key: str  # draft | due | overdue | paid | void
    text: str
    due: dt.date | None


def due_date(invoice: Invoice) -> dt.date | None:
    """The day a finalized (or paid) invoice is due: INVOICE_DUE_DAYS after it was finalized."""
    if invoice.finalized_at is None:
        return None
    return invoice.finalized_at.astimezone(dt.UTC).date() + dt.timedelta(days=settings.INVOICE_DUE_DAYS)


def payment(invoice: Invoice, *, today: dt.date) -> Payment:
    """Draft (not sent yet), due on a day, overdue since it, paid, or void."""
    due = due_date(invoice)
    if invoice.status == invoice.Status.VOID:
        return Payment("void", "Void", due)
    if invoice.status == invoice.Status.PAID:
        paid = invoice.paid_at.astimezone(dt.UTC).date().isoformat() if invoice.paid_at else ""
        return Payment("paid", f"Paid {paid}".strip(), due)
    if invoice.status == invoice.Status.DRAFT or due is None:
        return Payment("draft", "Draft, not sent yet", None)
    if today > due:
        return Payment("overdue", f"Overdue since {due.isoformat()}", due)
    return Payment("due", f"Due {due.isoformat()}", due)


def month_ended(period: dt.date, *, now: dt.datetime) -> bool:
    """Whether the UTC month of ``period`` is over (only then may its invoice be finalized)."""
    return now >= month_bounds(period)[1]
