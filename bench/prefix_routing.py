"""Prefix-aware routing against least-busy routing, on two real SmolLM2 vLLM replicas, in one run.

A chat workload of many conversations that share a few long system prompts and grow turn by
turn (each turn sends the whole conversation so far, the engine's own answers included) is
sent through two gateways of the same platform, one with ``ROUTING_PREFIX_AWARE=true`` and one
with ``false``, alternately, round by round (which goes first alternates too). Each phase uses
system prompts and questions of its own, so no phase finds another's prefixes cached. For each
policy: TTFT p50 and p99 (time to the first content chunk of a streamed answer, through the
gateway), and the engines' prefix-cache hit rate over the phase, from their own /metrics
(``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, summed over both
replicas); then the ratios (least busy / prefix-aware for TTFT, prefix-aware / least busy for the
hit rate). The report goes to bench/results/prefix_routing-<time>.json.

Needs a running platform (``make run``, or ``--start-platform``) whose chat model has two ready
replicas: ``--scale`` sets its deployment's ``min_replicas`` to 2 (the supervisors with free slots
start the second; the autoscaler keeps both) and waits.
On CPU give each replica its own cores (``WORKER_SLOTS`` / ``VLLM_CPU_OMP_THREADS_BIND``, see
DESIGN.md): two replicas on one core measure the core, not the routing.

    .venv/bin/python bench/prefix_routing.py --scale
    .venv/bin/python bench/prefix_routing.py --start-platform --scale --conversations 48 --turns 6
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mock_suite import bench_key, django_setup, free_port, report_start, spawn, wait_http, write_report

WORDS = [
    "deployment", "replica", "version", "canary", "rollout", "budget", "invoice", "latency", "token", "stream",
    "cache", "prefix", "gateway", "engine", "scheduler", "batch", "quota", "organisation", "key", "limit",
    "metric", "alert", "dashboard", "artifact", "weights", "tokenizer", "context", "window", "sampling", "temperature",
    "answer", "question", "policy", "region", "host", "queue", "worker", "supervisor", "heartbeat",
]  # fmt: skip


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def replicas_of(model: str) -> list[tuple[int, str]]:
    """The model's ready replicas: (id, endpoint)."""
    from registry.models import Replica

    return [
        (r.pk, r.endpoint)
        for r in Replica.objects.filter(state="ready", deployment__version__model__name=model).order_by("pk")
    ]


def scale_to_two(
    model: str, timeout: float, *, drain_others: bool = False, drained: list[int] | None = None
) -> list[tuple[int, str]]:
    """Keep the model's running deployment at two replicas at least (its autoscaler bounds:
    min 2, so no scale-in during the run; supervisors with free slots start the second), and
    wait until two are ready. ``drain_others``: drain every other running deployment first, so
    a host with two slots (this 2-core box: the bundled embedding model holds one) frees one;
    their ids go to ``drained`` (``restore`` runs them again)."""
    from registry.models import Deployment
    from registry.services import SystemActor, deployment_bounds_set, deployment_transition

    deployment = Deployment.objects.filter(version__model__name=model, status="running").first()
    if deployment is None:
        raise SystemExit(f"{model} has no running deployment")
    if drain_others:
        for other in Deployment.objects.filter(status="running").exclude(pk=deployment.pk):
            deployment_transition(deployment=other, status=Deployment.Status.DRAINING)
            if drained is not None:
                drained.append(other.pk)
            print(f"  deployment {other.pk} ({other.version}) drained to free its slot", flush=True)
    if deployment.min_replicas < 2:
        deployment_bounds_set(actor=SystemActor("bench/prefix_routing.py"), deployment=deployment, min_replicas=2,
                              max_replicas=max(2, deployment.max_replicas))  # fmt: skip
        print(f"  {model}'s deployment {deployment.pk}: min_replicas 2 (was {deployment.min_replicas})", flush=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = replicas_of(model)
        if len(ready) >= 2:
            return ready
        print(f"  {len(ready)} of 2 replicas of {model} ready; waiting", flush=True)
        time.sleep(10)
    raise SystemExit(f"{model} did not get two ready replicas in {timeout:g} s")


def restore(drained: list[int]) -> None:
    """Run again the deployments ``scale_to_two`` drained (the platform is not ready without
    them: the next ``make run`` would wait for their replicas)."""
    from registry.models import Deployment
    from registry.services import deployment_transition

    for deployment in Deployment.objects.filter(pk__in=drained, status=Deployment.Status.DRAINING):
        deployment_transition(deployment=deployment, status=Deployment.Status.RUNNING)
        print(f"  deployment {deployment.pk} ({deployment.version}) running again", flush=True)


def start_platform(workdir: Path) -> tuple[Any, str]:
    from engine_suite import start_platform as start

    return start(workdir / "platform.log")


class Gateway:
    """A gateway process of the platform with one routing policy."""

    def __init__(self, workdir: Path, *, aware: bool) -> None:
        from console.servers import server_command

        self.aware = aware
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {"ROUTING_PREFIX_AWARE": "true" if aware else "false", "PYTHONUNBUFFERED": "1"}
        cmd = server_command(sys.executable, host="127.0.0.1", port=self.port, processes=1)
        self.proc = spawn(cmd, workdir / f"gateway-{'prefix' if aware else 'load'}.log", env)
        wait_http(f"{self.base}/healthz", self.proc, f"gateway (prefix-aware={aware})")

    @property
    def name(self) -> str:
        return "prefix-aware" if self.aware else "least-busy"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)


