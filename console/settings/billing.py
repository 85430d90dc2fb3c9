"""Money and metering (billing): the currency, invoices, usage persistence, and the platform's
own organisation."""

from __future__ import annotations

import os

from .env import envfloat, envint

# Every price, spend cap and invoice is in it.
#: The platform's currency (an ISO 4217 code).
BILLING_CURRENCY = os.environ.get("BILLING_CURRENCY", "USD")
# So late usage (settlements retried after an outage) lands on them; anything later becomes an
# adjustment next month.
#: Last month's invoices are drafted this long after it ends (hours).
INVOICE_GRACE_HOURS = envfloat("INVOICE_GRACE_HOURS", 12.0)
#: A finalized invoice is due this many days after it was finalized (days; its page and PDF say when).
INVOICE_DUE_DAYS = envint("INVOICE_DUE_DAYS", 30)
# Its admins' memberships, and what platform staff use themselves (the console playground)
# is metered there, never to a customer.
#: The platform's own organisation (an organisation name).
PLATFORM_ORGANIZATION = os.environ.get("PLATFORM_ORGANIZATION", "Platform")
# A usage event or budget alert that fails PERSIST_MAX_DELIVERIES deliveries is parked in its
# dead-letter stream; a failed or abandoned entry is retried after PERSIST_RETRY_AFTER_SECONDS.
#: Deliveries of a usage event or budget alert before it is dead-lettered (a count).
PERSIST_MAX_DELIVERIES = envint("PERSIST_MAX_DELIVERIES", 5)
#: A failed or abandoned usage event or budget alert is retried after this (seconds).
PERSIST_RETRY_AFTER_SECONDS = envfloat("PERSIST_RETRY_AFTER_SECONDS", 60.0)
