"""Small models (issue 20): the dynamic batcher vs batch size 1, and the platform vs MLServer.

On this machine, in one run, for the image model (the bundled digits MLP: each request one
8x8 image) and the text model (the bundled sentiment classifier, MiniLM + a head behind the
worker's tokenizer step: each request one sentence), at 1, 16 and 64 concurrent clients (wrk,
closed loop, Open Inference Protocol JSON):

- ``batcher``: the gateway (uvicorn, auth, limits, routing and metering on: every request is
  admitted and settled through the ledger) → the predict worker with the version's dynamic
  batcher (max_batch_size 64, no queue delay, preferred 16 and 64; the text model 32, preferred 8 and 32);
- ``batcher, 2 gateway processes``: the same through a gateway of two uvicorn processes on
  one port (``GATEWAY_PROCESSES``);
- ``batch-1``: the same, to a second version of the same artifact whose batcher has
  max_batch_size 1 (pinned with /versions/{v}/infer);
- ``worker alone, batcher`` and ``worker alone, batch-1``: the same two workers called
  directly with their replica keys (no gateway): what the batcher itself is worth;
- ``mlserver``: MLServer 1.7.1 (its own virtualenv, bench/.venv-mlserver) serving the same
  ONNX file with ONNX Runtime (bench/mlserver_onnx/runtime.py, with the same tokenizer step
  for the text model) and its adaptive batching (the same max batch size, max_batch_time
  2 ms), no auth, no metering; and ``mlserver, no batching``: the same without it.

Each figure: throughput, p50 and p99 latency, errors; for ``batcher`` the gateway's CPU
seconds per request (psutil, the gateway process only) and the batch sizes its worker
formed (the worker's /stats before and after). The exact result cache is off (every
request is the same image). Everything runs on the same two cores: the load generator too.

Isolation as the soak's: its own database (``inference_bench_predict``), Redis database 7
with its own namespace, its own artifact store (``var/bench-predict/artifacts``), its own
supervisor host name; a running platform and the tests are never touched.

    .venv/bin/python bench/predict_suite.py                    # 10 s per point
    .venv/bin/python bench/predict_suite.py --duration 5 --concurrency 1 16 --models digits-mlp

Writes bench/results/predict-<time>.json and .md (git-ignored) and prints the tables;
docs/performance.md has a run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import mock_suite
from mock_suite import ROOT, Server, free_port, report_start, spawn, wait_http, write_report

DATABASE = "inference_bench_predict"
REDIS_DB = 7  # the platform uses 0, the soak 8, the test sessions 9 to 15
NAMESPACE = "ip-bench-predict"
HOST = "bench-predict"
DIGITS = "digits-mlp"
SENTIMENT = "sentiment-minilm"
MODELS = (DIGITS, SENTIMENT)
BATCH1 = "1-batch1"
WRK_SCRIPT = ROOT / "bench" / "wrk" / "post.lua"
MLSERVER_VENV = ROOT / "bench" / ".venv-mlserver"
MLSERVER_VERSION = "1.7.1"
NO_BATCHING = "-nobatch"  # MLServer's second copy of each model, without adaptive batching
# The batcher each model is measured with (the text model's as its bundled config, a deeper queue).
BATCHERS = {
    DIGITS: {"max_batch_size": 64, "max_queue_delay_us": 0, "preferred_batch_sizes": [16, 64]},
    SENTIMENT: {"max_batch_size": 32, "max_queue_delay_us": 0, "preferred_batch_sizes": [8, 32]},
}
for _batcher in BATCHERS.values():
    _batcher["max_queue_size"] = 4096


def isolate() -> None:
    mock_suite.isolate(database=DATABASE, redis_db=REDIS_DB, namespace=NAMESPACE, artifacts="bench-predict/artifacts")


def database_prepare() -> None:
    mock_suite.database_prepare(DATABASE)


def platform_setup(models: list[str]) -> tuple[str, dict[str, Path]]:
    """Each model (built into the bench's store once), its batched version and a batch-1
    version of the same artifact, both deployed; a key far above any limit. Returns the key
    and each model's artifact folder (for MLServer)."""
    from decimal import Decimal

    from accounts.services import api_key_create, organization_create
    from billing.models import Price
    from billing.services import price_set
    from registry.artifacts import get_artifact_store
    from registry.bundled import BUNDLED_MODELS, import_bundled_model
    from registry.models import Deployment, ModelVersion
    from registry.services import deployment_create, model_version_register

    folders: dict[str, Path] = {}
    for name in models:
        bundled = next(b for b in BUNDLED_MODELS if b.name == name)
        version = import_bundled_model(bundled, progress=lambda line: print(f"  {line}", flush=True))
        batcher = BATCHERS[name]
        config = {**version.config, "batcher": batcher}
        if version.config != config:
            version.config = config
            version.save(update_fields=["config"])
        batch1 = model_version_register(
            model=version.model, version=BATCH1, framework="onnx", artifact_uri=version.artifact_uri,
            artifact_sha256=version.artifact_sha256, artifact_size=version.artifact_size,
            config={**config, "batcher": {**batcher, "max_batch_size": 1, "preferred_batch_sizes": []}},
        )  # fmt: skip
        for each, weight in ((version, 100), (batch1, 0)):
            deployment = Deployment.objects.filter(version=each).exclude(status="stopped").first()
            if deployment is None:
                deployment = deployment_create(version=each, replicas=1, min_replicas=1, max_replicas=1)
            Deployment.objects.filter(pk=deployment.pk).update(traffic_weight=weight)
        ModelVersion.objects.filter(pk__in=[version.pk, batch1.pk]).update(status="active")
        if not Price.objects.filter(model=version.model).exists():
            price_set(
                model=version.model, input_per_million="0", output_per_million="0", per_thousand_inferences="0.05"
            )
        folders[name] = get_artifact_store().local_path(version.artifact_uri)
    huge = 10**12
    limits: dict[str, Any] = {
        "rate_limit_rpm": huge, "rate_limit_tpm": huge, "max_concurrent": 100_000,
        "monthly_token_quota": huge * 1000, "monthly_spend_cap": Decimal("10000000"),
    }  # fmt: skip
    org = organization_create(name=f"Bench predict {time.strftime('%Y%m%dT%H%M%S')}", **limits)
    key = api_key_create(organization=org, name="bench", **limits).secret
    return key, folders


def start_platform(workdir: Path, models: list[str], gateway_processes: int) -> tuple[list[Server], Server]:
    """runworkers (this bench's host, slot 1) and the gateways, ready: one uvicorn process,
    and (``gateway_processes`` > 1) one with that many processes on its port."""
    from console.servers import server_command

    supervisor_log = workdir / "runworkers.log"
    supervisor = spawn(
        [sys.executable, "manage.py", "runworkers", "--host", HOST, "--models", ",".join(models)], supervisor_log,
        {"WORKER_SLOTS": "1", "WORKER_LOG_DIR": str(workdir / "engines")},
    )  # fmt: skip
    env = {
        "PREDICT_RESULT_CACHE_TTL_SECONDS": "0",  # every request is the same input: measure the model
        "BACKPRESSURE_PAID_PER_REPLICA": "100000",
        "BACKPRESSURE_FREE_PER_REPLICA": "100000",
        "PYTHONUNBUFFERED": "1",
    }
    gateways = []
    for processes in sorted({1, gateway_processes}):
        port = free_port()
        log = workdir / f"gateway-{processes}.log"
        command = server_command(sys.executable, host="127.0.0.1", port=port, server="uvicorn", processes=processes)
        process = spawn(command, log, env)
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", process, "gateway")
        gateways.append(Server(f"gateway x{processes}", base, "", models[0], process, log))
    return gateways, Server("runworkers", "", "", models[0], supervisor, supervisor_log)


def wait_for_workers(base: str, key: str, models: list[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {key}"}
    while time.monotonic() < deadline:
        ready = [
            httpx.get(f"{base}/v2/models/{m}/versions/{v}/ready", headers=headers, timeout=5).status_code == 200
            for m in models
            for v in ("1", BATCH1)
        ]
        if all(ready):
            return
        time.sleep(1)
    raise SystemExit("the predict workers did not become ready")


def start_mlserver(workdir: Path, folders: dict[str, Path]) -> Server:
    if not (MLSERVER_VENV / "bin" / "mlserver").exists():
        print(f"installing MLServer {MLSERVER_VERSION} into {MLSERVER_VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(MLSERVER_VENV)], check=True)
    if not list(MLSERVER_VENV.glob("lib/python*/site-packages/tokenizers")):
        # uvloop 0.22 and later refuse MLServer 1.7's get_event_loop() in its inference workers.
        subprocess.run([str(MLSERVER_VENV / "bin" / "pip"), "install", "--quiet", f"mlserver=={MLSERVER_VERSION}",
                        "onnxruntime==1.31.1", "uvloop==0.21.0", "tokenizers==0.23.3"], check=True)  # fmt: skip
    models = workdir / "mlserver"
    shutil.rmtree(models, ignore_errors=True)
    models.mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "mlserver_onnx" / "runtime.py", models / "runtime.py")
    port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    (models / "settings.json").write_text(json.dumps({
        "http_port": port, "grpc_port": grpc_port, "metrics_port": metrics_port, "parallel_workers": 1,
        "debug": False,
    }))  # fmt: skip
    for name, folder in folders.items():
        tokenizer = BUNDLED_TOKENIZERS.get(name)
        # Each model twice: with MLServer's adaptive batching, and without (a batch of one).
        for served, batch_size, batch_time in ((name, BATCHERS[name]["max_batch_size"], 0.002),
                                               (f"{name}{NO_BATCHING}", 1, 0)):  # fmt: skip
            (models / served).mkdir()
            (models / served / "model-settings.json").write_text(json.dumps({
                "name": served, "implementation": "runtime.OnnxModel",
                "parameters": {"uri": str(folder / "model.onnx"),
                               "extra": {"tokenizer": str(folder / tokenizer) if tokenizer else None}},
                "max_batch_size": batch_size, "max_batch_time": batch_time,
            }))  # fmt: skip
    log = workdir / "mlserver.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(MLSERVER_VENV / "bin" / "mlserver"), "start", "."],
            cwd=models,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(models)},
        )
    base = f"http://127.0.0.1:{port}"
    first = next(iter(folders))
    wait_http(f"{base}/v2/models/{first}/ready", proc, "MLServer", timeout=180)
    deadline = time.monotonic() + 90
    names = [m + suffix for m in folders for suffix in ("", NO_BATCHING)]
    while not all(httpx.get(f"{base}/v2/models/{m}/ready", timeout=5).status_code == 200 for m in names):
        if time.monotonic() > deadline:
            raise SystemExit("MLServer's models did not become ready")
        time.sleep(0.5)
    return Server("mlserver", base, "", first, proc, log)


# The text model's tokenizer file, inside its artifact folder.
BUNDLED_TOKENIZERS = {SENTIMENT: "tokenizer.json"}


def request_body(workdir: Path, model: str) -> Path:
    """One request: an image of the digits set, or one sentence of typical length."""
    if model == SENTIMENT:
        text = "The room was spotless and the staff were friendly, but breakfast was cold every single morning."
        tensor = {"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}
    else:
        from sklearn.datasets import load_digits

        image = load_digits().data[7].astype(float).tolist()
        tensor = {"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": image}
    path = workdir / f"{model}.json"
    path.write_text(json.dumps({"inputs": [tensor]}))
    return path


def wrk(url: str, key: str, body: Path, concurrency: int, duration: float) -> dict[str, Any]:
    env = {**os.environ, "WRK_BODY_FILE": str(body), "WRK_KEY": key}
    cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{int(duration)}s", "--timeout", "30s", "-s", str(WRK_SCRIPT), url]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("WRK_JSON "))
    return dict(json.loads(line[len("WRK_JSON ") :]))


def worker_endpoint(model: str, version: str) -> tuple[str, str]:
    """The ready replica of ``version`` on this bench's host: its infer URL and its key (the
    worker measured alone, without the gateway in front)."""
    from registry.models import Replica
    from registry.replica_keys import replica_api_key

    replica = Replica.objects.get(
        deployment__version__model__name=model, deployment__version__version=version, state="ready", host=HOST
    )
    return f"{replica.endpoint}/v2/models/{model}/infer", replica_api_key(replica.pk)


def worker_stats(model: str, version: str) -> dict[str, Any]:
    from registry.models import Replica
    from serving.predict.worker_stats import replica_stats

    replicas = list(
        Replica.objects.filter(
            deployment__version__model__name=model, deployment__version__version=version, state="ready", host=HOST
        )
    )
    stats = replica_stats(replicas, timeout=5)
    return next(iter(stats.values()), {})


def batches_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    sizes = {int(k): v for k, v in (after.get("batch_sizes") or {}).items()}
    for k, v in (before.get("batch_sizes") or {}).items():
        sizes[int(k)] = sizes.get(int(k), 0) - v
    return {str(k): v for k, v in sorted(sizes.items()) if v > 0}


def measure(model: str, side: str, url: str, key: str, body: Path, concurrency: int, duration: float,
            gateway: Server | None, version: str | None) -> dict[str, Any]:  # fmt: skip
    wrk(url, key, body, concurrency, 2)  # warm-up, not counted
    before = worker_stats(model, version) if version else {}
    cpu0 = gateway.cpu_seconds() if gateway else 0.0
    result = wrk(url, key, body, concurrency, duration)
    cpu = (gateway.cpu_seconds() - cpu0) if gateway else None
    after = worker_stats(model, version) if version else {}
    seconds = result["duration_us"] / 1e6
    errors = sum(result[k] for k in ("connect_errors", "read_errors", "write_errors", "timeouts", "status_errors"))
    row: dict[str, Any] = {
        "model": model, "side": side, "concurrency": concurrency, "requests": result["requests"],
        "throughput_rps": round(result["requests"] / seconds, 1),
        "p50_ms": round(result["p50_us"] / 1000, 2), "p99_ms": round(result["p99_us"] / 1000, 2), "errors": errors,
    }  # fmt: skip
    if cpu is not None and result["requests"]:
        row["gateway_cpu_ms_per_request"] = round(cpu * 1000 / result["requests"], 3)
    if version:
        batches = batches_between(before, after)
        rows = sum(int(size) * count for size, count in batches.items())
        row["batches"] = batches
        row["mean_batch_rows"] = round(rows / max(1, sum(batches.values())), 2)
    return row


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Small models: batcher vs batch-1 vs MLServer ({report['started']}, {report['cpus']} CPUs)",
        "",
        "| model | side | clients | req/s | p50 ms | p99 ms | errors | gateway CPU ms/req | mean batch rows |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['model']} | {r['side']} | {r['concurrency']} | {r['throughput_rps']} | {r['p50_ms']} | "
            f"{r['p99_ms']} | {r['errors']} | {r.get('gateway_cpu_ms_per_request', '—')} | "
            f"{r.get('mean_batch_rows', '—')} |"
        )
    lines += ["", "## Ratios", ""]
    for name, value in report["ratios"].items():
        lines.append(f"- {name}: {value}")
    lines += ["", "## Batch sizes formed (rows: batches)", ""]
    for r in report["rows"]:
        if r.get("batches") and r["side"] != "batch-1" and not r["side"].endswith("batch-1"):
            lines.append(f"- {r['model']}, {r['side']}, {r['concurrency']} clients: {r['batches']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per point")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--no-mlserver", action="store_true")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument(
        "--gateway-processes", type=int, default=2,
        help="also measure a gateway of this many processes (1: only the one-process gateway)",
    )  # fmt: skip
    parser.add_argument(
        "--delay-us", type=int, help="the batcher's max_queue_delay_us for every model (default: each model's)"
    )
    args = parser.parse_args()
    if args.delay_us is not None:
        for batcher in BATCHERS.values():
            batcher["max_queue_delay_us"] = args.delay_us
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install wrk (make bench installs it)")
    report = report_start(args)
    isolate()
    database_prepare()
    key, folders = platform_setup(args.models)
    workdir = ROOT / "var" / "bench-predict" / f"run-{time.strftime('%Y%m%dT%H%M%S')}"
    workdir.mkdir(parents=True)
    gateways, supervisor = start_platform(workdir, args.models, args.gateway_processes)
    gateway = gateways[0]
    servers = [*gateways, supervisor]
    mlserver: Server | None = None
    rows: list[dict[str, Any]] = []
    try:
        wait_for_workers(gateway.base, key, args.models)
        if not args.no_mlserver:
            mlserver = start_mlserver(workdir, folders)
            servers.append(mlserver)
        for model in args.models:
            body = request_body(workdir, model)
            for concurrency in args.concurrency:
                print(f"{model}, {concurrency} clients", flush=True)
                first = len(rows)
                for side, version in (("batcher", "1"), ("batch-1", BATCH1)):
                    url = f"{gateway.base}/v2/models/{model}/versions/{version}/infer"
                    rows.append(measure(model, side, url, key, body, concurrency, args.duration,
                                        gateway if side == "batcher" else None, version))  # fmt: skip
                for more in gateways[1:]:
                    url = f"{more.base}/v2/models/{model}/versions/1/infer"
                    side = f"batcher, {args.gateway_processes} gateway processes"
                    rows.append(measure(model, side, url, key, body, concurrency, args.duration, more, "1"))
                for side, version in (("worker alone, batcher", "1"), ("worker alone, batch-1", BATCH1)):
                    url, replica_key = worker_endpoint(model, version)
                    rows.append(measure(model, side, url, replica_key, body, concurrency, args.duration, None, version))
                if mlserver is not None:
                    for side, served in (("mlserver", model), ("mlserver, no batching", model + NO_BATCHING)):
                        url = f"{mlserver.base}/v2/models/{served}/infer"
                        rows.append(measure(model, side, url, "", body, concurrency, args.duration, None, None))
                for row in rows[first:]:
                    print(f"  {row}", flush=True)
    finally:
        for server in reversed(servers):
            server.stop()
        from registry.models import Deployment

        Deployment.objects.filter(version__model__name__in=args.models).update(status="stopped")
    by = {(r["model"], r["side"], r["concurrency"]): r for r in rows}
    ratios: dict[str, Any] = {}
    top = max(args.concurrency)

    def ratio(model: str, name: str, over: str, under: str) -> None:
        if (model, over, top) in by and (model, under, top) in by:
            ratios[f"{model}: {name} at {top} clients"] = round(
                by[(model, over, top)]["throughput_rps"] / max(0.1, by[(model, under, top)]["throughput_rps"]), 2
            )

    for model in args.models:
        ratio(model, "batcher / batch-1 throughput", "batcher", "batch-1")
        ratio(model, "worker alone: batcher / batch-1 throughput", "worker alone, batcher", "worker alone, batch-1")
        ratio(model, "batcher / MLServer throughput", "batcher", "mlserver")
        ratio(model, "batcher / MLServer (no batching) throughput", "batcher", "mlserver, no batching")
        several = f"batcher, {args.gateway_processes} gateway processes"
        ratio(model, f"{args.gateway_processes} gateway processes / MLServer throughput", several, "mlserver")
        ratio(model, f"{args.gateway_processes} gateway processes / batch-1 throughput", several, "batch-1")
        ratio(model, "worker alone / MLServer throughput", "worker alone, batcher", "mlserver")
    report |= {"rows": rows, "ratios": ratios}
    path = write_report("predict", report)
    text = markdown(report)
    path.with_suffix(".md").write_text(text)
    print(text)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
