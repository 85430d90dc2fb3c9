"""Serve the Open Inference Protocol over gRPC (serving.predict.grpc_server) until interrupted."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from argparse import ArgumentParser
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from serving.predict.grpc_server import serve


class Command(BaseCommand):
    help = "Serve small models over the Open Inference Protocol's gRPC service (tritonclient.grpc, KServe)."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=settings.GRPC_PORT)

    def handle(self, *args: Any, **options: Any) -> None:
        async def main() -> None:
            task = asyncio.ensure_future(serve(options["host"], options["port"]))
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, task.cancel)
            self.stdout.write(f"gRPC inference service on {options['host']}:{options['port']}")
            self.stdout.flush()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        import uvloop

        uvloop.run(main())
