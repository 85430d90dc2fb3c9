"""A cache hit end to end against a generation, through the running gateway, in one run.

For each question (the ``a`` side of should-hit pairs in bench/data/semantic_cache_pairs.jsonl)
it sends, at temperature 0 and with a system prompt unique to this run (a fresh scope, so
the first request cannot be a hit left by an earlier run):

1. the question: a miss, answered by the engine (``generation``);
2. the same question again: an exact ``hit``;
3. its paraphrase (``b``): a ``semantic-hit`` when the verifier accepts it, else a miss.

Each request is timed from the client (whole JSON response, or time to first content and
to the end of an SSE stream). The cache's own share comes from the ``Server-Timing``
header. Reports medians and p95 per outcome and the ratios hit / generation; nothing
here asserts engine text.

Needs a running platform (``make run``) and reads the demo key from var/bootstrap.json:

    .venv/bin/python bench/semantic_cache_hit.py
    .venv/bin/python bench/semantic_cache_hit.py --questions 40 --max-tokens 64 --stream
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
PAIRS = ROOT / "bench" / "data" / "semantic_cache_pairs.jsonl"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": round(statistics.median(values), 2), "p95": round(percentile(values, 0.95), 2)}


def server_timing(header: str | None, name: str) -> float | None:
    """``dur`` of one Server-Timing metric, in ms."""
    for part in (header or "").split(","):
        if part.strip().split(";")[0] == name:
            found = re.search(r"dur=([0-9.]+)", part)
            return float(found.group(1)) if found else None
    return None


async def ask(client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, Any],
              stream: bool) -> dict[str, Any]:  # fmt: skip
    """One request: outcome (x-cache), client-side times in ms, the cache's Server-Timing."""
    started = time.perf_counter()
    first: float | None = None
    if not stream:
        response = await client.post(url, headers=headers, content=orjson.dumps(body))
        total = (time.perf_counter() - started) * 1000
        if response.status_code != 200:
            raise SystemExit(f"HTTP {response.status_code}: {response.text[:300]}")
        tokens = response.json()["usage"]["completion_tokens"]
    else:
        tokens = 0
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", url, headers=headers, content=orjson.dumps(streamed)) as response:
            if response.status_code != 200:
                await response.aread()
                raise SystemExit(f"HTTP {response.status_code}: {response.text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    first = (time.perf_counter() - started) * 1000
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        total = (time.perf_counter() - started) * 1000
    return {
        "outcome": response.headers.get("x-cache", "none"),
        "total_ms": total,
        "first_ms": first,
        "cache_ms": server_timing(response.headers.get("server-timing"), "cache"),
        "completion_tokens": tokens,
    }


async def run(args: argparse.Namespace, key: str) -> dict[str, Any]:
    rows = [json.loads(line) for line in PAIRS.read_text(encoding="utf-8").splitlines() if line.strip()]
    pairs = [r for r in rows if r["label"] == "hit"][: args.questions]
    system = f"You are a helpful assistant. Answer briefly. (cache benchmark {time.time_ns()})"
    url = f"{args.gateway.rstrip('/')}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def body(question: str) -> dict[str, Any]:
        return {"model": args.model, "temperature": 0, "max_tokens": args.max_tokens,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}  # fmt: skip

    samples: dict[str, list[dict[str, Any]]] = defaultdict(list)
    async with httpx.AsyncClient(timeout=120) as client:
        await ask(client, url, headers, {**body("Hello"), "cache": False}, args.stream)  # warm the path
        for i, pair in enumerate(pairs, 1):
            for step, question in (("first", pair["a"]), ("again", pair["a"]), ("paraphrase", pair["b"])):
                sample = await ask(client, url, headers, body(question), args.stream)
                sample["step"] = step
                samples[sample["outcome"]].append(sample)
            print(f"{i}/{len(pairs)}", {k: len(v) for k, v in samples.items()}, file=sys.stderr, flush=True)

    def figures(kind: str) -> dict[str, Any]:
        got = samples.get(kind, [])
        if not got:
            return {"n": 0}
        out: dict[str, Any] = {"total_ms": summary([s["total_ms"] for s in got])}
        if args.stream:
            out["first_content_ms"] = summary([s["first_ms"] for s in got if s["first_ms"] is not None])
        cache = [s["cache_ms"] for s in got if s["cache_ms"] is not None]
        if cache:
            out["server_timing_cache_ms"] = summary(cache)
        out["completion_tokens_p50"] = statistics.median(s["completion_tokens"] for s in got)
        return out

    result: dict[str, Any] = {kind: figures(kind) for kind in ("miss", "hit", "semantic-hit")}
    generation = result["miss"].get("total_ms", {}).get("p50")
    for kind in ("hit", "semantic-hit"):
        if generation and result[kind].get("total_ms"):
            result[kind]["p50_over_generation_p50"] = round(result[kind]["total_ms"]["p50"] / generation, 4)
    result["paraphrases_served"] = f"{len(samples.get('semantic-hit', []))}/{len(pairs)}"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--key", help="API key (default: the demo key in var/bootstrap.json)")
    parser.add_argument("--questions", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream", action="store_true", help="SSE: time to first content as well")
    args = parser.parse_args()
    key = args.key or json.loads((ROOT / "var" / "bootstrap.json").read_text())["demo_key"]
    outcome = asyncio.run(run(args, key))
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()},
        "arguments": vars(args),
        **outcome,
    }
    print(json.dumps(result, indent=1))
    out = ROOT / "bench" / "results" / f"semantic_cache_hit-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"results: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