def engine_counters(endpoints: list[str]) -> tuple[float, float]:
    """Prefix-cache hits and queries (tokens), summed over the replicas' /metrics."""
    hits = queries = 0.0
    for endpoint in endpoints:
        for line in httpx.get(f"{endpoint.rstrip('/')}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def conversation(
    client: httpx.AsyncClient, gateway: Gateway, key: str, model: str, system: str, rng: random.Random,
    args: argparse.Namespace, ttfts: list[float],
) -> int:  # fmt: skip
    """One conversation, turn by turn; each turn's TTFT (seconds) goes to ``ttfts``. Returns failures."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    failures = 0
    for _ in range(args.turns):
        messages.append({"role": "user", "content": text(rng, args.question_words)})
        body = {"model": model, "messages": messages, "stream": True, "max_tokens": args.output_tokens,
                "temperature": 0}  # fmt: skip
        started = time.perf_counter()
        first: float | None = None
        answer: list[str] = []
        try:
            async with client.stream(
                "POST", f"{gateway.base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    failures += 1
                    break
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = orjson.loads(line[6:])
                    for choice in event.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            if first is None:
                                first = time.perf_counter() - started
                            answer.append(piece)
        except httpx.HTTPError:
            failures += 1
            break
        if first is not None:
            ttfts.append(first)
        messages.append({"role": "assistant", "content": "".join(answer)})
    return failures


async def phase(
    gateway: Gateway, key: str, model: str, endpoints: list[str], seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One policy's turn: ``conversations`` conversations, ``concurrency`` at a time."""
    rng = random.Random(seed)
    tag = f"[{seed}] "  # this phase's own prompts: nothing cached from another phase
    systems = [tag + text(rng, args.system_words) for _ in range(args.system_prompts)]
    ttfts: list[float] = []
    failures = 0
    before = engine_counters(endpoints)
    started = time.perf_counter()
    semaphore = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(i: int) -> int:
            async with semaphore:
                return await conversation(client, gateway, key, model, systems[i % len(systems)],
                                          random.Random(seed * 1000 + i), args, ttfts)  # fmt: skip

        failures = sum(await asyncio.gather(*(one(i) for i in range(args.conversations))))
    elapsed = time.perf_counter() - started
    hits, queries = (after - first for after, first in zip(engine_counters(endpoints), before, strict=True))
    return {"policy": gateway.name, "seed": seed, "seconds": round(elapsed, 1), "requests": len(ttfts),
            "failures": failures, "ttfts": ttfts, "hits": hits, "queries": queries}  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary(phases: list[dict[str, Any]], policy: str) -> dict[str, Any]:
    mine = [p for p in phases if p["policy"] == policy]
    ttfts = [t for p in mine for t in p["ttfts"]]
    hits, queries = sum(p["hits"] for p in mine), sum(p["queries"] for p in mine)
    return {
        "requests": len(ttfts),
        "failures": sum(p["failures"] for p in mine),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1) if ttfts else None,
        "ttft_p99_ms": round(percentile(ttfts, 0.99) * 1000, 1) if ttfts else None,
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
        "hit_rate_by_round": [round(p["hits"] / p["queries"], 4) if p["queries"] else None for p in mine],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start-platform", action="store_true", help="run manage.py runplatform for the benchmark")
    parser.add_argument("--scale", action="store_true", help="set the deployment's min_replicas to 2 and wait for both")
    parser.add_argument(
        "--drain-others", action="store_true", help="with --scale: drain every other running deployment (frees a slot)"
    )
    parser.add_argument("--scale-timeout", type=float, default=900.0, help="seconds to wait for two ready replicas")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3, help="each round runs both policies, alternating first")
    parser.add_argument("--conversations", type=int, default=32, help="per phase")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--concurrency", type=int, default=16, help="conversations at once")
    parser.add_argument("--system-prompts", type=int, default=4, help="distinct system prompts per phase")
    parser.add_argument("--system-words", type=int, default=600, help="words per system prompt (~1 token each)")
    parser.add_argument("--question-words", type=int, default=60, help="words per user turn")
    parser.add_argument("--output-tokens", type=int, default=48, help="max_tokens per answer")
    args = parser.parse_args()
    report = report_start(args)
    workdir = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    platform_proc = None
    gateways: list[Gateway] = []
    drained: list[int] = []
    try:
        if args.start_platform:
            print(f"starting the platform (log: {workdir / 'platform.log'}); loading models takes minutes", flush=True)
            platform_proc, _ = start_platform(workdir)
        django_setup()
        if args.scale:
            replicas = scale_to_two(args.model, args.scale_timeout, drain_others=args.drain_others, drained=drained)
        else:
            replicas = replicas_of(args.model)
        if len(replicas) < 2:
            raise SystemExit(f"{args.model} has {len(replicas)} ready replica(s): two are needed (--scale)")
        endpoints = [endpoint for _, endpoint in replicas[:2]]
        key = bench_key()
        gateways = [Gateway(workdir, aware=True), Gateway(workdir, aware=False)]
        print(f"replicas {endpoints}; gateways {[g.base for g in gateways]}", flush=True)
        # Warm up each gateway (its routing table, tokenizer, connections) with a phase of its own.
        warm = argparse.Namespace(**{**vars(args), "conversations": 2, "turns": 1})
        for gateway in gateways:
            asyncio.run(phase(gateway, key, args.model, endpoints, 1, warm))
        phases: list[dict[str, Any]] = []
        for round_ in range(args.rounds):
            order = gateways if round_ % 2 == 0 else gateways[::-1]
            for gateway in order:
                result = asyncio.run(phase(gateway, key, args.model, endpoints, 100 + len(phases), args))
                phases.append(result)
                rate = result["hits"] / result["queries"] if result["queries"] else float("nan")
                print(f"round {round_ + 1} {gateway.name:>12}: {result['requests']} requests in "
                      f"{result['seconds']} s, TTFT p50 {statistics.median(result['ttfts']) * 1000:.0f} ms, "
                      f"hit rate {rate:.1%}, {result['failures']} failed", flush=True)  # fmt: skip
        aware, load = summary(phases, "prefix-aware"), summary(phases, "least-busy")
        report["replicas"] = endpoints
        report["prefix_aware"], report["least_busy"] = aware, load
        report["ratios"] = {
            "ttft_p50_least_busy_over_prefix_aware": round(load["ttft_p50_ms"] / aware["ttft_p50_ms"], 3),
            "ttft_p99_least_busy_over_prefix_aware": round(load["ttft_p99_ms"] / aware["ttft_p99_ms"], 3),
            "hit_rate_prefix_aware_over_least_busy": (
                round(aware["prefix_cache_hit_rate"] / load["prefix_cache_hit_rate"], 3)
                if load["prefix_cache_hit_rate"] else None
            ),
        }  # fmt: skip
        report["phases"] = [{k: v for k, v in p.items() if k != "ttfts"} for p in phases]
        print(orjson.dumps({k: report[k] for k in ("prefix_aware", "least_busy", "ratios")},
                           option=orjson.OPT_INDENT_2).decode())  # fmt: skip
        print(f"report: {write_report('prefix_routing', report)}")
    finally:
        for gateway in gateways:
            gateway.stop()
        if drained:
            restore(drained)
        if platform_proc is not None:
            os.killpg(platform_proc.pid, signal.SIGTERM)


if __name__ == "__main__":
    main()
