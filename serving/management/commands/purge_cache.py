"""Delete the semantic cache's entries of a model, a model version or an organisation."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from accounts.models import Organization
from core.errors import InvalidInput
from serving.semcache.services import cache_purge


class Command(BaseCommand):
    help = "Delete semantic-cache entries matching every filter given (at least one); prints how many."

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        # --version is Django's "show the version" option on every command; here it is the
        # model version to purge, as the issue and the docs spell it.
        return super().create_parser(prog_name, subcommand, conflict_handler="resolve", **kwargs)

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--model", help="public model name")
        parser.add_argument("--version", "--model-version", dest="model_version",
                            help="model version (of --model, or of every model when alone)")  # fmt: skip
        parser.add_argument("--org", help="name of the organisation whose requests stored the entries")

    def handle(self, *args: Any, **options: Any) -> None:
        organization = None
        if options["org"] is not None:
            organization = Organization.objects.filter(name=options["org"]).first()
            if organization is None:
                raise CommandError(f"no organisation named {options['org']!r}")
        try:
            purged = cache_purge(model=options["model"], version=options["model_version"], organization=organization)
        except InvalidInput as exc:
            raise CommandError(f"give at least one of --model, --version, --org ({exc.message})") from None
        self.stdout.write(f"Purged {purged} cache entries.")
