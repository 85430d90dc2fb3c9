"""What LoRA costs on the real engine (issue 38): the base model served by an engine started
without LoRA, by the same engine started with it (``--enable-lora``: the base deployment's
``max_adapters``), and the bundled pirate adapter served by that engine beside its base, all
through the gateway with ``vllm bench serve`` (one seeded random dataset, ``--ignore-eos``).

Phases alternate, the engine restarted between them by its supervisor as production does it
(``registry.services.deployment_adapters_set``): LoRA off, then on (base and adapter rounds
alternating), ``--rounds`` times. Reported per phase: output tokens/s, TTFT p50/p99, ITL p50,
and the ratios (base with LoRA on / off; adapter / base, both on the LoRA engine), medians over
rounds.

Against a running platform (``make run``; it changes the base deployment's ``max_adapters``
and deploys the pirate adapter, and puts both back afterwards):

    .venv/bin/python bench/lora_overhead.py --gateway http://127.0.0.1:8000

or ``--start-platform`` (runs ``manage.py runplatform`` on a free port, then stops it).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_suite import bench_serve, replica_of, start_platform
from mock_suite import bench_key, django_setup, report_start, write_report

BASE = "smollm2-135m-instruct"
ADAPTER = "smollm2-135m-pirate"
BENCH = "bench lora_overhead"


def _base_deployment() -> Any:
    from registry.models import Deployment

    deployment = Deployment.objects.filter(version__model__name=BASE, status__in=["pending", "running"]).first()
    if deployment is None:
        raise SystemExit(f"{BASE} has no serving deployment: is the platform up?")
    return deployment


def _engine_pid(lora: bool, timeout: float = 600) -> int:
    """Wait for the base's replica to be ready on an engine started with (or without) LoRA."""
    from registry.models import Replica

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for replica in Replica.objects.filter(deployment=_base_deployment(), state="ready").exclude(pid=None):
            try:
                argv = Path(f"/proc/{replica.pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if (b"--enable-lora" in argv) == lora:
                return int(replica.pid or 0)
        time.sleep(2)
    raise SystemExit(f"no ready engine of {BASE} with LoRA {'on' if lora else 'off'} within {timeout:.0f} s")


def _answers(gateway: str, key: str, model: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            response = httpx.post(
                f"{gateway}/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                json={"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
            )  # fmt: skip
            if response.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise SystemExit(f"{model} was not answered through the gateway within {timeout:.0f} s")


def _lora(on: bool, max_adapters: int) -> None:
    """Turn the base deployment's LoRA on (deploying the adapter) or off (draining it first)."""
    from registry.models import ModelVersion
    from registry.services import SystemActor, deployment_adapters_set, deployment_create

    actor = SystemActor(BENCH)
    if on:
        deployment_adapters_set(actor=actor, deployment=_base_deployment(), max_adapters=max_adapters)
        adapter = ModelVersion.objects.filter(model__name=ADAPTER).order_by("-created_at").first()
        if adapter is None:
            raise SystemExit(f"{ADAPTER} is not registered (manage.py bootstrap imports it)")
        if not _adapter_deployed():
            deployment_create(version=adapter, actor=actor)
    else:
        _drain_adapter()
        deployment_adapters_set(actor=actor, deployment=_base_deployment(), max_adapters=0)


def _adapter_deployed() -> bool:
    from registry.models import Deployment

    return Deployment.objects.filter(version__model__name=ADAPTER, status__in=["pending", "running"]).exists()


def _restore(max_adapters: int, adapter_deployed: bool) -> None:
    """Put the base deployment's ``max_adapters`` and the adapter's deployment back as found."""
    from registry.services import SystemActor, deployment_adapters_set

    if not adapter_deployed:
        _drain_adapter()
    deployment_adapters_set(actor=SystemActor(BENCH), deployment=_base_deployment(), max_adapters=max_adapters)


def _drain_adapter() -> None:
    from registry.models import Deployment
    from registry.services import deployment_transition

    for deployment in Deployment.objects.filter(version__model__name=ADAPTER, status__in=["pending", "running"]):
        deployment_transition(deployment=deployment, status="draining")


def _adapter_loaded(pid: int, timeout: float = 300) -> None:
    from registry.models import LoadedAdapter

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if LoadedAdapter.objects.filter(version__model__name=ADAPTER, pid=pid).exists():
            return
        time.sleep(1)
    raise SystemExit(f"{ADAPTER} was not loaded into engine {pid} within {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", help="a running platform's base URL")
    parser.add_argument("--start-platform", action="store_true", help="run manage.py runplatform for the benchmark")
    parser.add_argument("--rounds", type=int, default=2, help="LoRA off / on phase pairs")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-adapters", type=int, default=2, help="the base deployment's max_adapters when on")
    args = parser.parse_args()
    if not args.gateway and not args.start_platform:
        raise SystemExit("give --gateway URL (a running platform) or --start-platform")
    report = report_start(args)
    workdir = Path(tempfile.mkdtemp(prefix="lora-overhead-"))
    platform_proc = None
    if args.start_platform:
        print(f"starting the platform (log: {workdir / 'platform.log'}); loading the models takes minutes", flush=True)
        platform_proc, args.gateway = start_platform(workdir / "platform.log")
    django_setup()
    was, had_adapter = _base_deployment().max_adapters, _adapter_deployed()
    rows: list[dict[str, Any]] = []
    try:
        key = bench_key()
        _, _, tokenizer = replica_of(BASE)

        def run(phase: str, model: str, rnd: int) -> None:
            row = bench_serve(args.gateway, key, "openai-chat", model, tokenizer, args.concurrency, args, workdir)
            row.update(phase=phase, model=model, round=rnd)
            rows.append(row)
            print(
                f"  round {rnd} {phase:9} {model:22} {row['output_tokens_per_s']:7.1f} tok/s"
                f"  TTFT p50 {row['ttft_p50_ms']:7.1f} p99 {row['ttft_p99_ms'] or 0:7.1f} ms"
                f"  ITL p50 {row['itl_p50_ms']:6.1f} ms  failed {row['failed']}",
                flush=True,
            )

        for rnd in range(args.rounds):
            _lora(False, args.max_adapters)
            pid = _engine_pid(lora=False)
            _answers(args.gateway, key, BASE)
            print(f"round {rnd}: LoRA off (engine {pid})", flush=True)
            run("lora off", BASE, rnd)
            _lora(True, args.max_adapters)
            pid = _engine_pid(lora=True)
            _adapter_loaded(pid)
            for model in (BASE, ADAPTER):
                _answers(args.gateway, key, model)
            print(f"round {rnd}: LoRA on (engine {pid}), {ADAPTER} loaded", flush=True)
            for model in (BASE, ADAPTER) if rnd % 2 == 0 else (ADAPTER, BASE):
                run("lora on", model, rnd)
    finally:
        try:
            _restore(was, had_adapter)
        finally:
            if platform_proc is not None:
                os.killpg(platform_proc.pid, signal.SIGTERM)
                platform_proc.wait(120)

    def of(phase: str, model: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["phase"] == phase and r["model"] == model]

    off, on, adapter = of("lora off", BASE), of("lora on", BASE), of("lora on", ADAPTER)
    lines = [
        "| served | engine | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, engine, at in ((BASE, "LoRA off", off), (BASE, "LoRA on", on), (ADAPTER, "LoRA on", adapter)):
        lines.append(
            f"| {label} | {engine} | {statistics.median(r['output_tokens_per_s'] for r in at):.1f}"
            f" | {statistics.median(r['ttft_p50_ms'] for r in at):.1f}"
            f" | {statistics.median(r['ttft_p99_ms'] or 0 for r in at):.1f}"
            f" | {statistics.median(r['itl_p50_ms'] for r in at):.2f} | {sum(r['failed'] or 0 for r in at)} |"
        )

    def ratio(name: str, top: list[dict[str, Any]], bottom: list[dict[str, Any]]) -> list[float]:
        return [b[name] / a[name] for a, b in zip(bottom, top, strict=True)]

    ratios = {
        "base tok/s, LoRA on / off": ratio("output_tokens_per_s", on, off),
        "adapter tok/s / base, LoRA on": ratio("output_tokens_per_s", adapter, on),
        "adapter TTFT p50 / base, LoRA on": ratio("ttft_p50_ms", adapter, on),
    }
    summary = "; ".join(
        f"{name}: {statistics.median(values):.3f} ({', '.join(f'{v:.3f}' for v in values)})"
        for name, values in ratios.items()
    )
    table = "\n".join(lines)
    print(f"\n{table}\n\nratios, median (per round): {summary}\n")
    report = {**report, "rows": rows, "table": table, "ratios": ratios}
    print(f"wrote {write_report('lora_overhead', report)}")


if __name__ == "__main__":
    main()
