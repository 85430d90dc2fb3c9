"""An invoice as documents: a PDF (fpdf2, text extractable) and a CSV whose sums equal the invoice.

Both are rendered from the stored invoice and its lines, never recomputed, so they show
exactly what was finalized. The PDF uses the PDF core font (Helvetica, Latin-1): text
outside Latin-1 (an organisation's name in another script) is printed transliterated, with
accents dropped where that is all that differs and ``?`` otherwise.
"""

from __future__ import annotations

import csv
import io
import unicodedata
from decimal import Decimal

from fpdf import FPDF
from fpdf.enums import Align, XPos, YPos

from billing import invoicing
from billing.models import Invoice, InvoiceLine

CSV_COLUMNS = (
    "invoice",
    "period",
    "kind",
    "usage_period",
    "model",
    "token_kind",
    "quantity",
    "unit_price",
    "price_per",  # units the unit price is for: 1000000 (tokens) or 1000 (inferences)
    "amount",
    "currency",
    "description",
)
# Rows after the lines, in this order; their amounts are the invoice's own.
CSV_TOTAL_KINDS = ("subtotal", "included_credit", "tax", "total")


def invoice_filename(invoice: Invoice, extension: str) -> str:
    return f"{invoicing.display_number(invoice)}-{invoicing.period_label(invoice.period)}.{extension}"


def _lines(invoice: Invoice) -> list[InvoiceLine]:
    return list(invoice.lines.order_by("id"))


# --- CSV --------------------------------------------------------------------------------


def invoice_csv(invoice: Invoice) -> str:
    """One row per line, then subtotal, credit, tax and total rows (their amounts in the
    ``amount`` column): the line amounts add up to the invoice, credit line included."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    number, period = invoicing.display_number(invoice), invoicing.period_label(invoice.period)
    for line in _lines(invoice):
        writer.writerow(
            [
                number,
                period,
                line.kind,
                invoicing.period_label(line.usage_period) if line.usage_period else "",
                line.model,
                line.token_kind,
                line.quantity if line.kind != InvoiceLine.Kind.CREDIT else "",
                f"{line.unit_price:f}" if line.kind != InvoiceLine.Kind.CREDIT else "",
                invoicing.price_per(line.token_kind) if line.kind != InvoiceLine.Kind.CREDIT else "",
                f"{line.amount:f}",
                invoice.currency,
                line.description,
            ]
        )
    totals = {
        "subtotal": invoice.subtotal,
        "included_credit": -invoice.credit,
        "tax": invoice.tax,
        "total": invoice.total,
    }
    for kind in CSV_TOTAL_KINDS:
        description = f"tax at {invoice.tax_rate * 100:.2f} %" if kind == "tax" else kind.replace("_", " ")
        row = dict.fromkeys(CSV_COLUMNS, "") | {
            "invoice": number, "period": period, "kind": kind, "amount": f"{totals[kind]:f}",
            "currency": invoice.currency, "description": description,
        }  # fmt: skip
        writer.writerow([row[column] for column in CSV_COLUMNS])
    return out.getvalue()


# --- PDF --------------------------------------------------------------------------------


def _latin1(text: str) -> str:
    """``text`` printable with the core font: Latin-1 kept, accents dropped elsewhere, else '?'."""
    out = []
    for char in text:
        try:
            char.encode("latin-1")
        except UnicodeEncodeError:
            base = "".join(c for c in unicodedata.normalize("NFKD", char) if not unicodedata.combining(c))
            try:
                base.encode("latin-1")
            except UnicodeEncodeError:
                base = "?"
            char = base or "?"
        out.append(char)
    return "".join(out)


def _money(amount: Decimal, currency: str) -> str:
    return f"{amount:,.2f} {currency}"


class _InvoicePDF(FPDF):
    def footer(self) -> None:
        self.set_y(-15)
        self.set_font("Helvetica", size=8)
        self.cell(0, 10, f"Page {self.page_no()}/{{nb}}", align=Align.C)


def invoice_pdf(invoice: Invoice) -> bytes:
    """The invoice as a PDF: organisation, number, period, status, each line, subtotal,
    included credit, tax and total."""
    currency = invoice.currency
    pdf = _InvoicePDF(orientation="portrait", unit="mm", format="A4")
    pdf.set_title(_latin1(f"Invoice {invoicing.display_number(invoice)}"))
    pdf.set_creator("inference platform")
    pdf.set_auto_page_break(auto=True, margin=20)
    pdf.add_page()

    def text_line(text: str, *, size: float = 10, style: str = "", height: float = 6) -> None:
        pdf.set_font("Helvetica", style=style, size=size)
        pdf.cell(0, height, _latin1(text), new_x=XPos.LMARGIN, new_y=YPos.NEXT)

    text_line(f"Invoice {invoicing.display_number(invoice)}", size=18, style="B", height=10)
    name, email = invoice.bill_to  # as it was when the invoice was finalized
    text_line(f"Organisation: {name}")
    if email:
        text_line(f"Billing email: {email}")
    text_line(f"Period: {invoicing.period_label(invoice.period)} (UTC calendar month)")
    text_line(f"Status: {Invoice.Status(invoice.status).label}")
    if invoice.finalized_at:
        text_line(f"Issued: {invoice.finalized_at:%Y-%m-%d}")
    if invoice.reissue_of_id is not None and invoice.reissue_of is not None:
        text_line(f"Replaces invoice {invoicing.display_number(invoice.reissue_of)} (void)")
    if invoice.status == Invoice.Status.VOID:
        text_line(f"VOID: {invoice.void_reason}", style="B")
    text_line(f"Currency: {currency}")
    pdf.ln(4)

    pdf.set_font("Helvetica", size=8)
    with pdf.table(
        col_widths=(80, 30, 35, 35),
        text_align=(Align.L, Align.R, Align.R, Align.R),
        line_height=5,
        first_row_as_headings=True,
    ) as table:
        table.row(["Description", "Tokens", f"Per 1M ({currency})", f"Amount ({currency})"])
        for line in _lines(invoice):
            is_credit = line.kind == InvoiceLine.Kind.CREDIT
            table.row(
                [
                    _latin1(line.description),
                    "" if is_credit else f"{line.quantity:,}",
                    "" if is_credit else f"{line.unit_price:f}",
                    f"{line.amount:,.2f}",
                ]
            )
    pdf.ln(4)
    for label, amount, style in (
        ("Subtotal", invoice.subtotal, ""),
        ("Included credit", -invoice.credit, ""),
        (f"Tax ({invoice.tax_rate * 100:.2f} %)", invoice.tax, ""),
        ("Total", invoice.total, "B"),
    ):
        pdf.set_font("Helvetica", style=style, size=10)
        pdf.cell(145, 6, _latin1(label), align=Align.R)
        pdf.cell(35, 6, _money(amount, currency), align=Align.R, new_x=XPos.LMARGIN, new_y=YPos.NEXT)
    pdf.ln(6)
    text_line(
        "Amounts: tokens x price per million / 1,000,000 (inferences x price per thousand / 1,000), "
        "each line rounded once, half up, to cents; "
        "tax rounded the same way.",
        size=7,
        height=4,
    )
    return bytes(pdf.output())
