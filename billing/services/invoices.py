"""Writes for invoices: drafting a month's invoice, its guarded state moves, and sending it.

States: draft → finalized → paid; draft or finalized → void (``Invoice.TRANSITIONS``).
Every move locks the invoice row and checks the stored state, never the caller's copy,
and raises ``IllegalTransition`` otherwise. Only a draft's lines and totals are ever
written; a finalized or paid invoice never changes (a correction is a void and a reissue).

Locks are always taken in the same order, organisation → invoice → number sequence, so
concurrent drafts, voids and reissues never deadlock. Lines and totals follow the rounding
rule of ``billing.invoicing``.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterable

from django.conf import settings
from django.core.mail import EmailMessage
from django.db import InterfaceError, OperationalError, transaction
from django.db.models import Max
from django.utils import timezone

from accounts.models import Organization
from billing import invoicing
from billing.models import Invoice, InvoiceLine, InvoiceSequence, UsageRecord
from billing.signals import invoice_finalized
from core.errors import InvalidInput
from core.transitions import transition

logger = logging.getLogger(__name__)

SEQUENCE_NAME = "invoices"
VOID_REASON_MAX_LENGTH = 500


class InvoiceFrozen(Exception):
    """A write to an invoice that is no longer a draft: finalized and paid invoices never change."""

    def __init__(self, invoice: Invoice) -> None:
        self.invoice = invoice
        super().__init__(
            f"invoice {invoicing.display_number(invoice)} is {invoice.status}: only a draft changes "
            "(void and reissue it to correct it)"
        )


def _period(period: dt.date) -> dt.date:
    period = invoicing.month_start(period)
    if period > invoicing.month_start(timezone.now()):
        raise InvalidInput("period", f"{invoicing.period_label(period)} has not started")
    return period


def _take_number() -> int:
    """The next invoice number. Call inside transaction.atomic: the sequence row stays locked
    until commit, so numbers are taken one transaction at a time and a rollback gives its
    number back (no gaps, no duplicates)."""
    sequence, created = InvoiceSequence.objects.select_for_update().get_or_create(name=SEQUENCE_NAME)
    number = sequence.next_number
    if created:  # the seeded row is missing (a flushed database): continue after the last number
        number = max(number, (Invoice.objects.aggregate(m=Max("number"))["m"] or 0) + 1)
    InvoiceSequence.objects.filter(pk=sequence.pk).update(next_number=number + 1)
    return number


def _fill(invoice: Invoice, organization: Organization) -> None:
    """Take the organisation's unbilled usage up to the month's end into the draft and
    recompute its lines and totals. Call inside transaction.atomic with the organisation
    and the invoice rows locked."""
    if invoice.status != Invoice.Status.DRAFT:
        raise InvoiceFrozen(invoice)
    invoicing.uninvoiced_usage(organization_id=organization.pk, period=invoice.period).update(invoice=invoice)
    held = UsageRecord.objects.filter(invoice=invoice)
    figures = invoicing.invoice_figures(held, organization=organization, period=invoice.period)
    drafts, sums = figures.lines, figures.totals
    InvoiceLine.objects.filter(invoice=invoice).delete()
    InvoiceLine.objects.bulk_create([line.as_line(invoice) for line in drafts])
    invoice.currency = settings.BILLING_CURRENCY
    invoice.subtotal, invoice.credit, invoice.tax_rate = sums.subtotal, sums.credit, sums.tax_rate
    invoice.tax, invoice.total = sums.tax, sums.total
    invoice.save(update_fields=["currency", "subtotal", "credit", "tax_rate", "tax", "total", "updated_at"])


def _create_draft(organization: Organization, period: dt.date, *, reissue_of: Invoice | None = None) -> Invoice:
    """A new numbered draft. Call inside transaction.atomic with the organisation row locked."""
    invoice = Invoice.objects.create(
        organization=organization,
        period=period,
        number=_take_number(),
        currency=settings.BILLING_CURRENCY,
        tax_rate=organization.tax_rate,
        reissue_of=reissue_of,
    )
    _fill(invoice, organization)
    return invoice


def invoice_draft(*, organization: Organization, period: dt.date) -> Invoice:
    """The organisation's invoice of the UTC month of ``period``, drafted or refreshed.

    Idempotent: a new draft takes the next number and the organisation's unbilled usage up
    to the month's end; an existing draft is recomputed and takes usage that arrived since;
    a finalized or paid invoice is returned untouched (usage arriving later is billed as
    an adjustment on a later invoice). Runs in its own transaction with the organisation
    row locked, so concurrent drafts of one organisation queue and never make two.
    """
    period = _period(period)
    with transaction.atomic():
        locked_org = Organization.objects.select_for_update().get(pk=organization.pk)
        invoice = (
            Invoice.objects.select_for_update()
            .filter(organization=locked_org, period=period)
            .exclude(status=Invoice.Status.VOID)
            .first()
        )
        if invoice is None:
            invoice = _create_draft(locked_org, period)
        elif invoice.status == Invoice.Status.DRAFT:
            _fill(invoice, locked_org)
    return invoice


def invoice_refresh(*, invoice: Invoice) -> Invoice:
    """Recompute a draft from its usage (and usage that arrived since); ``InvoiceFrozen``
    for any other state: nothing of a finalized, paid or void invoice is ever rewritten."""
    with transaction.atomic():
        organization = Organization.objects.select_for_update().get(pk=invoice.organization_id)
        locked = Invoice.objects.select_for_update().get(pk=invoice.pk)
        _fill(locked, organization)
    return locked


def invoice_finalize(*, invoice: Invoice) -> Invoice:
    """Freeze a draft: from here on it never changes. Once committed, it is emailed with its
    PDF to the organisation's billing address (a Celery task, retried if mail fails)."""
    if not invoicing.month_ended(invoice.period, now=timezone.now()):
        raise InvalidInput("period", f"{invoicing.period_label(invoice.period)} has not ended yet")
    with transaction.atomic():
        organization = Organization.objects.select_for_update().get(pk=invoice.organization_id)
        finalized = transition(
            invoice,
            Invoice.Status.FINALIZED,
            finalized_at=timezone.now(),
            billed_name=organization.name,
            billed_email=organization.billing_email,
        )
        invoice_id = finalized.pk

        def announce() -> None:  # a named function: a robust callback that fails is logged by name
            invoice_finalized.send(sender=Invoice, invoice_id=invoice_id)

        transaction.on_commit(announce, robust=True)
    return finalized


