"""Refused predictions against a 1-request-a-minute key, through a real gateway (issue 34, defect 4).

The audit's measurement: a key limited to one request a minute sends predictions whose tensors
are refused (400), 16 of about 4 MB, 4 at a time, while another client probes
``GET /v2/health/live`` every ~20 ms. Before the fix (88f9c80) a raw BYTES tensor was split
element by element on the event loop and only then compared with its shape, and the 400 came
before admission: the probe went from p50 4 ms / max 21 ms to p50 330 ms / max 1,080 ms, all 16
were answered 400 and none counted against the key.

Model ``refused-<tag>``: one BYTES input ``text`` of shape [-1] (``tests/faults/input/
test_predict.py``'s ``TEXT``), served by that test's fake predict worker (an HTTP
server in this process that counts what reaches it), registered with its
``register_predict_model``. The two loads (Triton's binary extension, under
``API_MAX_BODY_BYTES``):

- **a**: 500,000 BYTES values of 4 bytes (4,000,000 bytes) declared as shape [500,001]: the
  contents disagree with the shape only at their end, so a reader must go through all of them;
- **b**: shape [1] holding 1,000,000 empty BYTES values (4,000,000 bytes).

For each load a new key limited to 1 request a minute (a grant of 1 is within any plan, so the
organisation's plan is left as it is) sends the 16 bodies, ``--concurrency`` at a time, while a
probe process (its own, so the load's client does not slow it) sends ``GET /v2/health/live``
every ``--spacing-ms`` over one kept-alive connection; then that key sends one valid prediction:
a 429 says the refused ones were counted against it. Before the loads, the probe runs
``--probes`` times on the idle gateway, and a key with the default limits checks that the valid
prediction is answered 200 by the worker.

Isolation: the soak's database, Redis database and namespace (``bench/soak.py``); each run makes
its own organisation and model, and stops the model's deployment at the end.

    .venv/bin/python bench/refused_predictions.py                # 3 rounds of idle, a, b
    .venv/bin/python bench/refused_predictions.py --rounds 1

Writes bench/results/refused_predictions-<UTC date>.md and prints the table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from mock_suite import ROOT, Server, free_port, spawn, wait_http
from soak import database_prepare, isolate

PROBE = "/v2/health/live"
ELEMENTS_A = 500_000  # of 4 bytes each, after their 4-byte lengths: 4,000,000 bytes
ELEMENTS_B = 1_000_000  # empty: 4,000,000 bytes
VALID = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]}


# --- the probe, in a process of its own ----------------------------------------------------------


def _probe(url: str, spacing: float, count: int, started: Event, stop: Event, out: Connection) -> None:
    """``GET url`` every ``spacing`` seconds until ``count`` probes were made (0: until ``stop``);
    sends back each probe's latency (seconds) and how many did not answer 200."""
    latencies: list[float] = []
    failed = 0
    with httpx.Client(timeout=30) as http:
        http.get(url)  # the connection opened before anything is measured
        started.set()
        while not stop.is_set() and (count == 0 or len(latencies) < count):
            began = time.perf_counter()
            try:
                ok = http.get(url).status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - began)
            failed += not ok
            time.sleep(spacing)
    out.send((latencies, failed))
    out.close()


@dataclass
class Probe:
    url: str
    spacing: float
    count: int = 0
    _stop: Event = field(init=False)
    _proc: Any = field(init=False)
    _receive: Connection = field(init=False)

    def start(self) -> None:
        context = multiprocessing.get_context("fork")
        started, self._stop = context.Event(), context.Event()
        self._receive, send = context.Pipe(duplex=False)
        self._proc = context.Process(
            target=_probe, args=(self.url, self.spacing, self.count, started, self._stop, send), daemon=True
        )
        self._proc.start()
        send.close()
        if not started.wait(30):
            raise SystemExit(f"the probe could not reach {self.url}")

    def finish(self) -> tuple[list[float], int]:
        """What it measured: once it made its ``count`` probes, or now when it probes until stopped."""
        if self.count == 0:
            self._stop.set()
        latencies, failed = self._receive.recv()
        self._proc.join(10)
        return latencies, failed


