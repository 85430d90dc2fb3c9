"""Run this host's engine replicas (vLLM OpenAI servers) and keep them healthy."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from serving.supervisor import Supervisor


class Command(BaseCommand):
    help = "Start, watch, restart and drain the vLLM engine replicas wanted on this host."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--host", default=settings.WORKER_HOST, help="this host's name in the registry")
        parser.add_argument(
            "--slots", default=",".join(settings.WORKER_SLOTS), help="CPU cores (or GPU indices), comma-separated"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        def report(message: str) -> None:
            self.stdout.write(f"[runworkers] {message}")
            self.stdout.flush()

        slots = [s for s in options["slots"].split(",") if s]
        Supervisor(host=options["host"], slots=slots, report=report).run()
