"""Writes of the money: ``prices``, ``invoices``, ``alerts``. Import them from here.
(Organisations, members, invitations and API keys are ``accounts.services``.)"""

from billing.services.alerts import budget_alert_notify, budget_alerts_notify
from billing.services.invoices import (
    InvoiceFrozen,
    invoice_deletable,
    invoice_delete_draft,
    invoice_draft,
    invoice_email_send,
    invoice_finalize,
    invoice_mark_paid,
    invoice_refresh,
    invoice_reissue,
    invoice_void,
    invoices_draft_month,
)
from billing.services.prices import price_end, price_set

__all__ = [
    "InvoiceFrozen",
    "budget_alert_notify",
    "budget_alerts_notify",
    "invoice_deletable",
    "invoice_delete_draft",
    "invoice_draft",
    "invoice_email_send",
    "invoice_finalize",
    "invoice_mark_paid",
    "invoice_refresh",
    "invoice_reissue",
    "invoice_void",
    "invoices_draft_month",
    "price_end",
    "price_set",
]
