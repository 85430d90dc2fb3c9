"""Price a model (or one version of it) per million tokens, from now or a given moment on."""

from __future__ import annotations

from argparse import ArgumentParser
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from billing.services import price_set
from core.errors import InvalidInput
from registry.models import Model, ModelVersion

# The service's field names, as this command's options.
OPTION_OF = {
    "input_per_million": "--input",
    "output_per_million": "--output",
    "cached_input_per_million": "--cached",
    "effective_from": "--from",
    "version": "--model-version",
}


class Command(BaseCommand):
    help = "Set a model's price per million tokens; the price in effect then ends there."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--model", required=True, help="public model name")
        parser.add_argument("--model-version", help="price one version only (default: every version)")
        parser.add_argument("--input", required=True, help="per million input tokens, e.g. 0.10")
        parser.add_argument("--output", required=True, help="per million output tokens")
        parser.add_argument("--cached", help="per million cached input tokens (default: the input price)")
        parser.add_argument("--from", dest="effective_from", help="ISO 8601 start with a time zone (default: now)")

    def handle(self, *args: Any, **options: Any) -> None:
        model = Model.objects.filter(name=options["model"]).first()
        if model is None:
            raise CommandError(f"no model named {options['model']!r}")
        version = None
        if options["model_version"]:
            version = ModelVersion.objects.filter(model=model, version=options["model_version"]).first()
            if version is None:
                raise CommandError(f"{model.name} has no version {options['model_version']!r}")
        effective_from = None
        if options["effective_from"]:
            try:
                effective_from = datetime.fromisoformat(options["effective_from"])
            except ValueError:
                raise CommandError("--from: not an ISO 8601 date and time") from None
        try:
            price = price_set(
                model=model,
                version=version,
                input_per_million=options["input"],
                output_per_million=options["output"],
                cached_input_per_million=options["cached"],
                effective_from=effective_from,
            )
        except InvalidInput as exc:
            raise CommandError(f"{OPTION_OF.get(exc.field, exc.field)}: {exc.message}") from None
        self.stdout.write(f"{price} from {price.effective_from.isoformat()}")
