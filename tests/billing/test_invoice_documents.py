"""Invoice documents: the PDF's text holds every line and total; the CSV adds up to the invoice."""

from __future__ import annotations

import csv
import datetime as dt
import io
from decimal import Decimal

import pytest
from pypdf import PdfReader

from accounts.models import Plan
from accounts.services import api_key_create, organization_create
from billing.invoice_documents import CSV_COLUMNS, invoice_csv, invoice_filename, invoice_pdf
from billing.models import Invoice
from billing.services import invoice_draft, invoice_finalize
from tests.support.invoices import chat_model, price, record

pytestmark = pytest.mark.django_db

SEP = dt.date(2026, 9, 1)
OCT = dt.date(2026, 10, 1)


@pytest.fixture
def invoice(alice_org) -> Invoice:
    """October with two models, a mid-month price change, a late September record, a credit and tax."""
    alice_org.tax_rate = Decimal("0.1900")
    alice_org.billing_email = "ap@alice.example"
    alice_org.save()
    Plan.objects.filter(tier=alice_org.tier).update(included_credit=Decimal("2.50"))
    key = api_key_create(organization=alice_org, name="k").api_key
    chat, embed = chat_model("chat-model"), chat_model("embed-model")
    old = price(chat, "2026-08-01", "1.25", "3.333333", cached="0.125")
    new = price(chat, "2026-10-15", "1.50", "4")
    cheap = price(embed, "2026-08-01", "0.02", "0")
    record(key, "2026-09-10", prompt=10_000, completion=1_000, price=old)
    invoice_finalize(invoice=invoice_draft(organization=alice_org, period=SEP))
    record(key, "2026-09-30 23:59:59", prompt=1_234_567, completion=89_012, price=old)  # late
    record(key, "2026-10-02", prompt=2_000_000, cached=500_000, completion=777_777, price=old)
    record(key, "2026-10-20", prompt=1_000_001, completion=333_333, price=new)
    record(key, "2026-10-21", prompt=12_345_678, price=cheap, model="embed-model")
    record(key, "2026-10-22", prompt=40, completion=2, model="unpriced-model")
    return invoice_draft(organization=alice_org, period=OCT)


def pdf_text(data: bytes) -> str:
    return "\n".join(page.extract_text() for page in PdfReader(io.BytesIO(data)).pages)


class TestPdf:
    def test_it_is_a_pdf_with_every_line_and_total(self, invoice):
        invoice = invoice_finalize(invoice=invoice)
        data = invoice_pdf(invoice)
        assert data.startswith(b"%PDF-")
        text = pdf_text(data)
        for expected in (
            "Alice Corp",
            f"INV-{invoice.number:06d}",
            "2026-10",
            "Finalized",
            f"{invoice.subtotal:,.2f} USD",
            f"-{invoice.credit:,.2f} USD",
            f"{invoice.tax:,.2f} USD",
            f"{invoice.total:,.2f} USD",
            "Tax (19.00 %)",
            "late usage of 2026-09",
            "unpriced",
        ):
            assert expected in text, expected
        lines = list(invoice.lines.order_by("id"))
        assert len(lines) >= 8
        for line in lines:
            assert line.description in text.replace("\n", " "), line.description
            assert f"{line.amount:,.2f}" in text
            if line.quantity:
                assert f"{line.quantity:,}" in text

    def test_a_finalized_invoice_prints_the_organisation_as_it_was_then(self, invoice, alice_org):
        """Issue 18: renaming the organisation (or moving its billing address) later must not
        rewrite an invoice already issued; a draft shows the current name."""
        from accounts.services import organization_update

        issued = invoice_finalize(invoice=invoice)
        organization_update(organization=alice_org, name="Alice Renamed", billing_email="new@alice.example")
        issued.refresh_from_db()
        text = pdf_text(invoice_pdf(issued))
        assert "Alice Corp" in text
        assert "ap@alice.example" in text
        assert "Alice Renamed" not in text
        draft = invoice_draft(organization=alice_org, period=dt.date(2026, 11, 1))
        assert "Alice Renamed" in pdf_text(invoice_pdf(draft))

    def test_the_totals_are_the_invoices(self, invoice):
        assert invoice.subtotal == sum(
            (line.amount for line in invoice.lines.filter(kind__in=["usage", "adjustment"])), Decimal(0)
        )
        assert invoice.credit == Decimal("2.50")
        assert invoice.tax == ((invoice.subtotal - invoice.credit) * Decimal("0.19")).quantize(Decimal("0.01"))
        assert invoice.total == invoice.subtotal - invoice.credit + invoice.tax

    def test_many_lines_flow_onto_more_pages(self, alice_org):
        key = api_key_create(organization=alice_org, name="k").api_key
        for i in range(80):
            m = chat_model(f"model-{i:02d}")
            record(
                key, "2026-10-03", prompt=1000 + i, completion=10, price=price(m, "2026-09-01", "1", "2"), model=m.name
            )
        invoice = invoice_draft(organization=alice_org, period=OCT)
        reader = PdfReader(io.BytesIO(invoice_pdf(invoice)))
        assert len(reader.pages) > 1
        text = "\n".join(page.extract_text() for page in reader.pages)
        assert "model-00" in text
        assert "model-79" in text
        assert f"{invoice.total:,.2f} USD" in text

    def test_a_name_outside_latin_1_is_printed(self):
        org = organization_create(name="Ωmega 株式会社 Zoë")
        key = api_key_create(organization=org, name="k").api_key
        record(key, "2026-10-03", prompt=10)
        text = pdf_text(invoice_pdf(invoice_draft(organization=org, period=OCT)))
        assert "?mega" in text
        assert "Zoë" in text

    def test_the_filename(self, invoice):
        assert invoice_filename(invoice, "pdf") == f"INV-{invoice.number:06d}-2026-10.pdf"


class TestCsv:
    def rows(self, invoice):
        return list(csv.DictReader(io.StringIO(invoice_csv(invoice))))

    def test_one_row_per_line_then_totals(self, invoice):
        rows = self.rows(invoice)
        lines = list(invoice.lines.order_by("id"))
        assert list(rows[0]) == list(CSV_COLUMNS)
        assert [row["kind"] for row in rows] == [line.kind for line in lines] + [
            "subtotal", "included_credit", "tax", "total",
        ]  # fmt: skip
        for row, line in zip(rows, lines, strict=False):
            assert Decimal(row["amount"]) == line.amount
            assert row["description"] == line.description
            if line.kind != "credit":
                assert int(row["quantity"]) == line.quantity
                assert Decimal(row["unit_price"]) == line.unit_price
                assert row["price_per"] == "1000000"

    def test_its_sums_equal_the_invoice(self, invoice):
        rows = self.rows(invoice)
        totals = {row["kind"]: Decimal(row["amount"]) for row in rows[-4:]}
        line_rows = rows[:-4]
        billed = sum((Decimal(r["amount"]) for r in line_rows if r["kind"] in ("usage", "adjustment")), Decimal(0))
        credit = sum((Decimal(r["amount"]) for r in line_rows if r["kind"] == "credit"), Decimal(0))
        assert billed == totals["subtotal"] == invoice.subtotal
        assert credit == totals["included_credit"] == -invoice.credit
        assert totals["tax"] == invoice.tax
        assert sum((Decimal(r["amount"]) for r in line_rows), Decimal(0)) + totals["tax"] == totals["total"]
        assert totals["total"] == invoice.total
        assert {r["currency"] for r in rows} == {"USD"}
        adjustment = next(r for r in line_rows if r["kind"] == "adjustment")
        assert adjustment["usage_period"] == "2026-09"