def percentiles(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    if not ordered:
        return {"p50": float("nan"), "p95": float("nan"), "max": float("nan")}
    return {
        "p50": statistics.median(ordered) * 1000,
        "p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))] * 1000,
        "max": ordered[-1] * 1000,
    }


# --- the platform's side -------------------------------------------------------------------------


def setup(endpoint: str, model: str) -> tuple[int, str]:
    """The model on the fake worker, an organisation (its tier's plan) and a key with the
    default limits; returns the organisation's id and that key's secret."""
    from accounts.services import api_key_create, organization_create
    from tests.faults.input.test_predict import TEXT, register_predict_model

    register_predict_model(model, endpoint, [TEXT])
    org = organization_create(name=f"Refused predictions {model}")
    return org.pk, api_key_create(organization=org, name="check").secret


def one_rpm_key(org_id: int, name: str) -> str:
    from accounts.models import Organization
    from accounts.services import api_key_create

    organization = Organization.objects.get(pk=org_id)
    return api_key_create(organization=organization, name=name, rate_limit_rpm=1).secret


def retire(model: str) -> None:
    from registry.models import Deployment, Replica

    Replica.objects.filter(deployment__version__model__name=model).update(state="stopped")
    Deployment.objects.filter(version__model__name=model).update(status="stopped")


def start_gateway(workdir: Path) -> Server:
    from console.servers import server_command

    port = free_port()
    env = {
        "REPLICA_STALE_AFTER": "86400",  # the fake worker has no supervisor sending heartbeats
        "ROUTING_REFRESH_SECONDS": "0.5",
        "PYTHONUNBUFFERED": "1",
    }
    log = workdir / "gateway.log"
    proc = spawn(server_command(sys.executable, host="127.0.0.1", port=port, server="uvicorn", processes=1), log,
                 env)  # fmt: skip
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, "gateway")
    return Server("gateway", f"http://127.0.0.1:{port}", "", "", proc, log)


def wait_ready(base: str, model: str, secret: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = httpx.get(f"{base}/v2/models/{model}/ready", headers={"authorization": f"Bearer {secret}"})
        if response.status_code == 200:
            return
        time.sleep(0.2)
    raise SystemExit(f"the gateway did not route {model} within {timeout:.0f} s")


# --- the loads -----------------------------------------------------------------------------------


def bodies() -> dict[str, tuple[str, bytes, dict[str, str]]]:
    """Each load's name, description and binary-extension body with its headers."""
    from tests.faults.input.test_predict import TEXT, binary, bytes_elements

    a = binary([({**TEXT, "shape": [ELEMENTS_A + 1]}, bytes_elements(ELEMENTS_A, b"abcd"))])
    b = binary([({**TEXT, "shape": [1]}, bytes_elements(ELEMENTS_B))])
    return {
        "a": (f"{ELEMENTS_A:,} BYTES values declared as [{ELEMENTS_A + 1:,}] ({len(a[0]):,} B)", *a),
        "b": (f"[1] holding {ELEMENTS_B:,} empty BYTES values ({len(b[0]):,} B)", *b),
    }


def send_load(
    base: str, model: str, secret: str, body: bytes, headers: dict[str, str], *, requests: int, concurrency: int
) -> Counter[int]:
    statuses: Counter[int] = Counter()
    lock = threading.Lock()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(base_url=base, timeout=120, limits=limits) as http:

        def one(_: int) -> None:
            try:
                status = http.post(f"/v2/models/{model}/infer", content=body,
                                   headers={"authorization": f"Bearer {secret}", **headers}).status_code  # fmt: skip
            except httpx.HTTPError:
                status = 0  # no answer
            with lock:
                statuses[status] += 1

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(requests)))
    return statuses


def valid_prediction(base: str, model: str, secret: str) -> int:
    response = httpx.post(f"{base}/v2/models/{model}/infer", json=VALID,
                          headers={"authorization": f"Bearer {secret}"}, timeout=30)  # fmt: skip
    return response.status_code


