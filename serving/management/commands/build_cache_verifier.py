"""Build the semantic cache's paraphrase-tier models (serving.semcache.verifier_build)."""

from __future__ import annotations

from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = (
        "Export the semantic cache's local embedder and cross-encoder into SEMANTIC_CACHE_VERIFIER_DIR from "
        "MiniLM's weights and the shipped tuned weights, with their calibration; skipped when up to date. "
        "--train fine-tunes again (the calibration folds and the final model) and writes the weights shipped."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--force", action="store_true", help="build even when the artifact is up to date")
        parser.add_argument(
            "--train",
            action="store_true",
            help="train again (about 7 minutes on two cores) and write serving/semcache/data/verifier_trained.*, "
            "then build from them; for whoever changes the tuning data or the recipe",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from serving.semcache import paraphrase, verifier_build

        folder = Path(settings.SEMANTIC_CACHE_VERIFIER_DIR)
        if options["train"]:
            verifier_build.train(progress=self.stdout.write)
        verifier_build.build(folder, force=options["force"], progress=self.stdout.write)
        paraphrase.forget()
