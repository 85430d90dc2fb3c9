"""Writes for budget alerts: each one emailed once to its organisation's billing address.

An alert row is stored first (``billing.usage.persist_budget_alerts``); emailing it is a
separate step that may fail without losing it: ``notified_at`` stays empty and the
``budget_alerts_notify`` task tries again later. An alert is sent inside a transaction
that holds its row locked and sets ``notified_at`` with the send, so two workers never
both send it; the one gap is a crash between the mail server accepting the message and
the commit, which sends it again on the retry (at least once, never silently dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.core.mail import EmailMessage
from django.db import InterfaceError, OperationalError, transaction
from django.utils import timezone

from billing.models import BudgetAlert
from core import formats

logger = logging.getLogger(__name__)

# Unsent alerts older than this are not retried: an alert about a budget long past is noise.
RETRY_WINDOW = timedelta(days=3)


def _scope(alert: BudgetAlert) -> str:
    if alert.api_key is not None:
        return f"API key {alert.api_key.name!r} ({alert.api_key.prefix}…)"
    return "the organisation"


def _amount(alert: BudgetAlert, value: Decimal, *, limit: bool = False) -> str:
    """As the pages read it: spend as money, a cap as configured (core.formats); tokens counted."""
    if alert.budget == BudgetAlert.Budget.SPEND:
        currency = str(settings.BILLING_CURRENCY)
        return formats.unit_price(value, currency) if limit else formats.money(value, currency)
    return f"{int(value):,} tokens"


def _message(alert: BudgetAlert) -> EmailMessage:
    organization = alert.organization
    budget = BudgetAlert.Budget(alert.budget).label.lower()
    scope = _scope(alert)
    return EmailMessage(
        subject=f"Budget alert: {scope} of {organization.name} at {alert.threshold_percent} % of its {budget}",
        body=(
            f"Hello {organization.name},\n\n"
            f"{scope[0].upper()}{scope[1:]} has reached {alert.threshold_percent} % of its monthly {budget} "
            f"for {alert.month} (UTC).\n\n"
            f"Used (including requests in flight): {_amount(alert, alert.used)}\n"
            f"Limit: {_amount(alert, alert.limit, limit=True)}\n\n"
            "Requests beyond the limit are refused until the month ends or the limit is raised.\n"
        ),
        to=[organization.billing_email],
    )


def budget_alert_notify(*, alert_id: int) -> bool:
    """Email one alert unless it was sent already (or its organisation has no billing
    address); True if it went out now. Runs its own transaction with the alert row locked;
    a row another worker is sending is skipped. A mail failure propagates and leaves the
    alert unsent."""
    with transaction.atomic():
        alert = (
            BudgetAlert.objects.select_for_update(skip_locked=True, of=("self",))
            .select_related("organization", "api_key")
            .filter(pk=alert_id, notified_at__isnull=True)
            .first()
        )
        if alert is None:
            return False
        if not alert.organization.billing_email:
            logger.info("budget alert %s not emailed: %s has no billing email", alert, alert.organization)
            return False
        _message(alert).send()
        alert.notified_at = timezone.now()
        alert.save(update_fields=["notified_at"])
    logger.info("budget alert %s emailed to %s", alert, alert.organization.billing_email)
    return True


def budget_alerts_notify(*, alert_ids: Iterable[int] | None = None) -> int:
    """Email the given alerts, or (None) every recent alert not sent yet; returns how many
    went out. Stops at the first mail failure (the server is likely down: the rest wait for
    the next run) and never raises for one, so callers storing alerts are never held up."""
    pending = BudgetAlert.objects.filter(notified_at__isnull=True).exclude(organization__billing_email="")
    if alert_ids is not None:
        pending = pending.filter(pk__in=list(alert_ids))
    else:
        pending = pending.filter(created_at__gte=timezone.now() - RETRY_WINDOW)
    sent = 0
    for alert_id in pending.order_by("created_at", "pk").values_list("pk", flat=True):
        try:
            sent += budget_alert_notify(alert_id=alert_id)
        except (OperationalError, InterfaceError):
            raise
        except Exception:  # a mail failure (any backend's error): the alert stays unsent, retried later
            logger.warning("budget alert %s not emailed; retried later", alert_id, exc_info=True)
            break
    return sent
