"""Create an API key for an organisation and print the key, alone, on stdout."""

from __future__ import annotations

from argparse import ArgumentParser
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from billing.models import Organization, Tier
from billing.services import api_key_create


class Command(BaseCommand):
    help = "Create an API key; the key is printed once on stdout and never stored."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--org", required=True, help="organisation name")
        parser.add_argument("--name", required=True, help="a name for the key")
        parser.add_argument("--rpm", type=int, default=60, help="requests per minute (default 60)")
        parser.add_argument("--tpm", type=int, default=100_000, help="tokens per minute (default 100000)")
        parser.add_argument(
            "--model",
            action="append",
            default=[],
            dest="models",
            help="restrict the key to this model (repeatable; default: every model)",
        )
        parser.add_argument("--tier", choices=Tier.values, help="plan tier (default: the organisation's)")
        parser.add_argument("--concurrent", type=int, help="requests at once (default: no limit)")
        parser.add_argument("--token-quota", type=int, help="tokens per UTC month (default: no limit)")
        parser.add_argument("--spend-cap", type=Decimal, help="spend per UTC month (default: no limit)")
        parser.add_argument("--alert-percent", type=int, default=80, help="budget alert threshold (default 80)")
        parser.add_argument("--expires-in-days", type=float, help="the key expires this many days from now")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            org = Organization.objects.get(name=options["org"])
        except Organization.DoesNotExist:
            raise CommandError(f"no organisation named {options['org']!r}") from None
        try:
            issued = api_key_create(
                organization=org,
                name=options["name"],
                rate_limit_rpm=options["rpm"],
                rate_limit_tpm=options["tpm"],
                allowed_models=options["models"],
                tier=options["tier"],
                max_concurrent=options["concurrent"],
                monthly_token_quota=options["token_quota"],
                monthly_spend_cap=options["spend_cap"],
                budget_alert_percent=options["alert_percent"],
                expires_at=(
                    timezone.now() + timedelta(days=options["expires_in_days"])
                    if options["expires_in_days"] is not None
                    else None
                ),
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stderr.write(f"created key {issued.api_key.prefix}… for {org.name}; it will not be shown again")
        self.stdout.write(issued.secret)
