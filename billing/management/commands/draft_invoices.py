"""Draft (or refresh) a month's invoices now: every organisation with unbilled usage, or one."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from accounts.models import Organization
from billing import invoicing
from billing.services import invoices_draft_month
from core.errors import InvalidInput


class Command(BaseCommand):
    help = (
        "Draft the invoices of a UTC month (default: last month) for every organisation with "
        "unbilled usage, or for --org. Existing drafts take usage that arrived since; finalized "
        "and paid invoices are left as they are. Safe to re-run."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--period", metavar="YYYY-MM", help="the month to invoice (default: last month)")
        parser.add_argument("--org", metavar="NAME", help="only this organisation (its name or slug)")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            period = (
                invoicing.parse_period(options["period"])
                if options["period"]
                else invoicing.previous_month(invoicing.month_start(timezone.now()))
            )
        except ValueError as exc:
            raise CommandError(f"--period: {exc}") from None
        organizations = None
        if options["org"]:
            name = options["org"]
            organization = (
                Organization.objects.filter(name=name).first() or Organization.objects.filter(slug=name).first()
            )
            if organization is None:
                raise CommandError(f"--org: no organisation named {name!r}")
            organizations = [organization]
        label = invoicing.period_label(period)
        self.stdout.write(f"drafting invoices for {label}…")
        try:
            drafted = invoices_draft_month(period=period, organizations=organizations, progress=self.stdout.write)
        except InvalidInput as exc:
            raise CommandError(f"--{exc.field}: {exc.message}") from None
        total = sum((invoice.total for invoice in drafted), invoicing.ZERO)
        self.stdout.write(self.style.SUCCESS(f"{len(drafted)} invoices for {label}, totalling {total}"))
