"""Build the semantic cache's paraphrase-tier models (serving.semcache.verifier_build)."""

from __future__ import annotations

from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = (
        "Fine-tune and export the semantic cache's local embedder and cross-encoder into "
        "SEMANTIC_CACHE_VERIFIER_DIR, with their leave-one-source-out calibration; skipped when up to date."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--force", action="store_true", help="build even when the artifact is up to date")

    def handle(self, *args: Any, **options: Any) -> None:
        from serving.semcache import paraphrase, verifier_build

        folder = Path(settings.SEMANTIC_CACHE_VERIFIER_DIR)
        verifier_build.build(folder, force=options["force"], progress=self.stdout.write)
        paraphrase.forget()
