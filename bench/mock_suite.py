"""What the gateway adds, measured against a fast mock engine, beside LiteLLM's proxy.

One run, on this machine, with ``wrk`` as the client (a C load generator, one thread):

- **overhead**: for JSON and for short streams (``--tokens`` chunks), at each concurrency,
  the mock called directly, through the gateway (API key auth, rate and token limits, a
  spend cap, routing, metering all on), and through LiteLLM's proxy (one worker, no
  database) when its virtualenv exists, the three sides alternating round by round.
  Requests/s, latency p50/p99/p99.9, and each server's CPU per request (process CPU time
  over the run / requests: the figure that travels between machines);
- **scale-out** (``--scale-out``): two gateway processes, each with its own wrk, against one;
- **soak** (``--soak N``): one gateway's RSS, open files, sockets, database and Redis
  connections and asyncio tasks after 1,000 requests and after N.

Needs the embedded services (``make services``) and a migrated database (``make bootstrap``
or ``manage.py migrate``); it registers a model ``bench-mock`` whose one replica is the
mock, and a key of an organisation ``Bench`` with limits far above what a run reaches.

    .venv/bin/python bench/mock_suite.py                       # overhead, all sides
    .venv/bin/python bench/mock_suite.py --concurrency 1 16 --kinds json --rounds 1
    .venv/bin/python bench/mock_suite.py --only scale-out soak --soak 100000

Writes bench/results/mock_suite-<time>.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
LITELLM_VENV = ROOT / "bench" / ".venv-litellm"
WRK_SCRIPT = ROOT / "bench" / "wrk" / "post.lua"
MODEL = "bench-mock"
BENCH_HOST = "bench"
ERROR_FIELDS = ("connect_errors", "read_errors", "write_errors", "timeouts", "status_errors")
# "{n}": each request of a wrk run is a new prompt (bench/wrk/post.lua), as a service's traffic is:
# nothing a gateway keeps from one prompt to the next (its prompt pieces' token ids) is reused whole.
MESSAGES = [{"role": "user", "content": "Say hello to the benchmark, briefly please. ({n})"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} did not answer at {url} within {timeout:.0f} s")


@dataclass
class Server:
    name: str
    base: str  # http://host:port
    key: str
    model: str
    proc: subprocess.Popen[bytes]
    log: Path

    def cpu_seconds(self) -> float:
        """CPU time of the server's process tree so far (user + system)."""
        total = 0.0
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                with _gone_ok():
                    t = p.cpu_times()
                    total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def _gone_ok() -> contextlib.suppress:
    return contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied)


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


# --- the platform's side ------------------------------------------------------------------


def report_start(args: argparse.Namespace) -> dict[str, Any]:
    """A results report's heading: when, where and with what arguments the run started."""
    return {
        "started": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.node(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "args": vars(args),
    }  # fmt: skip


def write_report(name: str, report: dict[str, Any]) -> Path:
    """bench/results/<name>-<start time>.json (git-ignored); returns the path."""
    started = datetime.fromisoformat(report["started"])
    out = ROOT / "bench" / "results" / f"{name}-{started:%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return out


def isolate(*, database: str, redis_db: int, namespace: str, artifacts: str) -> None:
    """Point this process and every child at a benchmark's own database (on the same
    PostgreSQL server), Redis database and key namespace, and artifact store (under var/);
    call before Django is set up."""
    from urllib.parse import urlsplit, urlunsplit

    from core import embedded

    database_url = urlsplit(os.environ.get("DATABASE_URL") or embedded.database_url())
    redis_url = urlsplit(os.environ.get("REDIS_URL") or embedded.redis_url())
    own_redis = urlunsplit(redis_url._replace(path=f"/{redis_db}"))
    os.environ.update({
        "DJANGO_SETTINGS_MODULE": "console.settings",
        "DATABASE_URL": urlunsplit(database_url._replace(path=f"/{database}")),
        "REDIS_URL": own_redis,
        "CELERY_BROKER_URL": own_redis,
        "REDIS_NAMESPACE": namespace,
        "ARTIFACT_ROOT": str(embedded.VAR_DIR / artifacts),
    })  # fmt: skip
    # One gateway process: its gauges are its own, not a host's sum.
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def database_prepare(database: str) -> None:
    """Create a benchmark's own database (``isolate`` points DATABASE_URL at it) if it is
    missing, set Django up on it and migrate."""
    from urllib.parse import urlsplit, urlunsplit

    import psycopg
    from psycopg import sql

    url = urlsplit(os.environ["DATABASE_URL"])
    with psycopg.connect(urlunsplit(url._replace(path="/postgres")), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database]).fetchone() is None:
            print(f"creating the database {database}", flush=True)
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    django_setup()
    from django.core.management import call_command

    print(f"migrating {database}", flush=True)
    call_command("migrate", verbosity=0)


