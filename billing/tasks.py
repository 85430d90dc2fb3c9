"""Celery tasks of accounts and billing (take ids, call a service, idempotent)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from smtplib import SMTPException

from celery import shared_task
from django.conf import settings
from django.dispatch import receiver
from django.utils import timezone

from billing import invoicing
from billing.models import Invoice
from billing.reconciliation import reconcile, reconcile_due_hours, reconcile_month
from billing.rollups import HOUR, rollups_build
from billing.services import budget_alerts_notify, invoice_email_send, invoices_draft_month
from billing.signals import budget_alerts_stored, invoice_finalized
from billing.usage import persist_budget_alerts, persist_failed_attempts, persist_usage_stream

logger = logging.getLogger(__name__)

# Hard time limits only: a soft one raises an Exception inside the run, which the handlers
# that isolate one bad entry, alert or organisation would take for that item's own failure
# (a good usage event counted towards parking). A hard limit ends the worker's child; every
# task here is idempotent and commits before it acknowledges, so the next run redoes the rest.
# Each stays under the broker's visibility timeout (an hour), after which an unacknowledged
# message would be delivered again while its first run still goes on.


@shared_task(ignore_result=True, time_limit=120)
def usage_persist() -> int:
    """Usage events from Redis into PostgreSQL (every second, idempotent), then the failed
    attempts that fallbacks left (never billed; the canaries read them).

    Budget alerts have their own task, so that nothing about an alert can hold up usage.
    """
    stored = persist_usage_stream()
    persist_failed_attempts()
    return stored


@shared_task(ignore_result=True, time_limit=120)
def budget_alerts_persist() -> int:
    """Budget alerts from Redis into BudgetAlert rows (every second, idempotent); the new
    ones are emailed by ``budget_alerts_email``, on the slow queue."""
    return persist_budget_alerts()


# E-mail: each SMTP read or write gives up after EMAIL_TIMEOUT; the limit also ends a server
# that answers, slowly, forever.
@shared_task(ignore_result=True, time_limit=300)
def budget_alerts_email(alert_ids: list[int]) -> int:
    """Email new alerts (queued on commit by ``persist_budget_alerts``), so that a mail
    server that hangs holds up this queue, never metering. Idempotent: an alert is sent
    once, whoever sends it; what fails is left to ``budget_alerts_notify_pending``."""
    return budget_alerts_notify(alert_ids=alert_ids)


@receiver(budget_alerts_stored, dispatch_uid="billing.tasks.queue_budget_alerts_email")
def queue_budget_alerts_email(sender: object, *, alert_ids: list[int], **kwargs: object) -> None:
    """New budget alerts are emailed by ``budget_alerts_email`` on the slow queue."""
    budget_alerts_email.delay(alert_ids)


@shared_task(ignore_result=True, time_limit=300)
def budget_alerts_notify_pending() -> int:
    """Email recent alerts that are not sent yet (the mail server failed when they were
    stored). Idempotent: an alert is sent once, whoever sends it."""
    return budget_alerts_notify()


@shared_task(
    ignore_result=True, autoretry_for=(OSError, SMTPException), retry_backoff=60, max_retries=12, time_limit=300
)
def invoice_email(invoice_id: int) -> bool:
    """Email a finalized invoice with its PDF (queued on commit by ``invoice_finalize``);
    retried with backoff while the mail server fails."""
    invoice = Invoice.objects.select_related("organization", "reissue_of").filter(pk=invoice_id).first()
    if invoice is None:
        return False
    return invoice_email_send(invoice=invoice)


@receiver(invoice_finalized, dispatch_uid="billing.tasks.queue_invoice_email")
def queue_invoice_email(sender: object, *, invoice_id: int, **kwargs: object) -> None:
    """A finalized invoice is emailed by ``invoice_email`` on the slow queue."""
    invoice_email.delay(invoice_id)


def invoice_grace() -> timedelta:
    return timedelta(hours=float(settings.INVOICE_GRACE_HOURS))


# Drafting commits organisation by organisation: a run cut short is finished by the next one.
@shared_task(ignore_result=True, time_limit=1800)
def invoices_draft_due(now: str | None = None) -> int:
    """Draft last month's invoices once its late usage has had ``INVOICE_GRACE_HOURS`` to
    arrive (beat: hourly; ``now``, ISO 8601, for tests). Safe to re-run: an organisation
    that already has an invoice for the month (draft, finalized, paid or void) is left
    alone; returns how many were drafted."""
    moment = datetime.fromisoformat(now) if now else timezone.now()
    if timezone.is_naive(moment):
        raise ValueError("now must include a time zone")
    period = invoicing.previous_month(invoicing.month_start(moment))
    _, end = invoicing.month_bounds(period)
    if moment < end + invoice_grace():
        return 0
    drafted = invoices_draft_month(period=period, new_only=True, progress=logger.info)
    if drafted:
        logger.info("drafted %d invoices for %s", len(drafted), invoicing.period_label(period))
    return len(drafted)


# One transaction over everything since the watermark: generous, so that a long backlog
# (the platform down for days) is not cut short at every try.
@shared_task(ignore_result=True, time_limit=1800)
def usage_rollups_build() -> int:
    """Hourly and daily usage rollups from the records added since the last run (beat:
    every minute). Idempotent: a bucket is recomputed whole; returns the rows changed."""
    return rollups_build().rows_written


@shared_task(ignore_result=True, time_limit=1800)
def usage_reconcile(hour: str | None = None) -> int:
    """Reconcile ledger counts, usage records and hourly rollups: the one-hour period
    starting at ``hour`` (ISO 8601) when given, else every hour not yet checked up to the
    hour before last (beat: every 10 minutes; each hour is checked once). Returns the
    number of mismatches found."""
    if hour is not None:
        start = datetime.fromisoformat(hour)
        return int(not reconcile(start=start, end=start + HOUR).ok)
    return sum(not result.ok for result in reconcile_due_hours())


@shared_task(ignore_result=True, time_limit=1800)
def usage_reconcile_month(period: str | None = None) -> int:
    """Reconcile a whole month, invoices included: ``period`` (YYYY-MM) or last month (beat:
    on the 2nd, after the month's invoices were drafted). Returns 1 on a mismatch, else 0."""
    month = invoicing.parse_period(period) if period else invoicing.previous_month(timezone.now().date())
    return int(not reconcile_month(period=month).ok)
