"""Faults of processes: a gateway killed under load, a gateway's serving process killed (and
started again), a test run killed (it must take what it started with it)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
from django.utils import timezone

from console.servers import server_command
from serving.supervisor.engines import DATABASE_MARKER
from tests.support import processes
from tests.support.chaos import (
    GATEWAY_ENV,
    LOST,
    OK,
    ClientLoad,
    assert_clients_saw_only,
    assert_metered_exactly_once,
    fake_engines,
    left_in_flight,
    report,
    start_metering,
    summary,
)
from tests.support.gateway import wait_for
from tests.support.processes import start_gateway, stop_leftover_supervisors

pytestmark = pytest.mark.django_db


def test_the_command_asks_for_its_processes(settings):
    one = server_command("python", host="127.0.0.1", port=1)
    assert one[:3] == ["python", "-m", "uvicorn"]
    assert "--no-access-log" in one
    assert "--backlog" in one
    settings.GATEWAY_PROCESSES = 3
    command = server_command("python", host="127.0.0.1", port=1)
    assert command[:3] == ["python", "-m", "console.gateway"]
    assert command[command.index("--processes") + 1] == "3"
    assert "--processes" not in server_command("python", host="127.0.0.1", port=1, server="daphne")


def test_a_stopping_gateway_fails_readyz_while_it_still_serves_then_stops(tmp_path, settings):
    settings.GATEWAY_DRAIN_SECONDS = 3.0
    assert server_command("python", host="127.0.0.1", port=1)[:4] == ["python", "-m", "console.gateway", "--host"]
    gateway = start_gateway(tmp_path, GATEWAY_DRAIN_SECONDS="3")
    try:
        assert httpx.get(f"{gateway.base_url}/readyz", timeout=10).json()["status"] != "draining"
        gateway.process.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        ready = wait_for(lambda: httpx.get(f"{gateway.base_url}/readyz", timeout=5), 5, "an answer")
        assert ready.status_code == 503
        assert ready.json()["status"] == "draining"
        assert httpx.get(f"{gateway.base_url}/healthz", timeout=5).status_code == 200  # still serving
        gateway.process.wait(20)
        assert time.monotonic() - asked >= 2.5  # it stayed for the drain, then stopped by itself
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{gateway.base_url}/healthz", timeout=5)
    finally:
        gateway.stop()


def _serving(root: psutil.Process) -> list[psutil.Process]:
    """The gateway's serving processes (a dead one, not yet reaped, is not one)."""
    found = []
    for child in root.children():
        try:
            if "--one" in child.cmdline():
                found.append(child)
        except psutil.Error:
            continue
    return found


def test_two_processes_serve_one_port_and_stop_together(tmp_path, api_key):
    gateway = start_gateway(tmp_path, processes=2)
    try:
        root = psutil.Process(gateway.process.pid)
        deadline = time.monotonic() + 30
        while len(serving := _serving(root)) < 2:
            assert time.monotonic() < deadline, [p.cmdline() for p in root.children()]
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {api_key.secret}"}
        clients = [httpx.Client(base_url=gateway.base_url, headers=headers, timeout=10) for _ in range(20)]
        try:
            # Twenty connections, kept open: the kernel spreads them over the processes' own
            # sockets (all twenty on one of two: a chance of one in half a million).
            assert all(c.get("/v1/models").status_code == 200 for c in clients)
            port = int(gateway.base_url.rsplit(":", 1)[1])
            held = [
                sum(1 for c in p.net_connections("tcp") if c.laddr.port == port and c.status == "ESTABLISHED")
                for p in serving
            ]
            assert sum(held) == 20, held
            assert min(held) > 0, held
        finally:
            for c in clients:
                c.close()
        # A process that dies is started again; the port keeps answering meanwhile.
        serving[0].kill()
        deadline = time.monotonic() + 30
        while len(again := [p for p in _serving(root) if p.pid != serving[0].pid]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert httpx.get(f"{gateway.base_url}/healthz", timeout=10).status_code == 200
        serving = again
    finally:
        gateway.stop()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in serving)


# --- One of two gateways killed ----------------------------------------------------------------