def django_setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()


def bench_key() -> str:
    """A fresh key of org ``Bench`` (earlier ones revoked), limits far above any run, with a spend cap."""
    django_setup()
    from accounts.models import ApiKey
    from accounts.services import api_key_create, api_key_revoke, organization_get_or_create, organization_update

    org = organization_get_or_create(name="Bench")
    for old in ApiKey.objects.filter(organization=org, name="bench", revoked_at__isnull=True):
        api_key_revoke(api_key=old)
    huge = 10**12
    # A key is admitted only within its organisation's plan: the organisation's own limits
    # lift the paid plan's ceilings (10,000 requests a minute) for the benchmark.
    organization_update(
        organization=org, rate_limit_rpm=huge, rate_limit_tpm=huge, max_concurrent=100_000,
        monthly_token_quota=huge * 1000, monthly_spend_cap=Decimal("10000000"),
    )  # fmt: skip
    issued = api_key_create(
        organization=org, name="bench", rate_limit_rpm=huge, rate_limit_tpm=huge, max_concurrent=100_000,
        monthly_token_quota=huge * 1000, monthly_spend_cap=Decimal("10000000"),
    )  # fmt: skip
    return issued.secret


def setup_platform(mock_base: str, tokenizer: bool) -> str:
    """Model ``bench-mock`` served by the mock, priced; a fresh bench key. Returns the key."""
    django_setup()
    from django.utils import timezone

    from billing.models import Price
    from billing.services import price_set
    from registry.bundled import BUNDLED_MODELS
    from registry.models import Deployment, Model, ModelVersion, Replica

    artifact = f"local://bench/{MODEL}"
    if tokenizer:
        chat = next(b for b in BUNDLED_MODELS if b.task == "chat")
        bundled = ModelVersion.objects.filter(model__name=chat.name, version=chat.version).first()
        if bundled is None:
            raise SystemExit("the bundled chat model is not imported: run `make bootstrap` (or pass --no-tokenizer)")
        artifact = bundled.artifact_uri
    model, _ = Model.objects.get_or_create(name=MODEL, defaults={"task": "chat", "owner": "bench"})
    version, _ = ModelVersion.objects.update_or_create(
        model=model, version="1",
        defaults={"framework": "mock", "artifact_uri": artifact, "artifact_sha256": "0" * 64, "artifact_size": 0,
                  "config": {"max_seq_len": 2048}, "status": "active"},
    )  # fmt: skip
    deployment = Deployment.objects.filter(version=version).first() or Deployment(version=version)
    deployment.status, deployment.replicas, deployment.traffic_weight = "running", 1, 100
    deployment.save()
    replica = Replica.objects.filter(deployment=deployment, host=BENCH_HOST).first()
    if replica is None:
        replica = Replica(deployment=deployment, host=BENCH_HOST)
    replica.endpoint, replica.state, replica.last_heartbeat = mock_base, "ready", timezone.now()
    replica.save()
    if not Price.objects.filter(model=model).exists():
        price_set(model=model, input_per_million="0.10", output_per_million="0.30")
    return bench_key()