def invoice_mark_paid(*, invoice: Invoice) -> Invoice:
    with transaction.atomic():
        return transition(invoice, Invoice.Status.PAID, paid_at=timezone.now())


def _reason(reason: str) -> str:
    reason = reason.strip()
    if not reason:
        raise InvalidInput("reason", "say why the invoice is void")
    if len(reason) > VOID_REASON_MAX_LENGTH:
        raise InvalidInput("reason", f"at most {VOID_REASON_MAX_LENGTH} characters")
    return reason


def _void(invoice: Invoice, reason: str) -> Invoice:
    """Void and release its usage (to a reissue or the next invoice). Call inside
    transaction.atomic with the organisation row locked."""
    voided = transition(invoice, Invoice.Status.VOID, voided_at=timezone.now(), void_reason=reason)
    UsageRecord.objects.filter(invoice=voided).update(invoice=None)
    return voided


def invoice_void(*, invoice: Invoice, reason: str) -> Invoice:
    """Void a draft or finalized invoice. Its number stays used (no gaps) and its lines stay
    as they were; its usage records are released for the month's next invoice (a reissue,
    or a new draft of the month)."""
    reason = _reason(reason)
    with transaction.atomic():
        Organization.objects.select_for_update().get(pk=invoice.organization_id)
        return _void(invoice, reason)


def invoice_deletable(invoice: Invoice) -> bool:
    """A draft holding the last number taken: deleting it leaves no gap (the number is given back)."""
    if invoice.status != Invoice.Status.DRAFT:
        return False
    sequence = InvoiceSequence.objects.filter(name=SEQUENCE_NAME).first()
    return sequence is not None and sequence.next_number == invoice.number + 1


def invoice_delete_draft(*, invoice: Invoice) -> None:
    """Delete a draft (as Stripe does, where voiding is for sent invoices): its usage records
    are released for the month's next draft and its number is given back. Only the latest
    draft can go (numbers never have gaps); any other is voided instead (``invoice_void``)."""
    with transaction.atomic():
        sequence = InvoiceSequence.objects.select_for_update().get(name=SEQUENCE_NAME)
        Organization.objects.select_for_update().get(pk=invoice.organization_id)
        locked = Invoice.objects.select_for_update().get(pk=invoice.pk)
        if locked.status != Invoice.Status.DRAFT:
            raise InvalidInput("invoice", f"only a draft is deleted; a {locked.status} invoice is voided")
        if sequence.next_number != locked.number + 1:
            raise InvalidInput("invoice", "a later invoice has a number already: void this draft instead, so the "
                                          "numbers keep no gap")  # fmt: skip
        UsageRecord.objects.filter(invoice=locked).update(invoice=None)
        locked.delete()  # its lines go with it
        InvoiceSequence.objects.filter(pk=sequence.pk).update(next_number=locked.number)


