"""Streaming chat through the gateway against the same replica directly, in one run.

For each concurrency the two sides alternate (direct, gateway, direct, …) with the same
prompts, so both see the same machine. Reports per concurrency: output tokens/s of each
side (median over rounds), their ratio gateway/direct, and time to first token p50/p95
with the gateway's added TTFT at p50.

Needs a running platform (``make run``); by default it reads the demo key and asks the
registry for the chat replica's endpoint:

    .venv/bin/python bench/gateway_overhead.py            # or: make bench
    .venv/bin/python bench/gateway_overhead.py --concurrency 1 16 64 --rounds 3 --max-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Describe the water cycle to a child.",
    "List some tips for learning a new language.",
    "What makes a good cup of tea?",
    "Tell me about the history of the printing press.",
    "Why is the sky blue?",
    "Give advice to someone starting to run.",
]


@dataclass
class Sample:
    ttft: float
    tokens: int
    ok: bool


async def one_stream(client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, Any]) -> Sample:
    started = time.perf_counter()
    ttft = 0.0
    tokens = 0
    async with client.stream("POST", url, headers=headers, content=orjson.dumps(body)) as response:
        if response.status_code != 200:
            await response.aread()
            return Sample(0.0, 0, False)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage") and not chunk.get("choices"):
                tokens = chunk["usage"]["completion_tokens"]
            elif not ttft and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - started
    return Sample(ttft, tokens, True)


async def wave(base: str, key: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = f"{base}/v1/chat/completions"
    queue = list(range(requests))
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                i = queue.pop()
                body = {
                    "model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True},
                }  # fmt: skip
                samples.append(await one_stream(client, url, headers, body))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    ok = [s for s in samples if s.ok]
    return {
        "elapsed": elapsed,
        "tokens": sum(s.tokens for s in ok),
        "tokens_per_s": sum(s.tokens for s in ok) / elapsed,
        "ttfts": [s.ttft for s in ok],
        "failed": len(samples) - len(ok),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def discover(args: argparse.Namespace) -> tuple[str, str, str]:
    """The platform key, and the chat replica's endpoint and own key (engines refuse others)."""
    key = args.key or json.loads((ROOT / "var" / "bootstrap.json").read_text())["demo_key"]
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
    import django

    django.setup()
    from registry.models import Replica
    from registry.replica_keys import replica_api_key

    replica = Replica.objects.filter(state="ready", deployment__version__model__name=args.model).first()
    if replica is None:
        raise SystemExit(f"no ready replica of {args.model}: is `make run` up?")
    return key, args.direct or replica.endpoint, replica_api_key(replica.pk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--direct", help="the replica's base URL (default: asked from the registry; its key always is)")
    parser.add_argument("--key", help="API key (default: the demo key in var/bootstrap.json)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    key, direct, direct_key = discover(args)  # sync: reads the registry before the event loop starts
    asyncio.run(run(args, key, direct, direct_key))


async def run(args: argparse.Namespace, key: str, direct: str, direct_key: str) -> None:
    print(f"gateway {args.gateway}  direct {direct}  model {args.model}  max_tokens {args.max_tokens}")
    keys = {"direct": direct_key, "gateway": key}
    await wave(direct, direct_key, args.model, 4, 4, 8)  # warm both paths
    await wave(args.gateway, key, args.model, 4, 4, 8)
    results = []
    for concurrency in args.concurrency:
        requests = max(concurrency * 2, 8)
        per_side: dict[str, list[dict[str, Any]]] = {"direct": [], "gateway": []}
        for round_no in range(args.rounds):
            for side, base in (("direct", direct), ("gateway", args.gateway)):
                outcome = await wave(base, keys[side], args.model, concurrency, requests, args.max_tokens)
                per_side[side].append(outcome)
                ttft_ms = statistics.median(outcome["ttfts"]) * 1000
                print(
                    f"  c={concurrency:<3d} round {round_no + 1} {side:8s} {outcome['tokens_per_s']:8.1f} tok/s"
                    f"  ttft p50 {ttft_ms:7.1f} ms  failed {outcome['failed']}"
                )
        ratios = [
            g["tokens_per_s"] / d["tokens_per_s"] for d, g in zip(per_side["direct"], per_side["gateway"], strict=True)
        ]
        ttft = {side: [t for o in outcomes for t in o["ttfts"]] for side, outcomes in per_side.items()}
        row = {
            "concurrency": concurrency,
            "requests_per_round": requests,
            "direct_tokens_per_s": statistics.median(o["tokens_per_s"] for o in per_side["direct"]),
            "gateway_tokens_per_s": statistics.median(o["tokens_per_s"] for o in per_side["gateway"]),
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "direct_ttft_p50_ms": statistics.median(ttft["direct"]) * 1000,
            "gateway_ttft_p50_ms": statistics.median(ttft["gateway"]) * 1000,
            "direct_ttft_p95_ms": percentile(ttft["direct"], 0.95) * 1000,
            "gateway_ttft_p95_ms": percentile(ttft["gateway"], 0.95) * 1000,
            "failed": sum(o["failed"] for outcomes in per_side.values() for o in outcomes),
        }
        row["added_ttft_p50_ms"] = row["gateway_ttft_p50_ms"] - row["direct_ttft_p50_ms"]
        results.append(row)
        if row["failed"]:
            print(
                f"  WARNING: {row['failed']} requests failed at concurrency {concurrency}, so this comparison is"
                " not valid (a rate limit or backpressure refusing the key? see the gateway log)"
            )
    print(
        "\n| concurrency | direct tok/s | gateway tok/s | ratio (median of rounds) "
        "| TTFT p50 direct | TTFT p50 gateway | added TTFT p50 |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['concurrency']} | {r['direct_tokens_per_s']:.0f} | {r['gateway_tokens_per_s']:.0f} "
            f"| {r['ratio']:.3f} | {r['direct_ttft_p50_ms']:.1f} ms | {r['gateway_ttft_p50_ms']:.1f} ms "
            f"| {r['added_ttft_p50_ms']:+.1f} ms |"
        )
    out = Path(args.out)
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report = {
        "date": stamp,
        "machine": f"{platform.node()} {os.cpu_count()} cpus",
        "args": vars(args),
        "results": results,
    }
    (out / f"gateway_overhead-{stamp}.json").write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {out / f'gateway_overhead-{stamp}.json'}")


if __name__ == "__main__":
    main()