def test_one_of_two_gateways_killed_under_load(own_redis, metering, make_api_key, spawn_gateway, django_db_blocker,
                                                 tmp_path):  # fmt: skip
    """The other gateway keeps serving; every answered request has exactly one record, and
    the requests the dead gateway had in flight are settled by the sweeper, once."""
    since = timezone.now()
    name, _, engines = fake_engines(django_db_blocker, 1, tokens=20, delay=0.05, latency=0.3)
    # A lost gateway is judged dead 4 s after its heartbeat expires (20 s in production).
    lost = {"GATEWAY_HEARTBEAT_SECONDS": "1", "GATEWAY_LOST_AFTER": "4"}
    env = {**GATEWAY_ENV, **lost, "TEST_REDIS_URL": own_redis.url, "REPLICA_STALE_AFTER": "86400"}
    doomed, survivor = spawn_gateway(**env), spawn_gateway(**env)
    metering.append(start_metering(tmp_path, TEST_REDIS_URL=own_redis.url, **lost))
    key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
    try:
        with ClientLoad([doomed, survivor], key.secret, name, json=2, sse=3, ws=2) as load:
            wait_for(lambda: load.in_progress("sse", doomed) and load.in_progress("ws", doomed), 20,
                     "streams in progress on the gateway to be killed")  # fmt: skip
            doomed.process.kill()
            killed_at = time.monotonic()
            load.route_to([survivor])  # the load balancer takes it out
            in_flight = left_in_flight(key.key_id)  # the dead gateway's, and the survivor's for a moment
            swept = wait_for(lambda: not (in_flight & left_in_flight(key.key_id)) and time.monotonic(), 30,
                             "the dead gateway's requests settled by the sweeper")  # fmt: skip
            time.sleep(1)
        outcomes = load.outcomes
    finally:
        for process in engines:
            process.kill()

    on_survivor = [o for o in outcomes if o.gateway == survivor.base_url]
    on_doomed = [o for o in outcomes if o.gateway == doomed.base_url]
    assert_clients_saw_only(on_survivor, {OK: set()})  # it kept serving, every request of it answered
    assert_clients_saw_only(on_doomed, {OK: set(), LOST: set()})
    lost_answers = [o for o in on_doomed if o.verdict == LOST]
    assert lost_answers, summary(on_doomed)
    assert all(o.ended >= killed_at for o in lost_answers), summary(on_doomed)
    assert sum(o.verdict == OK and o.started > killed_at for o in on_survivor) > 10
    # A lost connection's request was recorded once: by the sweeper (the gateway died with it in
    # flight), or by the gateway itself if it settled it just before dying.
    unseen = sum(1 for o in lost_answers if o.request_id is None)  # JSON, WebSocket: no id yet
    metering_ = assert_metered_exactly_once([key.key_id], outcomes, since, unseen=unseen)
    known_cut = [o.request_id for o in lost_answers if o.request_id]  # SSE streams whose headers arrived
    assert known_cut, summary(on_doomed)
    cut_records = [metering_.records[i] for i in known_cut] + metering_.unexplained
    assert all(r.error_code == "gateway_lost" or r.status_code == 200 for r in cut_records), cut_records
    swept_records = [r for r in metering_.records.values() if r.error_code == "gateway_lost"]
    assert swept_records, "nothing was left for the sweeper"
    assert all(r.status_code == 500 and r in cut_records for r in swept_records)
    report(
        "gateway killed", requests=len(outcomes), survivor_answered=sum(o.verdict == OK for o in on_survivor),
        survivor_failed=sum(o.verdict != OK for o in on_survivor), connections_lost=len(lost_answers),
        swept=len(swept_records), records=len(metering_.records), swept_after_s=swept - killed_at,
    )  # fmt: skip


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of the process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else []
        except OSError:
            continue
        if fields and int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def caught(pid: int) -> str:
    """The process's caught-signals mask (``SigCgt`` in /proc/PID/status), hex."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return line.split()[1]
    return "0"


class TestTestRunLeftovers:
    def test_a_supervisor_started_by_a_test_run_ends_when_the_run_is_killed(self):
        # A stand-in for a pytest run: it starts a program as start_runworkers does, then dies by SIGKILL.
        run = processes.start_process(
            [sys.executable, "-c", "import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-m', "
             "'tests.support.parent_bound', str(os.getpid()), '/bin/sleep', '60']); print(p.pid, flush=True); "
             "time.sleep(60)"],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        child = int(run.stdout.readline())
        try:
            wait_for(lambda: Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"/bin/sleep"), 10, "the exec")
            run.kill()
            run.wait(5)
            wait_for(lambda: processes.process_ended(child), 10, "the child ended with its test run")
        finally:
            run.kill()
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)

    def test_a_killed_run_takes_each_process_group_it_started_with_it(self):
        """A stand-in for a pytest run starts a child through ``start_process``; the child starts a
        grandchild in its group and, like a supervisor stuck in its drain, ignores SIGTERM. The run
        dies by SIGKILL: within a few seconds nothing of the child's group is left."""
        child_code = (
            "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen(['/bin/sleep', '120']); print('ready', flush=True); time.sleep(120)"
        )
        run_code = (
            "import sys, time; from tests.support.processes import start_process; "
            f"child = start_process([sys.executable, '-c', {child_code!r}], grace=1); "
            "print(child.pid, flush=True); time.sleep(120)"
        )
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
        run = processes.start_process([sys.executable, "-c", run_code], env=env, stdout=subprocess.PIPE, text=True)
        group: list[int] = []
        try:
            assert run.stdout is not None
            said = {run.stdout.readline().strip(), run.stdout.readline().strip()}
            assert "ready" in said, said
            child = int((said - {"ready"}).pop())
            group = wait_for(lambda: len(members := group_members(child)) == 2 and members, 10, "child and grandchild")
            run.kill()
            run.wait(5)
            wait_for(lambda: not group_members(child), 30, f"the end of the child's group {group}")
        finally:
            processes.stop_process(run, grace=0)
            for pid in group:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def test_the_reaper_ends_a_group_whose_line_came_just_before_the_runs_end(self):
        """The run's death signal can reach its reaper before the reaper has read the run's last
        lines (a busy machine): those groups are still in the pipe and are ended all the same.
        Made certain here: the reaper is stopped, the line written, the signal sent, then it goes on."""
        from tests.support.parent_bound import start_time

        victim = subprocess.Popen(["/bin/sleep", "60"], start_new_session=True)
        reaper = subprocess.Popen(
            [sys.executable, processes.PARENT_BOUND, "--reaper", str(os.getpid())], stdin=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            # SIGTERM (bit 14 of SigCgt) caught: the reaper is in its loop.
            wait_for(lambda: int(caught(reaper.pid), 16) & (1 << (signal.SIGTERM - 1)), 20, "the reaper's handler")
            os.kill(reaper.pid, signal.SIGSTOP)
            assert reaper.stdin is not None
            reaper.stdin.write(f"+{victim.pid} 0.5 {start_time(victim.pid)}\n")
            reaper.stdin.flush()
            os.kill(reaper.pid, signal.SIGTERM)
            os.kill(reaper.pid, signal.SIGCONT)
            assert victim.wait(15) == -signal.SIGTERM
            assert reaper.wait(15) == 0
        finally:
            victim.kill()
            reaper.kill()
            victim.wait(5)
            reaper.wait(5)

    def test_the_next_run_stops_what_an_earlier_killed_run_left(self):
        session, other, database = (
            f"s{uuid.uuid4().hex[:6]}",
            f"o{uuid.uuid4().hex[:6]}",
            f"test_{uuid.uuid4().hex[:8]}",
        )

        def start(test_session: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
            environment = {
                **os.environ,
                "DJANGO_SETTINGS_MODULE": "tests.settings",
                "TEST_SESSION": test_session,
                **env,
            }
            return processes.start_process([sys.executable, "-c", "import time; time.sleep(60)", *args],
                                           env=environment)  # fmt: skip

        supervisor = start(session, "runworkers")
        engine = start(session, **{DATABASE_MARKER: database})
        another_runs = start(other, "runworkers")
        try:
            stopped = stop_leftover_supervisors(session=session, database=database, timeout=5)
            assert sorted(stopped) == sorted([supervisor.pid, engine.pid])
            assert supervisor.wait(5) == -signal.SIGTERM  # asked to drain and give its host's lease up
            assert engine.wait(5) == -signal.SIGKILL
            assert another_runs.poll() is None
        finally:
            for process in (supervisor, engine, another_runs):
                process.kill()
                process.wait(5)
