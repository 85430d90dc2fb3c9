"""Run the whole platform on this machine: daphne, Celery (worker + beat) and runworkers.

What ``make run`` ends with. It waits until /readyz says every default model has a
ready replica, prints where everything is, and on Ctrl-C (or SIGTERM) stops the
processes in order, letting runworkers drain its engines.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from core.embedded import VAR_DIR


class Command(BaseCommand):
    help = "Run daphne, Celery worker+beat and the engine supervisor until interrupted."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--ready-timeout", type=float, default=900.0)

    def handle(self, *args: Any, **options: Any) -> None:
        host, port = options["host"], options["port"]
        base = f"http://{host}:{port}"
        metrics_dir = VAR_DIR / "prometheus"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        log_dir = VAR_DIR / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir), PYTHONUNBUFFERED="1")
        python = sys.executable
        commands = {
            "engines": [python, "manage.py", "runworkers"],
            "celery": [python, "-m", "celery", "-A", "console", "worker", "-B", "--concurrency", "1",
                       "--loglevel", "WARNING", "--schedule", str(VAR_DIR / "celerybeat-schedule")],
            "web": [python, "-m", "daphne", "-b", host, "-p", str(port), "console.asgi:application"],
        }  # fmt: skip
        processes: dict[str, subprocess.Popen[bytes]] = {}
        stopping = False

        def stop(signum: int = 0, _frame: object = None) -> None:
            nonlocal stopping
            if stopping:
                return
            stopping = True
            self.stdout.write("\nstopping: web, celery, then engines (draining)…")
            for name in ("web", "celery", "engines"):
                process = processes.get(name)
                if process is not None and process.poll() is None:
                    process.send_signal(signal.SIGTERM)
                    try:
                        process.wait(timeout=settings.WORKER_DRAIN_TIMEOUT + 30)
                    except subprocess.TimeoutExpired:
                        process.kill()
            self.stdout.write("stopped. (PostgreSQL and Redis keep running: `make stop` stops them.)")

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        root = Path(settings.BASE_DIR)
        for name, command in commands.items():
            log = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it for its lifetime
            processes[name] = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
            self.stdout.write(f"started {name:8s} pid {processes[name].pid:<7d} log {log_dir / (name + '.log')}")

        self.stdout.write(f"waiting for {base}/readyz (engines take ~1 min to load)…")
        deadline = time.monotonic() + options["ready_timeout"]
        last: str = ""
        while not stopping:
            self._check_children(processes, stop)
            try:
                response = httpx.get(f"{base}/readyz", timeout=5)
                if response.status_code == 200:
                    break
                last = json.dumps(response.json().get("checks", {}))
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            if time.monotonic() > deadline:
                stop()
                raise CommandError(f"not ready after {options['ready_timeout']:.0f} s: {last}")
            time.sleep(2)
        if stopping:
            return
        self._announce(base)
        while not stopping:
            self._check_children(processes, stop)
            time.sleep(1)

    def _check_children(self, processes: dict[str, subprocess.Popen[bytes]], stop: Any) -> None:
        for name, process in processes.items():
            code = process.poll()
            if code is not None:
                stop()
                raise CommandError(f"{name} exited with code {code}; see var/logs/{name}.log")

    def _announce(self, base: str) -> None:
        credentials_path = Path(os.environ.get("BOOTSTRAP_CREDENTIALS", VAR_DIR / "bootstrap.json"))
        credentials = json.loads(credentials_path.read_text()) if credentials_path.exists() else {}
        key = credentials.get("demo_key", "(run manage.py create_api_key)")
        self.stdout.write(self.style.SUCCESS("\nThe inference platform is up."))
        self.stdout.write(f"  console   {base}/   login {credentials.get('admin_username', 'admin')} / "
                          f"{credentials.get('admin_password', '(see PLATFORM_ADMIN_PASSWORD)')}")  # fmt: skip
        self.stdout.write(f"  admin     {base}/admin/")
        self.stdout.write(f"  API       {base}/v1   (OpenAI-compatible; WebSocket at {base.replace('http', 'ws')}"
                          "/ws/v1/chat/completions)")  # fmt: skip
        self.stdout.write(f"  demo key  {key}")
        self.stdout.write(f"  metrics   {base}/metrics")
        self.stdout.write("  try:")
        self.stdout.write(f"    curl {base}/v1/chat/completions -H 'Authorization: Bearer {key}' \\")
        body = json.dumps(
            {
                "model": "smollm2-135m-instruct",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            }
        )
        self.stdout.write(f"      -H 'Content-Type: application/json' -d '{body}'")
        self.stdout.write("Ctrl-C stops it.")