def invoice_reissue(*, invoice: Invoice, reason: str = "") -> Invoice:
    """Void ``invoice`` and draft its replacement (``reissue_of`` → it) in one transaction.

    The new draft has the next number and takes the released usage and whatever else of
    the month is still unbilled (and earlier months' late usage, as any draft does). Returns
    the new draft.
    """
    with transaction.atomic():
        organization = Organization.objects.select_for_update().get(pk=invoice.organization_id)
        old = _void(invoice, _reason(reason or "reissued"))
        return _create_draft(organization, old.period, reissue_of=old)


def invoices_draft_month(
    *,
    period: dt.date,
    organizations: Iterable[Organization] | None = None,
    new_only: bool = False,
    progress: Callable[[str], object] | None = None,
) -> list[Invoice]:
    """Draft (or refresh) the month's invoice of each organisation with unbilled usage up to
    its end or a draft for it (or of ``organizations``). ``new_only``: leave organisations
    that already have an invoice for the month, live or void, alone (the beat job: it never
    refreshes a draft under review nor undoes a void). Each organisation in its own
    transaction: one that fails is logged (and reported to ``progress``) and the others are
    still drafted; returns those drafted. Safe to re-run."""
    period = _period(period)
    candidates = (
        list(organizations) if organizations is not None else list(invoicing.organizations_to_invoice(period=period))
    )
    if new_only:
        invoiced = set(Invoice.objects.filter(period=period).values_list("organization_id", flat=True))
        candidates = [org for org in candidates if org.pk not in invoiced]
    drafted: list[Invoice] = []
    for index, organization in enumerate(candidates, start=1):
        step = f"[{index}/{len(candidates)}] {organization.name}"
        try:
            invoice = invoice_draft(organization=organization, period=period)
        except (OperationalError, InterfaceError):
            raise  # the database itself: stop, the next run retries everything
        except Exception as exc:  # this organisation's own failure (logged) must not stop the others
            logger.exception("invoice of %s for %s not drafted", organization, invoicing.period_label(period))
            if progress is not None:
                progress(f"{step}: FAILED, {exc!r}")
            continue
        drafted.append(invoice)
        if progress is not None:
            progress(
                f"{step}: {invoicing.display_number(invoice)} {invoice.status}, "
                f"total {invoice.total} {invoice.currency}"
            )
    return drafted


# --- Email ------------------------------------------------------------------------------


def invoice_email_send(*, invoice: Invoice) -> bool:
    """Email a finalized (or paid) invoice, PDF attached, to its organisation's billing
    address; False when there is none (logged) or the invoice is a draft or void."""
    # Imported here: the PDF library is only needed by the worker that sends, not by every
    # process that imports billing.services (the gateways do).
    from billing.invoice_documents import invoice_filename, invoice_pdf

    number = invoicing.display_number(invoice)
    if invoice.status not in (Invoice.Status.FINALIZED, Invoice.Status.PAID):
        logger.info("invoice %s is %s: not emailed", number, invoice.status)
        return False
    name, email = invoice.bill_to
    if not email:
        logger.warning("invoice %s of %s not emailed: the organisation has no billing email", number, name)
        return False
    month = invoicing.period_label(invoice.period)
    message = EmailMessage(
        subject=f"Invoice {number} for {month}: {invoice.total} {invoice.currency}",
        body=(
            f"Hello {name},\n\n"
            f"Attached is invoice {number} for your usage in {month}.\n\n"
            f"Subtotal: {invoice.subtotal} {invoice.currency}\n"
            f"Included credit: -{invoice.credit} {invoice.currency}\n"
            f"Tax ({invoice.tax_rate * 100:.2f} %): {invoice.tax} {invoice.currency}\n"
            f"Total: {invoice.total} {invoice.currency}\n"
        ),
        to=[email],
    )
    message.attach(invoice_filename(invoice, "pdf"), invoice_pdf(invoice), "application/pdf")
    message.send()
    logger.info("invoice %s emailed to %s", number, email)
    return True


__all__ = [
    "InvoiceFrozen",
    "invoice_draft",
    "invoice_email_send",
    "invoice_finalize",
    "invoice_mark_paid",
    "invoice_refresh",
    "invoice_reissue",
    "invoice_void",
    "invoices_draft_month",
]
