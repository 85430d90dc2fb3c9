"""Write docs/settings.md from the settings modules (console.settings_reference), or check it."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from console.settings_reference import REFERENCE, markdown, reference, unlisted_env_reads


class Command(BaseCommand):
    help = "Write docs/settings.md from console/settings/*.py (--check: fail when it is stale)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--check", action="store_true", help="write nothing; fail when the file is stale")

    def handle(self, *args: Any, **options: Any) -> None:
        undocumented = [f"{s.module}.{s.name}" for s in reference() if not s.doc]
        if undocumented:
            raise CommandError(f"settings without a '#:' doc above them: {', '.join(undocumented)}")
        unlisted = unlisted_env_reads()
        if unlisted:
            raise CommandError(f"environment reads that are no setting of their own: {', '.join(unlisted)}")
        text = markdown()
        if options["check"]:
            if not REFERENCE.exists() or REFERENCE.read_text() != text:
                raise CommandError(f"{REFERENCE} is stale: run python manage.py settings_reference")
            self.stdout.write(f"{REFERENCE} is current")
            return
        REFERENCE.write_text(text)
        self.stdout.write(f"wrote {REFERENCE}")
