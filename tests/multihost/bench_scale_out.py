"""Scale-out benchmarks (docs/scale-out.md): requests per second per gateway core, and gateway CPU
per request, with 1, 2 and 3 gateways on their own hosts behind haproxy.

Not collected by the suite (its name is not ``test_*``); run it on purpose, as root:

    make services && .venv/bin/python -m pytest tests/multihost/bench_scale_out.py -s -p no:cacheprovider

The cluster is the multi-host tests' (``tests.support.cluster``): three hosts, each a gateway
and ``runworkers`` with one fake engine (answers at once, so the gateways are what is
measured). For each count of gateways, haproxy's other servers are put in maintenance, and
wrk (Debian) sends non-streamed chat completions through haproxy for ``SECONDS``. A gateway's
CPU is read from /proc (user + system time of its process) before and after. The table is
printed and written to bench/results/scale_out-<date>.md.

``test_real_engines_on_two_hosts`` is the slower run with real vLLM engines: the bundled
SmolLM2, registered here into the cluster's object store, served by one replica on each of two
hosts (core 0 and core 1), each host loading the weights from the store; chat completions
through haproxy; its figures go to bench/results/scale_out_real-<date>.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.multihost.test_hosts import HOSTS, ready_replicas
from tests.support import haproxy, netns
from tests.support.chaos import control, redis_at
from tests.support.cluster import Cluster, create_model, drop_model
from tests.support.gateway import wait_for

_why = netns.unavailable() or haproxy.unavailable() or (None if shutil.which("wrk") else "wrk is not installed")
pytestmark = [pytest.mark.skipif(_why is not None, reason=_why or ""), pytest.mark.django_db]

SECONDS = int(os.environ.get("SCALE_OUT_SECONDS", "15"))
CONNECTIONS = int(os.environ.get("SCALE_OUT_CONNECTIONS", "32"))
ROOT = Path(__file__).resolve().parents[2]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, secret: str, body: Path) -> dict[str, Any]:
    env = {**os.environ, "WRK_BODY_FILE": str(body), "WRK_KEY": secret}
    result = subprocess.run(
        ["wrk", "-t2", f"-c{CONNECTIONS}", f"-d{SECONDS}s", "--latency", "-s", str(ROOT / "bench/wrk/post.lua"),
         f"{url}/v1/chat/completions"],
        capture_output=True, text=True, env=env, timeout=SECONDS + 60,
    )  # fmt: skip
    line = next(line for line in result.stdout.splitlines() if line.startswith("WRK_JSON "))
    return dict(json.loads(line.removeprefix("WRK_JSON ")))


def test_scale_out(django_db_setup, django_db_blocker, make_api_key, tmp_path_factory):
    name = f"scale-{uuid.uuid4().hex[:6]}"
    deployment_id = create_model(django_db_blocker, name, replicas=3)
    key = make_api_key(rate_limit_rpm=100_000_000, rate_limit_tpm=1_000_000_000, max_concurrent=1000)
    directory = tmp_path_factory.mktemp("scale-out")
    body = directory / "body.json"
    body.write_text(json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}))
    rows = []
    with netns.Network(int(os.environ.get("TEST_SESSION", "0"))) as network:
        # The routing table's default refresh (the tests' 0.2 s is background CPU, not requests').
        built = Cluster(network, directory, models=[name], env={"ROUTING_REFRESH_SECONDS": "1"})
        try:
            built.start(HOSTS)
            with redis_at(built.redis.url):
                wait_for(lambda: len(ready_replicas(django_db_blocker, deployment_id)) == 3, 60, "replicas ready")
                for replica in ready_replicas(django_db_blocker, deployment_id):
                    control(replica.endpoint, tokens=8, delay=0)
                built.wait_up(HOSTS)
                answer = httpx.post(f"{built.balancer.base_url}/v1/chat/completions", content=body.read_bytes(),
                                    headers={"Authorization": f"Bearer {key.secret}",
                                             "Content-Type": "application/json"}, timeout=30)  # fmt: skip
                assert answer.status_code == 200, answer.text
                for count in (1, 2, 3):
                    serving = HOSTS[:count]
                    for host in HOSTS:
                        state = "ready" if host in serving else "maint"
                        built.balancer.command(f"set server gateways/{host} state {state}")
                    time.sleep(2)
                    wrk(built.balancer.base_url, key.secret, body) if count == 1 else None  # warm-up, once
                    pids = {h: built.hosts[h].gateway.pid for h in serving}
                    before = {h: cpu_seconds(pid) for h, pid in pids.items()}
                    figures = wrk(built.balancer.base_url, key.secret, body)
                    used = sum(cpu_seconds(pid) - before[h] for h, pid in pids.items())
                    done = figures["requests"]
                    errors = sum(figures[k] for k in ("connect_errors", "read_errors", "write_errors", "timeouts",
                                                     "status_errors"))  # fmt: skip
                    rows.append({
                        "gateways": count, "requests_per_s": done / (figures["duration_us"] / 1e6),
                        "gateway_cpu_s": used, "per_gateway_core": done / used if used else 0.0,
                        "cpu_ms_per_request": 1000 * used / done if done else 0.0,
                        "p50_ms": figures["p50_us"] / 1000, "p99_ms": figures["p99_us"] / 1000, "errors": errors,
                    })  # fmt: skip
                    print(f"\nSCALE-OUT {rows[-1]} {figures}")
        finally:
            built.stop()
            drop_model(django_db_blocker, name)
    header = (
        "| gateways | requests/s (all) | gateway CPU s | requests/s per gateway core | gateway CPU ms/request "
        "| p50 ms | p99 ms | errors |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['gateways']} | {r['requests_per_s']:.0f} | {r['gateway_cpu_s']:.1f} | {r['per_gateway_core']:.0f} "
            f"| {r['cpu_ms_per_request']:.2f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} |"
        )
    stamp = datetime.now(UTC)
    text = (
        f"# Scale-out, {stamp:%Y-%m-%d %H:%M} UTC\n\n`pytest tests/multihost/bench_scale_out.py` on {os.cpu_count()} "
        f"cores, wrk -t2 -c{CONNECTIONS} -d{SECONDS}s through haproxy, fake engines.\n\n" + "\n".join(lines) + "\n"
    )
    out = ROOT / "bench" / "results" / f"scale_out-{stamp:%Y-%m-%d}.md"
    out.write_text(text)
    print("\n" + text)
    assert all(r["errors"] == 0 for r in rows), rows


def test_real_engines_on_two_hosts(django_db_setup, django_db_blocker, bundled_models, make_api_key, tmp_path_factory):
    import statistics

    from registry import artifacts

    bundled = bundled_models["versions"]["smollm2-135m-instruct"]
    files = artifacts.get_artifact_store().local_path(bundled.artifact_uri)
    name = f"smol-hosts-{uuid.uuid4().hex[:6]}"
    key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
    directory = tmp_path_factory.mktemp("real-hosts")
    lines: list[str] = []
    with netns.Network(int(os.environ.get("TEST_SESSION", "0"))) as network:
        built = Cluster(network, directory, models=[name], s3=True, slots_of={"h1": "0", "h2": "1"},
                        env={"WORKER_ENGINE_LAUNCHER": "", "REPLICA_STALE_AFTER": "9", "WORKER_HEARTBEAT_SECONDS": "3",
                             "WORKER_HOST_LEASE_SECONDS": "15"})  # fmt: skip
        deployment_id = 0
        try:
            built.start(["h1", "h2"])
            started = time.monotonic()
            stored = built.register_artifact(files, f"{name}/1")
            upload_s = time.monotonic() - started

            deployment_id = create_model(
                django_db_blocker,
                name,
                replicas=2,
                uri=stored.uri,
                sha256=stored.sha256,
                size=stored.size,
                framework=bundled.framework,
                config=bundled.config,
            )
            started = time.monotonic()
            with redis_at(built.redis.url):
                wait_for(lambda: len(ready_replicas(django_db_blocker, deployment_id)) == 2, 600, "two real replicas")
                ready_s = time.monotonic() - started
                replicas = ready_replicas(django_db_blocker, deployment_id)
                hosts = sorted(built.host_of(r.endpoint) for r in replicas)
                assert hosts == ["h1", "h2"], hosts
                cached = {h: sum(p.stat().st_size for p in built.cache_of(h).rglob("*") if p.is_file()) for h in hosts}
                built.wait_up(["h1", "h2"])
                latencies, statuses = [], []
                with httpx.Client(base_url=built.balancer.base_url, timeout=120,
                                  headers={"Authorization": f"Bearer {key.secret}"}) as client:  # fmt: skip
                    for i in range(20):
                        asked = time.monotonic()
                        answer = client.post("/v1/chat/completions", json={
                            "model": name, "max_tokens": 16,
                            "messages": [{"role": "user", "content": f"Name a colour ({i})."}]})  # fmt: skip
                        latencies.append(time.monotonic() - asked)
                        statuses.append(answer.status_code)
                served = {}
                for replica in replicas:
                    metrics = httpx.get(f"{replica.endpoint}/metrics", timeout=10).text
                    served[built.host_of(replica.endpoint)] = sum(
                        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                        if line.startswith("vllm:request_success_total")
                    )  # fmt: skip
            lines = [
                f"# Real engines on two hosts, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
                "",
                "`pytest tests/multihost/bench_scale_out.py -k real`: the bundled SmolLM2 (vLLM CPU), registered",
                "into the object store (moto) on the data host, one replica on each of two hosts (cores 0 and 1),",
                "each host loading the weights from the store into its own cache; haproxy in front of their gateways.",
                "",
                f"- upload to the store: {upload_s:.1f} s ({stored.size / 1e6:.0f} MB)",
                f"- both replicas ready (download + vLLM start, in parallel): {ready_s:.0f} s",
                f"- bytes in each host's cache: {cached}",
                f"- 20 chat completions (16 tokens) through haproxy: statuses {sorted(set(statuses))}, "
                f"median {statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms",
                f"- requests each host's engine served (vllm:request_success_total): {served}",
            ]
        finally:
            built.stop()
            drop_model(django_db_blocker, name)
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    (ROOT / "bench" / "results" / f"scale_out_real-{datetime.now(UTC):%Y-%m-%d}.md").write_text(text)
    assert set(statuses) == {200}
    assert all(count > 0 for count in served.values()), served
