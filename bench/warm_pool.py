"""The warm pool on the real engines (issue 36): scale-up through a promoted standby vs a cold
start, and a hot-swap to a version readied as warm standbys.

The bundled SmolLM2 (vLLM CPU, ``--enforce-eager``) registered twice, as versions ``a`` and ``b``
of model ``warm-<tag>`` (the same files: a retrained model would be another artifact), served
by ``manage.py runworkers`` (slots ``--slots``, each engine pinned to its core) behind one real
gateway (uvicorn). Two client threads send small chat completions through the gateway back to
back the whole time; every answer that is not a 200 (or a stream that does not end with
``[DONE]``) is a failed request.

- **promotion**: ``a`` with 1 replica and 1 standby, both ready; the decision is
  ``deployment_scale(replicas=2)``; measured: from that write to the first request answered
  by the promoted replica (its vLLM ``request_success_total`` rises), through the gateway.
- **cold start**: the same with no standby: from the write to the first request answered by
  the replica the supervisor then claims and starts.
- **warm hot-swap**: ``swap_version <model> b --prewarm`` (``deployment_prewarm``), its
  standby ready; the decision is ``deployment_swap_version``; measured: to the traffic's
  shift and to the swap's ``completed``, with streaming clients, and the failed requests.

Each scenario ``--repeat`` times. Isolation: a database (``inference_warm_pool``), Redis
database 6 and namespace of its own, the artifact store under var/bench-warm/.

    .venv/bin/python bench/warm_pool.py --repeat 1
    .venv/bin/python bench/warm_pool.py --artifact-dir var/artifacts/smollm2-135m-instruct/0.1.2

``--artifact-dir``: an already converted SmolLM2 folder to upload (default: import the bundled
models, which converts the GGUF once). ``--fake``: the same steps on fake engines
(``tests/support/busy_engine.py``), a check of this script in seconds: its figures mean
nothing, and the first answer is taken as the replica's readiness. Writes
bench/results/warm_pool-<UTC date>.md (not with ``--fake``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from mock_suite import ROOT, Server, free_port, isolate, spawn, wait_http

DATABASE = "inference_warm_pool"
REDIS_DB = 6  # the platform uses 0, the batch bench 5, the predict bench 7, the soak 8, the test sessions 9 to 15
NAMESPACE = "ip-bench-warm"
PROMPT = [{"role": "user", "content": "Name a colour."}]


FAKE = False  # --fake


def setup(name: str, artifact_dir: Path | None) -> str:
    """Model ``name`` with versions a and b of the SmolLM2 artifact, priced; a bench key."""
    from mock_suite import bench_key

    from billing.services import price_set
    from registry.models import Model, ModelVersion
    from registry.services import model_version_create_from_upload

    if FAKE:
        model = Model.objects.create(name=name, task="chat")
        for label in ("a", "b"):
            ModelVersion.objects.create(
                model=model, version=label, framework="fake", artifact_uri=f"local://{name}/x",
                artifact_sha256="0" * 64, artifact_size=1, config={"max_seq_len": 512},
            )  # fmt: skip
    elif artifact_dir is None:
        from registry.bundled import SMOLLM2, import_bundled_models

        bundled = {v.model.name: v for v in import_bundled_models(progress=print)}[SMOLLM2]
        config, framework = bundled.config, bundled.framework
        for label in ("a", "b"):
            model = Model.objects.get_or_create(name=name, defaults={"task": "chat"})[0]
            ModelVersion.objects.create(
                model=model, version=label, framework=framework, artifact_uri=bundled.artifact_uri,
                artifact_sha256=bundled.artifact_sha256, artifact_size=bundled.artifact_size, config=config,
            )  # fmt: skip
    else:
        hf = json.loads((artifact_dir / "config.json").read_text())
        config = {"max_seq_len": int(hf["max_position_embeddings"]), "vocab_size": int(hf["vocab_size"]),
                  "architecture": hf["architectures"][0], "dtype": "bfloat16"}  # fmt: skip
        for label in ("a", "b"):
            model_version_create_from_upload(actor=None, name=name, version=label, framework="transformers",
                                             source=artifact_dir, config=config, task="chat")  # fmt: skip
    price_set(model=Model.objects.get(name=name), input_per_million="0.10", output_per_million="0.30",
              cached_input_per_million="0.05")  # fmt: skip
    return bench_key()


class Clients:
    """``count`` threads sending chat completions through the gateway back to back."""

    def __init__(self, base: str, key: str, model: str, *, count: int = 2, stream: bool = False) -> None:
        self.base, self.key, self.model, self.stream = base, key, model, stream
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]

    def __enter__(self) -> Clients:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _run(self) -> None:
        body = {"model": self.model, "messages": PROMPT, "max_tokens": 8, "stream": self.stream}
        headers = {"authorization": f"Bearer {self.key}"}
        with httpx.Client(base_url=self.base, timeout=120) as http:
            while not self._stop.is_set():
                try:
                    if self.stream:
                        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                            text = "".join(response.iter_text())
                            good = response.status_code == 200 and "data: [DONE]" in text
                            why = f"{response.status_code} {text[-200:]!r}"
                    else:
                        response = http.post("/v1/chat/completions", json=body, headers=headers)
                        good, why = response.status_code == 200, f"{response.status_code} {response.text[:200]!r}"
                except httpx.HTTPError as exc:
                    good, why = False, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    if good:
                        self.ok += 1
                    else:
                        self.failed.append(why)


def successes(endpoint: str) -> float:
    """The replica's vLLM ``request_success_total`` (0 when /metrics does not answer)."""
    if FAKE:
        return time.monotonic()  # no such counter: always "risen"
    try:
        text = httpx.get(f"{endpoint}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))  # fmt: skip


def wait(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    raise SystemExit(f"{what}: not within {timeout:.0f} s")


def live(deployment_id: int, *, standby: bool | None = None, state: str = "ready") -> list[Any]:
    from registry.models import Replica

    rows = Replica.objects.filter(deployment_id=deployment_id, state=state)
    return list(rows if standby is None else rows.filter(standby=standby))


def settle(deployment_id: int, *, replicas: int, standby: int, timeout: float) -> None:
    """Set the deployment's counts and wait until exactly that many serve and wait."""
    from registry.models import Deployment, Replica
    from registry.services import deployment_scale
    from registry.warm_pool import deployment_standby_set

    deployment = Deployment.objects.get(pk=deployment_id)
    deployment_standby_set(actor=None, deployment=deployment, standby=standby)
    deployment_scale(actor=None, deployment=deployment, replicas=replicas, reasons=["bench"], action="deployment.scale")

    def settled() -> bool:
        rows = Replica.objects.filter(deployment_id=deployment_id).exclude(state="stopped")
        return (len(live(deployment_id, standby=False)), len(live(deployment_id, standby=True)), rows.count()) == (
            replicas, standby, replicas + standby,
        )  # fmt: skip

    wait(settled, timeout, f"{replicas} serving and {standby} standby replica(s)")


def scale_up(deployment_id: int, base: str, key: str, model: str, timeout: float) -> dict[str, Any]:
    """Scale 1 → 2 under client load; seconds from the write to the new replica's first answer."""
    from registry.models import Deployment, Replica
    from registry.services import deployment_scale

    before = {r.pk for r in Replica.objects.filter(deployment_id=deployment_id).exclude(state="stopped")}
    warm = [r.pk for r in live(deployment_id, standby=True)]
    with Clients(base, key, model) as clients:
        time.sleep(1.0)
        started = time.monotonic()
        deployment_scale(actor=None, deployment=Deployment.objects.get(pk=deployment_id), replicas=2,
                         reasons=["bench"], action="deployment.scale")  # fmt: skip

        def added() -> Replica | None:
            serving = Replica.objects.filter(deployment_id=deployment_id, state="ready", standby=False)
            return next((r for r in serving if r.pk in warm or r.pk not in before), None)

        replica = wait(added, timeout, "the added replica ready")
        ready_after = time.monotonic() - started
        baseline = successes(replica.endpoint)
        wait(lambda: successes(replica.endpoint) > baseline, timeout, "a request answered by the added replica")
        answered_after = time.monotonic() - started
    return {"replica": replica.pk, "promoted": replica.pk in warm, "ready_s": round(ready_after, 2),
            "first_answer_s": round(answered_after, 2), "ok": clients.ok, "failed": len(clients.failed),
            "failures": clients.failed[:3]}  # fmt: skip


def warm_swap(deployment_id: int, base: str, key: str, model: str, timeout: float) -> dict[str, Any]:
    """Prewarm version b, then swap to it under streaming load; seconds to the shift and to done."""
    from registry.models import Deployment, ModelVersion
    from rollout.hotswap import deployment_prewarm, deployment_swap_version, open_swaps, swap_get

    old = Deployment.objects.select_related("version__model").get(pk=deployment_id)
    target = ModelVersion.objects.get(model=old.version.model, version="b" if old.version.version == "a" else "a")
    pool = deployment_prewarm(actor=None, deployment=old, version=target, standby=1)
    prewarm_started = time.monotonic()
    wait(lambda: live(pool.pk, standby=True), timeout, f"the warm standby of {target}")
    prewarm_s = time.monotonic() - prewarm_started
    with Clients(base, key, model, count=3, stream=True) as clients:
        time.sleep(1.0)
        started = time.monotonic()
        new = deployment_swap_version(actor=None, deployment=old, version=target)
        [swap] = [s for s in open_swaps() if s.old_id == old.pk]
        shifted = wait(lambda: swap_get(swap_id=swap.entry.pk).shifted_at, timeout, "the shift")  # type: ignore[union-attr]
        shift_s = time.monotonic() - started
        done = wait(lambda: swap_get(swap_id=swap.entry.pk).outcome, timeout, "the swap's end")  # type: ignore[union-attr]
        done_s = time.monotonic() - started
        time.sleep(1.0)
    assert shifted is not None
    return {"to": str(target), "new_deployment": new.pk, "adopted": new.pk == pool.pk, "outcome": done,
            "prewarm_s": round(prewarm_s, 1), "shift_s": round(shift_s, 2), "done_s": round(done_s, 2),
            "ok": clients.ok, "failed": len(clients.failed), "failures": clients.failed[:3]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="each scenario this many times")
    parser.add_argument("--slots", default="0,1", help="runworkers' WORKER_SLOTS (two are needed)")
    parser.add_argument("--artifact-dir", type=Path, help="a converted SmolLM2 folder (default: import the bundled)")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds any one wait may take")
    parser.add_argument("--fake", action="store_true", help="check this script on fake engines (no figures)")
    args = parser.parse_args()
    global FAKE
    FAKE = args.fake
    started = datetime.now(UTC)
    command = " ".join([".venv/bin/python bench/warm_pool.py", *sys.argv[1:]])
    load1, load5, _ = os.getloadavg()
    heading = [
        f"# Warm pool on the real engines (issue 36): {started:%Y-%m-%d %H:%M} UTC",
        "",
        f"- machine: {platform.node()}, nproc {os.cpu_count()}, load average {load1:.2f} / {load5:.2f} (1 / 5 min) "
        "at the start",
        f"- commit: {_commit()}",
        f"- command: `{command}`",
    ]
    print("\n".join(heading), flush=True)
    isolate(database=DATABASE, redis_db=REDIS_DB, namespace=NAMESPACE, artifacts="bench-warm/artifacts")
    from mock_suite import database_prepare

    database_prepare(DATABASE)
    from registry.models import ModelVersion
    from registry.services import deployment_create

    name = f"warm-{uuid.uuid4().hex[:6]}"
    key = setup(name, args.artifact_dir.resolve() if args.artifact_dir else None)
    deployment = deployment_create(version=ModelVersion.objects.get(model__name=name, version="a"), replicas=1,
                                   max_replicas=2, standby=1)  # fmt: skip
    workdir = ROOT / "var" / "bench-warm" / f"{started:%Y%m%dT%H%M%S}"
    workdir.mkdir(parents=True)
    workers = spawn([sys.executable, "manage.py", "runworkers", "--models", name], workdir / "runworkers.log", {
        "WORKER_HOST": f"bench-warm-{name}", "WORKER_SLOTS": args.slots, "WORKER_LOG_DIR": str(workdir),
        "PYTHONUNBUFFERED": "1",
        **({"WORKER_ENGINE_LAUNCHER": f"{sys.executable} -m tests.support.busy_engine"} if FAKE else {}),
    })  # fmt: skip
    gateway = start_gateway(workdir)
    rows: list[dict[str, Any]] = []
    try:
        deployment_id = deployment.pk
        for round_ in range(1, args.repeat + 1):
            settle(deployment_id, replicas=1, standby=1, timeout=args.timeout)
            row = scale_up(deployment_id, gateway.base, key, name, args.timeout)
            print(f"round {round_} promotion: {row}", flush=True)
            rows.append({"scenario": "promotion", **row})
            settle(deployment_id, replicas=1, standby=0, timeout=args.timeout)
            row = scale_up(deployment_id, gateway.base, key, name, args.timeout)
            print(f"round {round_} cold start: {row}", flush=True)
            rows.append({"scenario": "cold start", **row})
            settle(deployment_id, replicas=1, standby=0, timeout=args.timeout)
            row = warm_swap(deployment_id, gateway.base, key, name, args.timeout)
            print(f"round {round_} warm hot-swap: {row}", flush=True)
            rows.append({"scenario": "warm hot-swap", **row})
            deployment_id = row["new_deployment"]
    finally:
        gateway.stop()
        if workers.poll() is None:
            os.killpg(workers.pid, signal.SIGTERM)
            try:
                workers.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(workers.pid, signal.SIGKILL)
    table = markdown(rows, heading)
    print("\n" + table + "\n", flush=True)
    if FAKE:
        return
    out = ROOT / "bench" / "results" / f"warm_pool-{started:%Y-%m-%d}.md"
    out.write_text(table + "\n")
    print(f"wrote {out.relative_to(ROOT)}; logs in {workdir.relative_to(ROOT)}", flush=True)


def start_gateway(workdir: Path) -> Server:
    from console.servers import server_command

    port = free_port()
    log = workdir / "gateway.log"
    proc = spawn(server_command(sys.executable, host="127.0.0.1", port=port, server="uvicorn", processes=1), log,
                 {"PYTHONUNBUFFERED": "1"})  # fmt: skip
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, "gateway")
    return Server("gateway", f"http://127.0.0.1:{port}", "", "", proc, log)


def markdown(rows: list[dict[str, Any]], heading: list[str]) -> str:
    lines = [*heading, "", "| scenario | replica ready (s) | first answer through it (s) | requests ok | failed |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for row in rows:
        if row["scenario"] == "warm hot-swap":
            continue
        note = " (NOT promoted)" if row["scenario"] == "promotion" and not row["promoted"] else ""
        lines.append(f"| {row['scenario']}{note} | {row['ready_s']} | {row['first_answer_s']} | {row['ok']} | "
                     f"{row['failed']} |")  # fmt: skip
    swaps = [row for row in rows if row["scenario"] == "warm hot-swap"]
    if swaps:
        lines += ["", "| warm hot-swap | standby readied in (s) | to the shift (s) | to done (s) | outcome | "
                  "streams ok | failed |", "|---|---:|---:|---:|---|---:|---:|"]  # fmt: skip
        for row in swaps:
            note = "" if row["adopted"] else " (pool NOT adopted)"
            lines.append(f"| to {row['to']}{note} | {row['prewarm_s']} | {row['shift_s']} | {row['done_s']} | "
                         f"{row['outcome']} | {row['ok']} | {row['failed']} |")  # fmt: skip
    for scenario in ("promotion", "cold start"):
        found = [row["first_answer_s"] for row in rows if row["scenario"] == scenario]
        if len(found) > 1:
            lines.append(f"\n{scenario}: median {statistics.median(found):.2f} s over {len(found)}")
    failures = [f for row in rows for f in row.get("failures", [])]
    if failures:
        lines += ["", "First failures:", *[f"- {f}" for f in failures]]
    return "\n".join(lines)


def _commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
