"""Batch jobs (issue 21): throughput, exactly-once counts, and what a batch costs interactive traffic.

``fake``: a 10,000-line chat batch against the mock engine (bench/mock_openai.py), through the
platform's own parts: a gateway takes the upload and the batch (the unmodified openai SDK),
``--workers`` Celery batch workers (``celery worker -Q batch``, as runplatform starts them) run
it. Reported: lines per second from in_progress to completed, and the counts that must hold:
output lines, distinct custom_ids, requests the engine saw, usage records of the batch's lines
and usage events on the ledger's stream for them (each exactly the line count: 0 duplicates).
Isolated like the other suites: its own database, Redis database and artifact store.

``engine``: the platform as ``make run`` starts it (``manage.py runplatform``, real vLLM serving
SmolLM2 on this machine's CPU) and, on its one replica: interactive streamed chat requests
(``--clients`` at a time, each prompt new, the semantic cache bypassed) measured alone and
while a ``--lines``-line batch of the same model runs, alternating ``--rounds`` times, and alone
once more at the end; TTFT p50/p99 of each phase, each batch phase's ratio to the alone phases
either side of it (and how far those two differ: the machine's noise), the batches' lines per
second, and their counts. And the pooled figure: p99 of every request of every batch phase
against p99 of every request of every alone phase (the phases alternate, so the machine's drift
falls on both), with a 95 % bootstrap interval of that ratio. Each phase's TTFTs are kept with
each request's start, and every quarter second the CPU each part of the platform used (the
engine, the gateway, each Celery queue, PostgreSQL, Redis) and the requests the engines ran and
held waiting (their /metrics): the report gives each part's cores and the engines' requests in
the second before the slowest first tokens, against the whole run and each phase.

    .venv/bin/python bench/batch_suite.py fake --lines 10000 --workers 2
    .venv/bin/python bench/batch_suite.py engine --lines 200 --clients 2 --requests 200 --rounds 3

Writes bench/results/batch-<part>-<time>.json; docs/performance.md has a run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import mock_suite
import orjson
import psutil
from mock_suite import ROOT, report_start, spawn, write_report

DATABASE = "inference_bench_batch"
REDIS_DB = 5  # the platform uses 0, the soak 8, the predict bench 7, the test sessions 9 to 15
NAMESPACE = "ip-bench-batch"


def chat_lines(model: str, count: int, *, max_tokens: int) -> bytes:
    """``count`` requests, each new to the semantic cache (the run's time is in every prompt)."""
    run = time.strftime("%H%M%S")
    lines = []
    for i in range(count):
        prompt = f"Write one short sentence about the number {i} ({run})."
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
        lines.append({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def batch_workers(count: int, workdir: Path, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    command = [sys.executable, "-m", "celery", "-A", "console", "worker", "--queues", "batch", "--concurrency", "1",
               "--pool", "solo", "--loglevel", "WARNING", "--without-mingle", "--without-gossip"]  # fmt: skip
    return [
        spawn([*command, "--hostname", f"bench-batch-{i}@%h"], workdir / f"batch-worker-{i}.log", env)
        for i in range(count)
    ]


def run_batch(base: str, key: str, content: bytes, *, poke: bool, timeout: float) -> dict[str, Any]:
    """Upload, create, wait (sending batch_work every second when ``poke``: no beat runs);
    the batch's figures and its output."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=2, timeout=120)
    uploaded = client.files.create(file=("bench.jsonl", content), purpose="batch")
    created = time.time()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + timeout
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        if time.monotonic() > deadline:
            raise SystemExit(f"batch {batch.id} still {batch.status} after {timeout} s")
        if poke:
            from console.celery import app

            app.send_task("serving.tasks.batch_work", expires=5)
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
    finished = time.time()
    output = client.files.content(batch.output_file_id).read().splitlines() if batch.output_file_id else []
    errors = client.files.content(batch.error_file_id).read().splitlines() if batch.error_file_id else []
    counts = batch.request_counts
    assert counts is not None
    started = batch.in_progress_at or int(created)
    seconds = max(1, (batch.completed_at or int(time.time())) - started)
    rows = [orjson.loads(line) for line in output]
    return {
        "batch": batch.id,
        "status": batch.status,
        "lines": counts.total,
        "completed": counts.completed,
        "failed": counts.failed,
        "seconds_in_progress": seconds,
        "seconds_total": round(finished - created, 1),
        "created_at": created,
        "lines_per_s": round(counts.completed / seconds, 1),
        "output_lines": len(rows),
        "error_lines": len(errors),
        "distinct_custom_ids": len({r["custom_id"] for r in rows}),
        "all_200": all(r["response"]["status_code"] == 200 for r in rows),
    }


def metering_counts(batch_id: str, lines: int) -> dict[str, int]:
    """Usage records and usage-stream events of the batch's lines (any attempt), and how many
    lines have more than one record."""
    from billing.models import UsageRecord
    from billing.usage import persist_usage_stream
    from core import keys
    from core.redis import sync_redis
    from serving.batches.services import line_request_id
    from serving.models import BatchLine

    attempts = dict(BatchLine.objects.filter(batch__public_id=batch_id).values_list("index", "attempts"))
    by_line = {
        str(line_request_id(batch_id, i, a)): i for i in range(lines) for a in range(1, max(1, attempts.get(i, 1)) + 1)
    }
    events = 0  # on the stream before the persister takes them (nothing else runs it here)
    entries: Any = sync_redis().xrange(keys.usage_stream(), count=10**7)
    for _id, fields in entries:
        if fields.get(b"request_id", b"").decode() in by_line:
            events += 1
    while persist_usage_stream():
        pass
    records = UsageRecord.objects.filter(request_id__in=list(by_line)).values_list("request_id", "batch")
    per_line: dict[int, int] = {}
    for request_id, _batch in records:
        index = by_line[str(request_id)]
        per_line[index] = per_line.get(index, 0) + 1
    return {
        "usage_records": sum(per_line.values()),
        "lines_metered": len(per_line),
        "duplicate_records": sum(n - 1 for n in per_line.values()),
        "usage_events_on_stream": events,
        "batch_flag_on_all": int(all(flag for _rid, flag in records)),
    }


# --- fake: 10,000 lines against the mock engine ------------------------------------------------


def fake(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    mock_suite.isolate(database=DATABASE, redis_db=REDIS_DB, namespace=NAMESPACE, artifacts="bench-batch/artifacts")
    mock_suite.database_prepare(DATABASE)
    from core.redis import sync_redis

    sync_redis().flushdb()  # this bench's own Redis database: a clean stream and queue
    mock = mock_suite.start_mock(workdir, tokens=8)
    key = mock_suite.setup_platform(mock.base, tokenizer=False)
    env = {
        "REPLICA_STALE_AFTER": "31536000",  # the mock has no supervisor sending heartbeats
        "BATCH_SLOTS_PER_REPLICA": str(args.slots),
        "BATCH_WORK_SECONDS": "30",
        "PYTHONUNBUFFERED": "1",
    }
    gateway = mock_suite.start_gateway("uvicorn", workdir, key)
    workers = batch_workers(args.workers, workdir, env)
    try:
        result = run_batch(gateway.base, key, chat_lines(mock_suite.MODEL, args.lines, max_tokens=8), poke=True,
                           timeout=args.timeout)  # fmt: skip
        result["engine_requests"] = mock_requests(mock.base)
        result.update(metering_counts(result["batch"], args.lines))
    finally:
        for worker in workers:
            worker.terminate()
        for process in (gateway.proc, mock.proc):
            process.terminate()
        mock_suite.retire_mock_model()
    result.update(workers=args.workers, slots_per_replica=args.slots)
    return result


def mock_requests(base: str) -> int | None:
    try:
        return int(httpx.get(f"{base}/stats", timeout=5).json()["requests"])
    except (httpx.HTTPError, KeyError, ValueError):
        return None


# --- engine: SmolLM2 on vLLM, interactive TTFT with and without a batch --------------------------


async def ttft_run(
    base: str, key: str, model: str, clients: int, requests: int, phase: str
) -> list[tuple[float, float]]:
    """``requests`` streamed chat completions, ``clients`` at a time: each one's start (wall
    clock, s) and TTFT (s). Each prompt is new (``phase`` is in it) and the semantic cache is
    bypassed: every one is run."""
    headers = {"Authorization": f"Bearer {key}", "Cache-Control": "no-store"}
    times: list[tuple[float, float]] = []
    queue = list(range(requests))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            prompt = f"Say something about the colour number {i} ({phase})."
            body = {"model": model, "stream": True, "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
            began_at, started = time.time(), time.perf_counter()
            async with http.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as answer:
                answer.raise_for_status()
                first = True
                async for line in answer.aiter_lines():  # read to the end: the request completes
                    if first and line.startswith("data: ") and '"content"' in line:
                        times.append((began_at, time.perf_counter() - started))
                        first = False

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return times


def _group(line: str) -> str | None:
    """Which part of the platform a process is, by its command line (None: its parent's part)."""
    for mark, name in (("vllm", "engine"), ("VLLM", "engine"), ("serving.predict.worker", "predict worker"),
                       ("runworkers", "supervisor"), ("--queues batch", "celery batch"),
                       ("--queues metering", "celery metering"), (" beat ", "celery beat"),
                       ("celery", "celery, other queues"), ("uvicorn", "gateway"), ("console.gateway", "gateway"),
                       ("rungrpc", "grpc")):  # fmt: skip
        if mark in line:
            return name
    return None


class CpuSampler:
    """Every ``every`` s, the CPU seconds each part of the platform used (runplatform's tree by
    ``_group``, PostgreSQL, Redis): what else ran when an interactive request was slow; and the
    requests the vLLM engines were running and holding waiting (their own /metrics)."""

    def __init__(self, root: int, every: float = 0.25) -> None:
        self.root, self.every = root, every
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.engine: list[tuple[float, float, float]] = []  # (time, running, waiting) over the engines
        self._engine_ports: set[int] = set()
        self._seen: dict[int, tuple[psutil.Process, str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _processes(self) -> dict[int, tuple[psutil.Process, str]]:
        found: dict[int, tuple[psutil.Process, str]] = {}

        def walk(process: psutil.Process, inherited: str) -> None:
            try:
                children = process.children()
            except psutil.Error:  # gone meanwhile
                return
            for child in children:
                try:
                    line = child.cmdline()
                except psutil.Error:
                    continue
                group = _group(" ".join(line)) or inherited  # an engine's own workers are the engine's
                found[child.pid] = (child, group)
                if "vllm.entrypoints.openai.api_server" in line and "--port" in line:
                    with contextlib.suppress(ValueError, IndexError):
                        self._engine_ports.add(int(line[line.index("--port") + 1]))
                walk(child, group)

        with contextlib.suppress(psutil.Error):
            walk(psutil.Process(self.root), "runplatform")
        for process in psutil.process_iter(["name"]):
            if process.info["name"] in ("postgres", "redis-server"):
                found[process.pid] = (process, str(process.info["name"]))
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            used: dict[str, float] = {}
            for pid, (process, group) in self._processes().items():
                try:
                    times = process.cpu_times()
                except psutil.Error:
                    continue
                total = times.user + times.system
                earlier = self._seen.get(pid)
                self._seen[pid] = (process, group, total)
                if earlier is not None:
                    used[group] = used.get(group, 0.0) + total - earlier[2]
            self.samples.append((time.time(), {k: round(v, 3) for k, v in used.items()}))
            counts = self._engine_counts()
            if counts is not None:
                self.engine.append((time.time(), *counts))

    def _engine_counts(self) -> tuple[float, float] | None:
        running = waiting = 0.0
        for port in list(self._engine_ports):
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=0.5).text
            except httpx.HTTPError:
                return None
            for line in text.splitlines():
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    if name.startswith("vllm:num_requests_running"):
                        running += float(value)
                    elif name.startswith("vllm:num_requests_waiting"):
                        waiting += float(value)
        return (running, waiting) if self._engine_ports else None

    def engine_around(self, moments: list[float], before: float = 1.0) -> dict[str, float]:
        """The engines' mean requests running and waiting over the ``before`` s ending at each of
        ``moments`` (the bench's interactive requests included)."""
        seen = [(running, waiting) for moment in moments for at, running, waiting in self.engine
                if moment - before < at <= moment]  # fmt: skip
        if not seen:
            return {}
        return {"running": round(statistics.fmean(r for r, _ in seen), 2),
                "waiting": round(statistics.fmean(w for _, w in seen), 2), "samples": len(seen)}  # fmt: skip

    def whole_run(self) -> dict[str, float]:
        """Each part's mean CPU (cores) from the first sample to the last."""
        if len(self.samples) < 2:
            return {}
        return self.around([self.samples[-1][0]], before=self.samples[-1][0] - self.samples[0][0])

    def around(self, moments: list[float], before: float = 1.0) -> dict[str, float]:
        """Each part's mean CPU (cores) over the ``before`` s ending at each of ``moments``."""
        used: dict[str, float] = {}
        for moment in moments:
            for at, sample in self.samples:
                if moment - before < at <= moment:
                    for group, seconds in sample.items():
                        used[group] = used.get(group, 0.0) + seconds
        span = before * max(1, len(moments))
        return {group: round(seconds / span, 2) for group, seconds in sorted(used.items(), key=lambda kv: -kv[1])}


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def quantiles(times: list[tuple[float, float]]) -> dict[str, float]:
    """p50 and p99 of every request; and p99 of those that began after the phase's first
    second (``steady``: once a burst of interactive requests has made batch lines yield)."""
    every = [ttft for _, ttft in times]
    first = min(start for start, _ in times)
    steady = [ttft for start, ttft in times if start - first >= 1.0] or every
    return {
        "n": len(every), "p50_ms": round(statistics.median(every) * 1000, 1), "p99_ms": round(_p99(every) * 1000, 1),
        "p99_steady_ms": round(_p99(steady) * 1000, 1), "max_ms": round(max(every) * 1000, 1),
    }  # fmt: skip


def pooled_ratio(alone: list[float], during: list[float], *, resamples: int = 2000) -> dict[str, Any]:
    """p50 and p99 of the pooled TTFTs with a batch over those alone, each with a 95 % percentile
    bootstrap interval (both pools resampled; a fixed seed, so a report can be recomputed)."""
    draw = random.Random(38)
    out: dict[str, Any] = {"n_alone": len(alone), "n_with_batch": len(during)}
    for name, pick in (("p50", statistics.median), ("p99", _p99)):
        ratios = sorted(
            pick(draw.choices(during, k=len(during))) / pick(draw.choices(alone, k=len(alone)))
            for _ in range(resamples)
        )
        out[f"{name}_ratio"] = round(pick(during) / pick(alone), 3)
        out[f"{name}_ratio_95"] = [round(ratios[int(0.025 * resamples)], 3), round(ratios[int(0.975 * resamples)], 3)]
    return out


def _batch_round(
    base: str, key: str, args: argparse.Namespace, phase: str
) -> tuple[list[tuple[float, float]], dict[str, Any]]:
    """A batch of ``args.lines`` created, ``args.settle`` s for it to run at its share, then the
    interactive requests while it runs; waits for the batch to end. (TTFTs, the batch's figures)"""
    content = chat_lines(args.model, args.lines, max_tokens=16)
    outcome: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: outcome.update(run_batch(base, key, content, poke=False,
                                                                      timeout=args.timeout)))  # fmt: skip
    runner.start()
    time.sleep(args.settle)  # the batch validated and running at its share
    during = asyncio.run(ttft_run(base, key, args.model, args.clients, args.requests, phase))
    during_ended = time.time()
    runner.join()
    outcome.update(metering_counts(outcome["batch"], args.lines))
    outcome.pop("usage_events_on_stream")  # the platform's own persister has taken them
    # The figure counts only if the batch ran the whole time the "during" requests did.
    outcome["ran_through_the_measurement"] = outcome["seconds_total"] + outcome["created_at"] >= during_ended
    return during, outcome


def engine(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """``--rounds`` alternations of alone / with a batch, and alone once more at the end: each
    batch phase is judged against the alone phases on either side of it (the machine's drift
    between them is the noise to read the ratio against)."""
    from engine_suite import start_platform

    os.environ["ENGINE_SCHEDULING_POLICY"] = args.policy
    os.environ["BATCH_MIN_SLOTS"] = str(args.min_slots)
    proc, base = start_platform(workdir / "runplatform.log")
    alone: list[dict[str, float]] = []
    rounds: list[dict[str, Any]] = []
    ttfts: dict[str, list[float]] = {}  # phase: each request's TTFT (s)
    starts: dict[str, list[float]] = {}  # phase: each request's start (wall-clock s)
    sampler = CpuSampler(proc.pid)
    sampler.start()
    try:
        key = mock_suite.bench_key()
        time.sleep(args.settle)  # the platform's other engines and workers done starting
        asyncio.run(ttft_run(base, key, args.model, args.clients, 10, "warm-up"))
        for i in range(args.rounds + 1):  # and alone once more at the end
            by_itself = asyncio.run(ttft_run(base, key, args.model, args.clients, args.requests, f"alone-{i}"))
            alone.append(quantiles(by_itself))
            ttfts[f"alone-{i}"] = [round(ttft, 4) for _, ttft in by_itself]
            starts[f"alone-{i}"] = [round(at, 3) for at, _ in by_itself]
            if i == args.rounds:
                break
            during, outcome = _batch_round(base, key, args, f"during-{i}")
            rounds.append({"with_batch": quantiles(during), "batch": outcome})
            ttfts[f"during-{i}"] = [round(ttft, 4) for _, ttft in during]
            starts[f"during-{i}"] = [round(at, 3) for at, _ in during]
    finally:
        sampler.stop()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(120)
    for i, one in enumerate(rounds):
        before, after = alone[i], alone[i + 1]
        for figure in ("p50_ms", "p99_ms", "p99_steady_ms"):
            # Against the mean of the alone phases either side; and how far those two differ.
            one[f"{figure}_ratio"] = round(one["with_batch"][figure] / ((before[figure] + after[figure]) / 2), 3)
            one[f"{figure}_alone_drift"] = round(
                max(before[figure], after[figure]) / min(before[figure], after[figure]), 3
            )
    summary = {
        f"{figure}_ratio": {
            "median": round(statistics.median(r[f"{figure}_ratio"] for r in rounds), 3),
            "min": min(r[f"{figure}_ratio"] for r in rounds), "max": max(r[f"{figure}_ratio"] for r in rounds),
            "alone_drift_median": round(statistics.median(r[f"{figure}_alone_drift"] for r in rounds), 3),
        }
        for figure in ("p50_ms", "p99_ms", "p99_steady_ms")
    }  # fmt: skip
    # What ran in the second before the slowest requests' first tokens (over 2x their phase's
    # median), against the whole run: a part busier there is what the tail waited on.
    slow = {
        kind: [
            start + ttft
            for phase in ttfts if phase.startswith(kind)
            for start, ttft in zip(starts[phase], ttfts[phase], strict=True)
            if ttft > 2 * statistics.median(ttfts[phase])
        ]
        for kind in ("alone", "during")
    }  # fmt: skip
    summary["cpu_cores_before_slow_first_tokens"] = {kind: {"requests": len(m), "cores": sampler.around(m)}
                                                     for kind, m in slow.items()}  # fmt: skip
    summary["engine_requests_before_slow_first_tokens"] = {kind: sampler.engine_around(m) for kind, m in slow.items()}
    # (requests are kept in the order their first tokens came, not their starts)
    summary["engine_requests_by_phase"] = {
        phase: sampler.engine_around([max(began)], before=max(began) - min(began)) for phase, began in starts.items()
    }
    summary["cpu_cores_whole_run"] = sampler.whole_run()
    summary["pooled"] = pooled_ratio(
        [t for phase, times in ttfts.items() if phase.startswith("alone") for t in times],
        [t for phase, times in ttfts.items() if phase.startswith("during") for t in times],
    )
    return {
        "policy": args.policy,
        "min_slots": args.min_slots,
        "clients": args.clients,
        "requests_per_phase": args.requests,
        "ttft_alone": alone,
        "rounds": rounds,
        "summary": summary,
        "ttfts": ttfts,
        "starts": starts,
        "cpu_samples": sampler.samples,
        "engine_samples": sampler.engine,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    one = parts.add_parser("fake")
    one.add_argument("--lines", type=int, default=10_000)
    one.add_argument("--workers", type=int, default=2)
    one.add_argument("--slots", type=int, default=32, help="BATCH_SLOTS_PER_REPLICA (the mock has one replica)")
    one.add_argument("--timeout", type=float, default=1800)
    two = parts.add_parser("engine")
    two.add_argument("--model", default="smollm2-135m-instruct")
    two.add_argument("--lines", type=int, default=200)
    two.add_argument("--clients", type=int, default=2)
    two.add_argument("--requests", type=int, default=40)
    two.add_argument("--policy", choices=["priority", "fcfs"], default="priority")
    two.add_argument("--min-slots", type=int, default=0)
    two.add_argument(
        "--rounds", type=int, default=3, help="alternations of alone / with a batch (then alone once more)"
    )
    two.add_argument("--settle", type=float, default=10.0, help="seconds to wait before measuring (after start-up, "
                     "and after the batch starts)")  # fmt: skip
    two.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    workdir = ROOT / "var" / "bench-batch"
    workdir.mkdir(parents=True, exist_ok=True)
    report = report_start(args)
    report["result"] = fake(args, workdir) if args.part == "fake" else engine(args, workdir)
    out = write_report(f"batch-{args.part}", report)
    print(orjson.dumps(report["result"], option=orjson.OPT_INDENT_2).decode())
    print(f"written to {out}")


if __name__ == "__main__":
    main()