def retire_mock_model() -> None:
    """Stop the bench model's deployment, so no supervisor ever tries to start it for real
    (its one replica is the mock, with no heartbeat once the run is over)."""
    from registry.models import Deployment, Replica

    Replica.objects.filter(deployment__version__model__name=MODEL, host=BENCH_HOST).update(state="stopped")
    Deployment.objects.filter(version__model__name=MODEL).update(status="stopped")


def start_gateway(server: str, workdir: Path, key: str) -> Server:
    port = free_port()
    env = {
        "DJANGO_SETTINGS_MODULE": "console.settings",
        "REPLICA_STALE_AFTER": "31536000",  # the mock has no supervisor sending heartbeats
        # Backpressure caps requests queued per replica (128) for a real engine; the mock has no
        # queue, and at concurrency 256 the cap would answer 429s instead of measuring the path.
        "BACKPRESSURE_PAID_PER_REPLICA": "100000",
        "PYTHONUNBUFFERED": "1",
    }
    from console.servers import server_command

    cmd = server_command(sys.executable, host="127.0.0.1", port=port, server=server)
    log = workdir / f"gateway-{port}.log"
    proc = spawn(cmd, log, env)
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, f"gateway ({server})")
    return Server(f"gateway ({server})", f"http://127.0.0.1:{port}", key, MODEL, proc, log)


# --- the other sides -----------------------------------------------------------------------


def start_mock(workdir: Path, tokens: int) -> Server:
    port = free_port()
    log = workdir / "mock.log"
    proc = spawn(
        [sys.executable, str(ROOT / "bench" / "mock_openai.py"), "--port", str(port), "--tokens", str(tokens)], log
    )
    wait_http(f"http://127.0.0.1:{port}/health", proc, "mock engine")
    return Server("direct (mock)", f"http://127.0.0.1:{port}", "", "mock", proc, log)


