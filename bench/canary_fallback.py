"""A failing canary through a real gateway, with and without the fallback (issue 18).

The scenario the review measured: a canary failing 15 % of its requests at a 10 % share of
the traffic. Model ``canary-bench`` has v1 (stable) and v2 (the canary), each served by a
fake vLLM server (``tests/support/fake_engine.py``; v2's with ``fail_rate``); a canary of v2 starts
at 10 % (steps 10, 50, 100, ``--interval`` seconds each). Client threads send JSON chat
completions from many callers (so the split is the canary's) at about ``--rps`` requests a
second, while this process runs the real canary controller (``rollout.canary.canary_tick``
over ``rollout.served_requests``, as the Celery control worker does) and a persister moves
the usage stream and the failed attempts into PostgreSQL, until the canary is rolled back.

It runs the scenario twice in one run, with the gateway's fallback off
(``ENGINE_FALLBACK=false``) and on, and reports for each: the requests the clients sent
before the rollback, how many answered with an error, and the seconds from the canary's
start to its rollback. The target: no client-visible failure with the fallback, and the
rollback as fast as without it.

Isolation: the soak's database, Redis database and namespace (``bench/soak.py``).

    .venv/bin/python bench/canary_fallback.py                  # --fail-rate 0.15 --share 10 --rps 40

Writes bench/results/canary_fallback-<time>.json and .md (git-ignored) and prints the table;
docs/reliability.md has a run's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from mock_suite import ROOT, Server, free_port, report_start, spawn, wait_http, write_report
from soak import database_prepare, isolate, start_fake_engine

MODEL = "canary-bench"
HOST = "canary-bench"


def serve_versions(stable: str, canary: str) -> None:
    """v1 at weight 100 on ``stable``, v2 at 0 on ``canary``: running, one ready replica each."""
    from django.utils import timezone

    from registry.models import Deployment, Model, ModelVersion, Replica
    from rollout.models import Canary

    model, _ = Model.objects.get_or_create(name=MODEL, defaults={"task": "chat", "owner": "bench"})
    Canary.objects.filter(model=model, status__in=Canary.ACTIVE_STATUSES).update(status=Canary.Status.ROLLED_BACK)
    for label, endpoint, weight in (("v1", stable, 100), ("v2", canary, 0)):
        version, _ = ModelVersion.objects.update_or_create(
            model=model, version=label,
            defaults={"framework": "fake", "artifact_uri": f"local://bench/{MODEL}/{label}",
                      "artifact_sha256": "0" * 64, "artifact_size": 0, "status": "active"},
        )  # fmt: skip
        deployment = Deployment.objects.filter(version=version).first() or Deployment(version=version)
        deployment.status, deployment.replicas, deployment.traffic_weight = "running", 1, weight
        deployment.save()
        replica = Replica.objects.filter(deployment=deployment, host=HOST).first() or Replica(
            deployment=deployment, host=HOST
        )
        replica.endpoint, replica.state, replica.last_heartbeat = endpoint, "ready", timezone.now()
        replica.save()


def organisation_key() -> tuple[str, int]:
    from decimal import Decimal

    from accounts.services import api_key_create, organization_create

    huge = 10**12
    limits: dict[str, Any] = {"rate_limit_rpm": huge, "rate_limit_tpm": huge, "max_concurrent": 100_000,
                              "monthly_spend_cap": Decimal("10000000")}  # fmt: skip
    org = organization_create(name=f"Canary bench {uuid.uuid4().hex[:8]}", **limits)
    issued = api_key_create(organization=org, name="traffic", **limits)
    return issued.secret, issued.api_key.pk


def start_gateway(workdir: Path, *, fallback: bool) -> Server:
    from console.servers import server_command

    port = free_port()
    env = {
        "REPLICA_STALE_AFTER": "86400",  # the fake engines have no supervisor sending heartbeats
        "ROUTING_REFRESH_SECONDS": "0.5",
        "ENGINE_FALLBACK": "true" if fallback else "false",
        "PYTHONUNBUFFERED": "1",
    }
    name = f"gateway-fallback-{'on' if fallback else 'off'}"
    proc = spawn(server_command(sys.executable, host="127.0.0.1", port=port, server="uvicorn"), workdir / f"{name}.log",
                 env)  # fmt: skip
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, name)
    return Server(name, f"http://127.0.0.1:{port}", "", MODEL, proc, workdir / f"{name}.log")


def run_scenario(args: argparse.Namespace, workdir: Path, *, fallback: bool) -> dict[str, Any]:
    from django.db import connections

    from billing.usage import persist_failed_attempts, persist_usage_stream
    from registry.models import Model
    from rollout.canary import canary_create, canary_tick
    from rollout.models import Canary
    from rollout.served_requests import served_requests

    stable = start_fake_engine(workdir, f"stable-{fallback}", 4)
    canary_engine = start_fake_engine(workdir, f"canary-{fallback}", 4)
    httpx.post(f"{canary_engine.base}/_control", json={"fail_rate": args.fail_rate, "seed": 18}, timeout=5)
    serve_versions(stable.base, canary_engine.base)
    secret, _key_id = organisation_key()
    gateway = start_gateway(workdir, fallback=fallback)
    canary = canary_create(
        actor=None, model=Model.objects.get(name=MODEL), base_version="v1", canary_version="v2",
        steps=[args.share, 50, 100], interval_seconds=args.interval, min_samples=args.min_samples,
    )  # fmt: skip
    started = time.monotonic()
    statuses: Counter[int] = Counter()
    served: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def client(worker: int) -> None:
        period = args.workers / args.rps
        with httpx.Client(base_url=gateway.base, timeout=30) as http:
            while not stop.is_set():
                began = time.monotonic()
                response = http.post(
                    "/v1/chat/completions",
                    headers={"authorization": f"Bearer {secret}"},
                    json={"model": MODEL, "messages": [{"role": "user", "content": f"hi {uuid.uuid4().hex}"}],
                          "user": f"caller-{uuid.uuid4().hex}"},
                )  # fmt: skip
                with lock:
                    statuses[response.status_code] += 1
                    served[response.headers.get("x-model-version", "?")] += 1
                time.sleep(max(0.0, period - (time.monotonic() - began)))

    rolled_back_after: float | None = None
    with ThreadPoolExecutor(args.workers) as pool:
        for worker in range(args.workers):
            pool.submit(client, worker)
        try:
            while time.monotonic() - started < args.timeout:
                time.sleep(1.0)
                persist_usage_stream()
                persist_failed_attempts()
                canary_tick(load_samples=served_requests)
                canary.refresh_from_db()
                if canary.status == Canary.Status.ROLLED_BACK:
                    rolled_back_after = time.monotonic() - started
                    break
        finally:
            stop.set()
    with lock:
        sent = sum(statuses.values())
        failed = sum(n for status, n in statuses.items() if status != 200)
    last = canary.decisions.order_by("-at", "-id").first()
    for server in (gateway, stable, canary_engine):
        server.stop()
    connections.close_all()
    return {
        "fallback": fallback,
        "requests": sent,
        "client_errors": failed,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "served": dict(served),
        "rolled_back_after_s": rolled_back_after,
        "reasons": last.reasons if last is not None else [],
        "interval_s": args.interval,
        "window_start": (canary.created_at - timedelta(seconds=1)).isoformat(),
    }


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"A canary failing {args.fail_rate:.0%} of its requests at {args.share} % of ~{args.rps:g} req/s "
        f"(interval {args.interval} s, min_samples {args.min_samples}):",
        "",
        "| fallback | requests until rollback | client-visible errors | rolled back after | canary's requests |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        after = f"{row['rolled_back_after_s']:.1f} s" if row["rolled_back_after_s"] is not None else "not rolled back"
        lines.append(
            f"| {'on' if row['fallback'] else 'off'} | {row['requests']:,} | {row['client_errors']:,} | {after} | "
            f"{row['served'].get('v2', 0):,} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fail-rate", type=float, default=0.15)
    parser.add_argument("--share", type=int, default=10, help="the canary's first step, percent")
    parser.add_argument("--rps", type=float, default=40.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--interval", type=int, default=15, help="seconds per canary step")
    parser.add_argument("--min-samples", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=300.0, help="give up on a scenario after this long")
    args = parser.parse_args()
    isolate()
    report = report_start(args)
    report["command"] = " ".join(["bench/canary_fallback.py", *sys.argv[1:]])
    workdir = ROOT / "var" / "soak" / f"canary-{time.strftime('%Y%m%dT%H%M%S')}"
    workdir.mkdir(parents=True)
    database_prepare()
    rows = []
    try:
        for fallback in (False, True):
            print(f"fallback {'on' if fallback else 'off'}: running until the canary is rolled back", flush=True)
            rows.append(run_scenario(args, workdir, fallback=fallback))
    finally:
        from registry.models import Deployment

        with contextlib.suppress(Exception):
            Deployment.objects.filter(version__model__name=MODEL).update(status="stopped")
    report["rows"] = rows
    table = markdown(rows, args)
    print("\n" + table + "\n", flush=True)
    path = write_report("canary_fallback", report)
    path.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {path}", flush=True)
    on = next(r for r in rows if r["fallback"])
    raise SystemExit(0 if on["client_errors"] == 0 and on["rolled_back_after_s"] is not None else 1)


if __name__ == "__main__":
    main()
