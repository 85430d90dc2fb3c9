"""Create an API key for an organisation and print the key, alone, on stdout."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from billing.models import Organization
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
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stderr.write(f"created key {issued.api_key.prefix}… for {org.name}; it will not be shown again")
        self.stdout.write(issued.secret)