def start_litellm(workdir: Path, mock_base: str) -> Server | None:
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        print(f"  LiteLLM is not installed ({exe} missing; `make bench` installs it): skipped", flush=True)
        return None
    port = free_port()
    master = "sk-" + secrets.token_hex(16)
    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: mock\n"
        "    litellm_params:\n"
        "      model: openai/mock\n"
        f"      api_base: {mock_base}/v1\n"
        "      api_key: mock\n"
        "general_settings:\n"
        f"  master_key: {master}\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "NO_DOCS": "True"}
    log = workdir / "litellm.log"
    proc = spawn(
        [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"], log, env
    )
    wait_http(f"http://127.0.0.1:{port}/health/liveliness", proc, "LiteLLM proxy", timeout=180)
    return Server("LiteLLM proxy", f"http://127.0.0.1:{port}", master, "mock", proc, log)


# --- the client ----------------------------------------------------------------------------


def body_file(workdir: Path, server: Server, kind: str) -> Path:
    body: dict[str, Any] = {"model": server.model, "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0}
    if kind == "sse":
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    path = workdir / f"body-{server.model}-{kind}.json"
    path.write_text(json.dumps(body))
    return path


def check(server: Server, workdir: Path, kind: str) -> None:
    """One request by hand: the side answers 200 with what a client expects."""
    headers = {"Content-Type": "application/json"}
    if server.key:
        headers["Authorization"] = f"Bearer {server.key}"
    r = httpx.post(
        f"{server.base}/v1/chat/completions",
        content=body_file(workdir, server, kind).read_bytes(), headers=headers, timeout=30,
    )  # fmt: skip
    if r.status_code != 200 or (kind == "sse" and "[DONE]" not in r.text):
        raise SystemExit(f"{server.name} answered {r.status_code}: {r.text[:500]}")


def wrk_env(server: Server, workdir: Path, kind: str) -> dict[str, str]:
    """bench/wrk/post.lua's environment: the body, the key, and a run of its own (``WRK_RUN``)."""
    return {**os.environ, "WRK_BODY_FILE": str(body_file(workdir, server, kind)), "WRK_KEY": server.key,
            "WRK_RUN": uuid.uuid4().hex[:12]}  # fmt: skip


def wrk(server: Server, workdir: Path, kind: str, concurrency: int, duration: float) -> dict[str, Any]:
    env = wrk_env(server, workdir, kind)
    cmd = [
        "wrk", "-t1", f"-c{concurrency}", f"-d{int(duration)}s", "--timeout", "30s", "-s", str(WRK_SCRIPT),
        f"{server.base}/v1/chat/completions",
    ]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("WRK_JSON "))
    return dict(json.loads(line[len("WRK_JSON ") :]))


def measure(server: Server, workdir: Path, kind: str, concurrency: int, duration: float) -> dict[str, Any]:
    cpu0 = server.cpu_seconds()
    result = wrk(server, workdir, kind, concurrency, duration)
    cpu = server.cpu_seconds() - cpu0
    n = result["requests"]
    errors = sum(result[k] for k in ERROR_FIELDS)
    return {
        "side": server.name, "kind": kind, "concurrency": concurrency, "requests": n,
        "rps": n / (result["duration_us"] / 1e6), "p50_ms": result["p50_us"] / 1000, "p99_ms": result["p99_us"] / 1000,
        "p999_ms": result["p999_us"] / 1000, "errors": errors, "cpu_ms_per_request": cpu * 1000 / n if n else None,
    }  # fmt: skip


# --- the parts of the suite ----------------------------------------------------------------


def med(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else float("nan")


def describe(row: dict[str, Any]) -> str:
    return (
        f"{row['rps']:8.0f} req/s  p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms"
        f"  p99.9 {row['p999_ms']:7.2f} ms  cpu/req {row['cpu_ms_per_request'] or 0:.3f} ms  errors {row['errors']}"
    )


def overhead(args: argparse.Namespace, sides: list[Server], workdir: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kind in args.kinds:
        for side in sides:
            check(side, workdir, kind)
            wrk(side, workdir, kind, 16, 2)  # warm up: connections, caches, tokenizer
        for concurrency in args.concurrency:
            for rnd in range(args.rounds):
                order = sides[rnd % len(sides) :] + sides[: rnd % len(sides)]
                for side in order:
                    row = measure(side, workdir, kind, concurrency, args.duration)
                    row["round"] = rnd
                    rows.append(row)
                    print(f"  {kind:4} c={concurrency:<3} {side.name:18} {describe(row)}", flush=True)
    return rows


def overhead_tables(rows: list[dict[str, Any]], sides: list[str]) -> str:
    gateway = next(s for s in sides if s.startswith("gateway"))
    lines = [
        "| kind | c | " + " | ".join(f"{s} req/s" for s in sides) + " | gateway / LiteLLM |",
        "|---" * (len(sides) + 3) + "|",
    ]
    cells = sorted({(r["kind"], r["concurrency"]) for r in rows}, key=lambda x: (x[0] != "json", x[1]))
    for kind, c in cells:
        at = {s: [r for r in rows if r["kind"] == kind and r["concurrency"] == c and r["side"] == s] for s in sides}
        rps = {s: med(at[s], "rps") for s in sides}
        ratio = f"{rps[gateway] / rps['LiteLLM proxy']:.1f}x" if "LiteLLM proxy" in rps else "-"
        lines.append(f"| {kind} | {c} | " + " | ".join(f"{rps[s]:.0f}" for s in sides) + f" | {ratio} |")
    lines += [
        "",
        "| kind | c | side | p50 ms | p99 ms | p99.9 ms | CPU ms/request | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, c in cells:
        for s in sides:
            at_s = [r for r in rows if r["kind"] == kind and r["concurrency"] == c and r["side"] == s]
            figures = " | ".join(f"{med(at_s, k):.2f}" for k in ("p50_ms", "p99_ms", "p999_ms"))
            cpu = med(at_s, "cpu_ms_per_request")
            lines.append(f"| {kind} | {c} | {s} | {figures} | {cpu:.3f} | {sum(r['errors'] for r in at_s)} |")
    direct = "direct (mock)"
    lines += ["", "Added latency over the mock called directly (medians of rounds):", "",
              "| kind | c | side | +p50 ms | +p99 ms | +p99.9 ms |", "|---|---|---|---|---|---|"]  # fmt: skip
    for kind, c in cells:
        base = [r for r in rows if r["kind"] == kind and r["concurrency"] == c and r["side"] == direct]
        for s in sides:
            if s == direct:
                continue
            at_s = [r for r in rows if r["kind"] == kind and r["concurrency"] == c and r["side"] == s]
            added = " | ".join(f"{med(at_s, k) - med(base, k):+.2f}" for k in ("p50_ms", "p99_ms", "p999_ms"))
            lines.append(f"| {kind} | {c} | {s} | {added} |")
    return "\n".join(lines)


def scale_out(args: argparse.Namespace, one: Server, two: Server, workdir: Path) -> dict[str, Any]:
    """One gateway at c against two gateways at c/2 each (two wrk processes at once)."""
    c, kind, results = args.scale_concurrency, "json", {"one": [], "two": []}  # type: ignore[var-annotated]
    for _ in range(args.rounds):
        row = measure(one, workdir, kind, c, args.duration)
        results["one"].append({"rps": row["rps"], "cpu": row["cpu_ms_per_request"]})
        cpu0 = one.cpu_seconds() + two.cpu_seconds()
        procs = []
        for server in (one, two):
            env = wrk_env(server, workdir, kind)
            procs.append(subprocess.Popen(
                ["wrk", "-t1", f"-c{c // 2}", f"-d{int(args.duration)}s", "--timeout", "30s", "-s", str(WRK_SCRIPT),
                 f"{server.base}/v1/chat/completions"], env=env, stdout=subprocess.PIPE, text=True,
            ))  # fmt: skip
        outs = [p.communicate()[0] for p in procs]
        cpu = one.cpu_seconds() + two.cpu_seconds() - cpu0
        parsed = [json.loads(next(x for x in o.splitlines() if x.startswith("WRK_JSON "))[9:]) for o in outs]
        n = sum(p["requests"] for p in parsed)
        rps = sum(p["requests"] / (p["duration_us"] / 1e6) for p in parsed)
        errors = sum(p[k] for p in parsed for k in ERROR_FIELDS)
        results["two"].append({"rps": rps, "cpu": cpu * 1000 / n, "errors": errors})
        results["one"][-1]["errors"] = row["errors"]
        print(f"  scale-out c={c}: one {describe(row)}", flush=True)
        print(f"  scale-out c={c}: two {rps:8.0f} req/s  cpu/req {cpu * 1000 / n:.3f} ms  errors {errors}", flush=True)
    one_rps = statistics.median(r["rps"] for r in results["one"])
    two_rps = statistics.median(r["rps"] for r in results["two"])
    return {
        "concurrency": c, "rounds": results, "one_rps": one_rps, "two_rps": two_rps, "ratio": two_rps / one_rps,
        "one_cpu_ms": statistics.median(r["cpu"] for r in results["one"]),
        "two_cpu_ms": statistics.median(r["cpu"] for r in results["two"]),
    }  # fmt: skip


def gateway_state(server: Server) -> dict[str, Any]:
    from django.conf import settings

    proc = psutil.Process(server.proc.pid)
    conns = proc.net_connections(kind="tcp")
    pg_port = int(settings.DATABASES["default"].get("PORT") or 5432)
    redis_port = httpx.URL(settings.REDIS_URL).port
    tasks = None
    metrics = httpx.get(f"{server.base}/metrics", timeout=10).text
    for line in metrics.splitlines():
        if line.startswith("gateway_asyncio_tasks "):
            tasks = int(float(line.split()[1]))
    return {
        "rss_mib": proc.memory_info().rss / 2**20,
        "open_files": proc.num_fds(),
        "tcp_connections": len(conns),
        "database_connections": sum(1 for c in conns if c.raddr and c.raddr.port == pg_port),
        "redis_connections": sum(1 for c in conns if c.raddr and c.raddr.port == redis_port),
        "asyncio_tasks": tasks,
        "threads": proc.num_threads(),
    }


def soak(args: argparse.Namespace, server: Server, workdir: Path) -> dict[str, Any]:
    done = 0
    marks: dict[str, Any] = {}
    kinds = ("json", "sse")
    step = 0
    while done < 1000:  # the same load as the rest, so pools have grown to it before the first mark
        done += wrk(server, workdir, kinds[step % 2], 64, 1)["requests"]
        step += 1
    time.sleep(2)
    marks["after_first"] = {"requests": done, **gateway_state(server)}
    print(f"  soak: {done} requests: {marks['after_first']}", flush=True)
    while done < args.soak:
        done += wrk(server, workdir, kinds[step % 2], 64, 10)["requests"]
        step += 1
        print(f"  soak: {done} requests", flush=True)
    time.sleep(2)
    marks["after_last"] = {"requests": done, **gateway_state(server)}
    print(f"  soak: {done} requests: {marks['after_last']}", flush=True)
    first, last = marks["after_first"], marks["after_last"]
    marks["rss_growth"] = last["rss_mib"] / first["rss_mib"] - 1
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", default=["overhead"], choices=["overhead", "scale-out", "soak"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--kinds", nargs="+", default=["json", "sse"], choices=["json", "sse"])
    parser.add_argument("--duration", type=int, default=8, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8, help="chunks in a streamed answer")
    parser.add_argument("--server", default="uvicorn", choices=["daphne", "uvicorn"], help="the gateway's ASGI server")
    parser.add_argument("--also-server", choices=["daphne", "uvicorn"], help="a second gateway side on this server")
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument(
        "--no-tokenizer", action="store_true", help="the bench model has no tokenizer (upper-bound counts)"
    )
    parser.add_argument("--scale-concurrency", type=int, default=64)
    parser.add_argument("--soak", type=int, default=100_000, help="requests in the soak")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install -y wrk (make bench does)")

    workdir = Path(tempfile.mkdtemp(prefix="mock-suite-"))
    report = report_start(args)
    servers: list[Server] = []
    try:
        mock = start_mock(workdir, args.tokens)
        servers.append(mock)
        key = setup_platform(mock.base, tokenizer=not args.no_tokenizer)
        gateway = start_gateway(args.server, workdir, key)
        servers.append(gateway)
        print(f"mock at {mock.base}, gateway ({args.server}) at {gateway.base}; logs in {workdir}", flush=True)
        if "overhead" in args.only:
            sides = [mock, gateway]
            if args.also_server:
                other = start_gateway(args.also_server, workdir, key)
                servers.append(other)
                sides.append(other)
            litellm = None if args.no_litellm else start_litellm(workdir, mock.base)
            if litellm is not None:
                servers.append(litellm)
                sides.append(litellm)
            rows = overhead(args, sides, workdir)
            report["overhead"] = rows
            report["overhead_table"] = overhead_tables(rows, [s.name for s in sides])
            print("\n" + report["overhead_table"] + "\n", flush=True)
        if "scale-out" in args.only:
            second = start_gateway(args.server, workdir, key)
            servers.append(second)
            report["scale_out"] = result = scale_out(args, gateway, second, workdir)
            print(
                f"\nscale-out at c={result['concurrency']}: one gateway {result['one_rps']:.0f} req/s "
                f"({result['one_cpu_ms']:.3f} ms CPU/request), two {result['two_rps']:.0f} req/s "
                f"({result['two_cpu_ms']:.3f} ms CPU/request): x{result['ratio']:.2f}\n", flush=True,
            )  # fmt: skip
        if "soak" in args.only:
            fresh = start_gateway(args.server, workdir, key)
            servers.append(fresh)
            report["soak"] = marks = soak(args, fresh, workdir)
            print(f"\nsoak: RSS growth {marks['rss_growth'] * 100:+.1f} %\n", flush=True)
    finally:
        for server in reversed(servers):
            server.stop()
        if len(servers) > 1:  # the model was set up
            retire_mock_model()
    print(f"wrote {write_report('mock_suite', report)}")


if __name__ == "__main__":
    main()
