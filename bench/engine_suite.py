"""Through the real engine: ``vllm bench serve`` against the gateway and the same replica directly.

For each backend (``openai``: /v1/completions, ``openai-chat``: /v1/chat/completions) and
each concurrency, the two sides alternate round by round with the same seeded random
dataset: output tokens/s (ratio gateway/direct, median of rounds), and the gateway's added
TTFT p50 and ITL p50. The gateway side uses a bench key whose limits no run reaches.

Against a running platform (``make run``):

    .venv/bin/python bench/engine_suite.py --gateway http://127.0.0.1:8000

or on its own (``make bench`` does this): ``--start-platform`` runs ``manage.py runplatform``
on a free port, waits for the bundled models, benchmarks, and stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mock_suite import ROOT, bench_key, django_setup, free_port, report_start, write_report

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def replica_of(model: str) -> tuple[str, str, str]:
    """The model's ready replica: endpoint, its own key, and the tokenizer directory."""
    django_setup()
    from registry.models import Replica
    from registry.replica_keys import replica_api_key
    from serving.gateway.routing import _tokenizer_dir

    replica = (
        Replica.objects.filter(state="ready", deployment__version__model__name=model)
        .select_related("deployment__version")
        .first()
    )
    if replica is None:
        raise SystemExit(f"no ready replica of {model}: is the platform up?")
    tokenizer = _tokenizer_dir(replica.deployment.version.artifact_uri)
    if tokenizer is None:
        raise SystemExit(f"{model}'s artifact has no local tokenizer")
    return replica.endpoint, replica_api_key(replica.pk), tokenizer


def start_platform(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "runplatform", "--port", str(port)], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"runplatform exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(2)
    os.killpg(proc.pid, signal.SIGTERM)
    raise SystemExit(f"the platform was not ready in 15 min; see {log}")


def bench_serve(
    base: str, key: str, backend: str, model: str, tokenizer: str, concurrency: int, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    name = f"{backend}-{concurrency}-{time.monotonic_ns()}.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "vllm_bench_serve.py"), "--backend", backend, "--base-url", base,
        "--endpoint", ENDPOINTS[backend], "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(max(args.prompts, concurrency * 3)), "--max-concurrency", str(concurrency),
        "--seed", "7", "--save-result", "--result-dir", str(out), "--result-filename", name, "--disable-tqdm",
    ]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": key}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads((out / name).read_text())
    return {
        "completed": result.get("completed"),
        "failed": result.get("failed", result.get("num_failed", 0)),
        "output_tokens_per_s": result["output_throughput"],
        "ttft_p50_ms": result["median_ttft_ms"],
        "ttft_p99_ms": result.get("p99_ttft_ms"),
        "itl_p50_ms": result["median_itl_ms"],
        "tpot_p50_ms": result.get("median_tpot_ms"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", help="a running platform's base URL")
    parser.add_argument("--start-platform", action="store_true", help="run manage.py runplatform for the benchmark")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--backends", nargs="+", default=list(ENDPOINTS), choices=list(ENDPOINTS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=128, help="at least; 3 x concurrency when more")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    if not args.gateway and not args.start_platform:
        raise SystemExit("give --gateway URL (a running platform) or --start-platform")
    report = report_start(args)
    workdir = Path(tempfile.mkdtemp(prefix="engine-suite-"))
    platform_proc = None
    if args.start_platform:
        print(f"starting the platform (log: {workdir / 'platform.log'}); loading the models takes minutes", flush=True)
        platform_proc, args.gateway = start_platform(workdir / "platform.log")
    rows: list[dict[str, Any]] = []
    try:
        key = bench_key()
        direct, direct_key, tokenizer = replica_of(args.model)
        sides = {"direct": (direct, direct_key), "gateway": (args.gateway, key)}
        print(f"gateway {args.gateway}, replica {direct}", flush=True)
        for backend in args.backends:
            # Warm up with the whole seeded dataset once (vLLM's prefix cache then holds it for
            # both sides, which send the same prompts), and each side's connections.
            widest = argparse.Namespace(**{**vars(args), "prompts": max(args.prompts, 3 * max(args.concurrency))})
            bench_serve(direct, direct_key, backend, args.model, tokenizer, 16, widest, workdir)
            for base, side_key in sides.values():
                small = argparse.Namespace(**{**vars(args), "prompts": 8})
                bench_serve(base, side_key, backend, args.model, tokenizer, 4, small, workdir)
            for concurrency in args.concurrency:
                for rnd in range(args.rounds):
                    order = list(sides.items()) if rnd % 2 == 0 else list(reversed(sides.items()))
                    for side, (base, side_key) in order:
                        row = bench_serve(base, side_key, backend, args.model, tokenizer, concurrency, args, workdir)
                        row.update(backend=backend, concurrency=concurrency, side=side, round=rnd)
                        rows.append(row)
                        print(
                            f"  {backend:11} c={concurrency:<3} {side:7} {row['output_tokens_per_s']:7.1f} tok/s"
                            f"  TTFT p50 {row['ttft_p50_ms']:7.1f} ms  ITL p50 {row['itl_p50_ms']:6.1f} ms"
                            f"  failed {row['failed']}",
                            flush=True,
                        )
    finally:
        if platform_proc is not None:
            os.killpg(platform_proc.pid, signal.SIGTERM)
            platform_proc.wait(120)
    lines = [
        "| backend | c | direct tok/s | gateway tok/s | ratio | TTFT p50 direct | added TTFT p50 | added ITL p50"
        " | failed |",
        "|---" * 9 + "|",
    ]
    for backend in args.backends:
        for concurrency in args.concurrency:
            at = [r for r in rows if r["backend"] == backend and r["concurrency"] == concurrency]
            d = [r for r in at if r["side"] == "direct"]
            g = [r for r in at if r["side"] == "gateway"]
            ratio = statistics.median(
                gw["output_tokens_per_s"] / dr["output_tokens_per_s"] for dr, gw in zip(d, g, strict=True)
            )
            dt, gt = (statistics.median(r["ttft_p50_ms"] for r in side) for side in (d, g))
            di, gi = (statistics.median(r["itl_p50_ms"] for r in side) for side in (d, g))
            lines.append(
                f"| {backend} | {concurrency} | {statistics.median(r['output_tokens_per_s'] for r in d):.1f}"
                f" | {statistics.median(r['output_tokens_per_s'] for r in g):.1f} | {ratio:.3f} | {dt:.1f} ms"
                f" | {gt - dt:+.1f} ms | {gi - di:+.2f} ms | {sum(r['failed'] or 0 for r in at)} |"
            )
    table = "\n".join(lines)
    print("\n" + table + "\n")
    report = {**report, "rows": rows, "table": table}
    print(f"wrote {write_report('engine_suite', report)}")


if __name__ == "__main__":
    main()