def run_round(
    args: argparse.Namespace, base: str, model: str, org_id: int, worker: Any, round_: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    spacing = args.spacing_ms / 1000
    probe = Probe(base + PROBE, spacing, count=args.probes)
    probe.start()
    latencies, failed = probe.finish()
    rows.append({"round": round_, "load": "idle", "probes": len(latencies), "probe_failed": failed,
                 "latencies": latencies, **percentiles(latencies)})  # fmt: skip
    for name, (description, body, headers) in bodies().items():
        secret = one_rpm_key(org_id, f"rpm1-{name}-{round_}")
        reached = worker.requests
        probe = Probe(base + PROBE, spacing)
        probe.start()
        began = time.perf_counter()
        statuses = send_load(base, model, secret, body, headers, requests=args.requests, concurrency=args.concurrency)
        took = time.perf_counter() - began
        latencies, failed = probe.finish()
        after = valid_prediction(base, model, secret)
        rows.append({
            "round": round_, "load": name, "description": description, "probes": len(latencies),
            "probe_failed": failed, "latencies": latencies, **percentiles(latencies), "seconds": took,
            "statuses": dict(sorted(statuses.items())), "valid_after": after,
            "reached_worker": worker.requests - reached,
        })  # fmt: skip
        print(f"round {round_} load {name}: {dict(sorted(statuses.items()))}, then a valid one: {after}", flush=True)
    return rows


# --- the report ----------------------------------------------------------------------------------


def all_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per load over every round: the probes pooled, the statuses and seconds summed;
    the valid request after each load as its statuses, e.g. ``429: 3``."""
    pooled: list[dict[str, Any]] = []
    for load in dict.fromkeys(row["load"] for row in rows):
        mine = [row for row in rows if row["load"] == load]
        latencies = [x for row in mine for x in row["latencies"]]
        row: dict[str, Any] = {
            "round": "all", "load": load, "probes": len(latencies), "latencies": latencies,
            "probe_failed": sum(r["probe_failed"] for r in mine), **percentiles(latencies),
        }  # fmt: skip
        if load != "idle":
            statuses: Counter[int] = Counter()
            for r in mine:
                statuses.update(r["statuses"])
            row |= {"seconds": sum(r["seconds"] for r in mine), "statuses": dict(sorted(statuses.items())),
                    "valid_after": Counter(r["valid_after"] for r in mine),
                    "reached_worker": sum(r["reached_worker"] for r in mine)}  # fmt: skip
        pooled.append(row)
    return pooled


def markdown(rows: list[dict[str, Any]], heading: list[str], args: argparse.Namespace) -> str:
    lines = [
        *heading,
        "",
        f"Probe: `GET {PROBE}` every {args.spacing_ms:g} ms on one kept-alive connection, from its own process; "
        f"idle: {args.probes} probes; under a load: for as long as the load runs. Each load: {args.requests} "
        f"binary-extension bodies, {args.concurrency} at a time, from a new key limited to 1 request a minute; "
        "then one valid prediction from that key (429: the refused ones were counted against it).",
        "",
    ]
    descriptions = {row["load"]: row["description"] for row in rows if "description" in row}
    lines += [f"- load {name}: {text}" for name, text in descriptions.items()]
    lines += [
        "",
        "| round | load | probes | probe p50 | probe p95 | probe max | load took | statuses (of "
        f"{args.requests} a round) | valid request after | reached the worker |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        failed = f" ({row['probe_failed']} failed)" if row["probe_failed"] else ""
        timing = f"{row['p50']:.1f} ms | {row['p95']:.1f} ms | {row['max']:.1f} ms"
        if row["load"] == "idle":
            lines.append(f"| {row['round']} | idle | {row['probes']}{failed} | {timing} |  |  |  |  |")
            continue
        statuses = ", ".join(f"{status or 'no answer'}: {n}" for status, n in row["statuses"].items())
        if isinstance(row["valid_after"], Counter):
            after = ", ".join(f"{status}: {n}" for status, n in sorted(row["valid_after"].items()))
        else:
            after = f"{row['valid_after']} ({'counted' if row['valid_after'] == 429 else 'not counted'})"
        lines.append(
            f"| {row['round']} | {row['load']} | {row['probes']}{failed} | {timing} | {row['seconds']:.2f} s | "
            f"{statuses} | {after} | {row['reached_worker']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="idle probe, load a, load b: this many times (then a row of each over all rounds)",
    )
    parser.add_argument("--probes", type=int, default=200, help="idle probes")
    parser.add_argument("--spacing-ms", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=16, help="bodies per load")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    started = datetime.now(UTC)
    command = " ".join([".venv/bin/python bench/refused_predictions.py", *sys.argv[1:]])
    load1, load5, _ = os.getloadavg()
    heading = [
        f"# Refused predictions on a 1-RPM key (issue 34, defect 4): {started:%Y-%m-%d %H:%M} UTC",
        "",
        f"- machine: {platform.node()}, nproc {os.cpu_count()}, load average {load1:.2f} / {load5:.2f} (1 / 5 min) "
        "at the start",
        f"- commit: {_commit()}",
        f"- command: `{command}`",
    ]
    print("\n".join(heading), flush=True)
    isolate()
    database_prepare()

    from tests.faults.input.test_predict import WorkerServer

    worker = WorkerServer()
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    model = f"refused-{uuid.uuid4().hex[:8]}"
    org_id, check_key = setup(f"http://127.0.0.1:{worker.server_address[1]}", model)
    workdir = ROOT / "var" / "soak" / f"refused-{started:%Y%m%dT%H%M%S}"
    workdir.mkdir(parents=True)
    gateway = start_gateway(workdir)
    rows: list[dict[str, Any]] = []
    try:
        wait_ready(gateway.base, model, check_key)
        status = valid_prediction(gateway.base, model, check_key)
        if status != 200 or worker.requests != 1:
            raise SystemExit(f"the valid prediction was answered {status} ({worker.requests} reached the worker)")
        for round_ in range(1, args.rounds + 1):
            rows += run_round(args, gateway.base, model, org_id, worker, round_)
        if args.rounds > 1:
            rows += all_rounds(rows)
    finally:
        gateway.stop()
        worker.shutdown()
        retire(model)
    table = markdown(rows, heading, args)
    print("\n" + table + "\n", flush=True)
    out = ROOT / "bench" / "results" / f"refused_predictions-{started:%Y-%m-%d}.md"
    out.write_text(table + "\n")
    print(f"wrote {out.relative_to(ROOT)}; the gateway's log is in {workdir.relative_to(ROOT)}", flush=True)


def _commit() -> str:
    import subprocess

    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
