"""Create an API key for an organisation and print the key, alone, on stdout."""

from __future__ import annotations

import math
from argparse import ArgumentParser, ArgumentTypeError
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from accounts.models import Organization, Tier
from accounts.services import api_key_create
from core.errors import InvalidInput

# The longest expiry the command takes: beyond it, use no expiry at all.
MAX_EXPIRES_IN_DAYS = 36_500
# The option that sets each field, so that an error names what the operator typed.
OPTION_OF_FIELD = {
    "name": "--name",
    "rate_limit_rpm": "--rpm",
    "rate_limit_tpm": "--tpm",
    "allowed_models": "--model",
    "tier": "--tier",
    "max_concurrent": "--concurrent",
    "monthly_token_quota": "--token-quota",
    "monthly_spend_cap": "--spend-cap",
    "budget_alert_percent": "--alert-percent",
    "expires_at": "--expires-in-days",
}


def _decimal(text: str) -> Decimal:
    """argparse's type for amounts: Decimal raises InvalidOperation, which argparse would not catch."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ArgumentTypeError(f"not a decimal number: {text!r}") from None
    if not value.is_finite():
        raise ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"not a number of days: {text!r}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_EXPIRES_IN_DAYS:
        raise ArgumentTypeError(f"must be more than 0 and at most {MAX_EXPIRES_IN_DAYS} days")
    return value


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
        parser.add_argument("--spend-cap", type=_decimal, help="spend per UTC month (default: no limit)")
        parser.add_argument("--alert-percent", type=int, default=80, help="budget alert threshold, 1-100 (default 80)")
        parser.add_argument("--expires-in-days", type=_days, help="the key expires this many days from now")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            org = Organization.objects.get(name=options["org"])
        except Organization.DoesNotExist:
            raise CommandError(f"no organisation named {options['org']!r}") from None
        days = options["expires_in_days"]
        try:
            # The operator acts as a platform admin: no plan ceilings, only the hard bounds.
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
                expires_at=timezone.now() + timedelta(days=days) if days is not None else None,
            )
        except InvalidInput as exc:
            raise CommandError(f"{OPTION_OF_FIELD.get(exc.field, exc.field)}: {exc.message}") from None
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stderr.write(f"created key {issued.api_key.prefix}… for {org.name}; it will not be shown again")
        self.stdout.write(issued.secret)
