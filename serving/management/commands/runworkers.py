"""Run this host's engine replicas (vLLM OpenAI servers) and keep them healthy."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from serving.supervisor.host import Supervisor
from serving.supervisor.lease import HostLeaseHeld

# libpq options for the supervisor's connection: a database that vanishes (or a network that
# drops its packets) fails the query within seconds instead of hanging the loop for minutes.
FAIL_FAST_OPTIONS = {"connect_timeout": 3, "tcp_user_timeout": 10_000}


def use_one_fail_fast_connection() -> None:
    """Give this process one plain, long-lived database connection instead of the pool.

    The supervisor is one thread making a few queries a second. During an outage the pool
    would make each of them wait its whole timeout for a connection (10 s) and then come
    back on its own reconnect backoff, long after the database is; a plain connection fails
    at once and reconnects on the next try. Call before the first query.
    """
    for alias in connections:
        settings_dict = connections[alias].settings_dict
        options = settings_dict.setdefault("OPTIONS", {})
        options.pop("pool", None)
        for name, value in FAIL_FAST_OPTIONS.items():
            options.setdefault(name, value)
        settings_dict["CONN_MAX_AGE"] = None  # kept open between loops; dropped after an error


class Command(BaseCommand):
    help = "Start, watch, restart and drain the vLLM engine replicas wanted on this host."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--host", default=settings.WORKER_HOST, help="this host's name in the registry")
        parser.add_argument(
            "--slots", default=",".join(settings.WORKER_SLOTS), help="CPU cores (or GPU indices), comma-separated"
        )
        parser.add_argument(
            "--models",
            default="",
            help="serve only deployments of these models (public names, comma-separated); default: every model",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        def report(message: str) -> None:
            self.stdout.write(f"[runworkers] {message}")
            self.stdout.flush()

        use_one_fail_fast_connection()
        slots = [s for s in options["slots"].split(",") if s]
        models = frozenset(m for m in options["models"].split(",") if m) or None
        supervisor = Supervisor(host=options["host"], slots=slots, models=models, report=report)
        try:
            supervisor.run()
        except HostLeaseHeld as exc:  # nothing was started: one sentence, exit status 1
            raise CommandError(f"runworkers: {exc}") from None
        if supervisor.lease_lost:
            raise CommandError(f"runworkers: another supervisor took host {supervisor.host} over; stopped")
