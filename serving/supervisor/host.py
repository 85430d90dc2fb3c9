"""The per-host worker supervisor behind ``manage.py runworkers``.

It keeps this host's share of every serving deployment running as engine processes (by the
version's engine kind: vLLM's OpenAI server, the predict worker), one per replica, each pinned
to a slot (a CPU core, or a GPU). A replica of a kind with no process (an external upstream)
takes no slot: it is attached to its upstream's URL and probed, heart-beaten, failed and
stopped like the others, with nothing to start or kill.

- claims a replica when a deployment wants more, a slot is free and the version's files
  are on this host (fetched beside the loop: ``serving.supervisor.weights``), starts the
  engine, waits for /health, then marks the replica ready with its endpoint;
- heart-beats ready replicas after checking /health (routers ignore stale heartbeats);
- announces every replica that becomes ready or leaves on the routing channel, so gateways
  reload at once;
- restarts a crashed or unhealthy replica with exponential backoff;
- restarts a replica a person asked to (``registry.services.replica_restart_request``):
  drained and stopped like one no longer wanted, then started again through the same
  restart path, at once;
- rolls a deployment's new ``max_adapters`` (set after deploy) out to its running engines:
  asks the restart of one stale engine of the deployment at a time, once none of its replicas
  is starting, draining, failed or restarting (``registry.services.replica_roll_request``),
  and each restart starts the engine with the deployment's value then;
- records each replica's load time (start to first good /health) in the log, the audit
  log (``replica.ready``) and the ``inference_replica_load_seconds`` gauge;
- carries every hot-swap under way through its next step (``rollout.hotswap``);
- drains a replica that is no longer wanted (no new requests are routed to it; in-flight
  ones finish or the drain timeout passes), then stops it;
- on SIGTERM/SIGINT drains and stops everything it started.

One supervisor per host name: it holds the host's lease (``registry.HostLease``) from before
it touches anything of the host until it has stopped, renewing it on every database pass. A
second one for the same host refuses to start (``HostLeaseHeld``) instead of releasing the
first one's replicas as its predecessor's; one killed with SIGKILL is succeeded once its
lease has expired. A supervisor that finds its lease taken over (it was cut off from the
database for longer than the lease, and another started) writes nothing more, stops its
engines and exits.

Each loop first tends the engine processes (exits, health results, stop deadlines), which
never touches the database, then does the database work. The in-memory state of each
engine is the truth for this host; the replica row is brought to it (``EngineProcess.want``)
whenever the database answers, so an outage only delays the bookkeeping: engines keep
running and pending state changes are applied once it is back.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.db import close_old_connections, transaction
from django.utils import timezone

from core.events import publish_routing_change_now
from core.transitions import IllegalTransition
from registry.adapters import is_adapter_framework
from registry.models import Deployment, Replica
from registry.selectors import (
    deployment_with_version,
    live_replica_pids,
    replica_get,
    replica_states,
    replicas_restart_requested,
    serving_deployments,
    upstream_targets,
)
from registry.services import (
    host_lease_release,
    replica_claim,
    replica_heartbeats,
    replica_mark_ready,
    replica_record_load_time,
    replica_record_pid,
    replica_release_host,
    replica_roll_request,
    replica_shortfall,
    replica_surplus,
    replica_transition,
)
from registry.warm_pool import deployments_promote_standbys, replica_surplus_pick
from rollout.hotswap import swap_step
from serving.gateway.engine_kinds import PROCESS_MARKS, EngineKind, kind_of
from serving.gateway.metrics import REPLICA_LOAD_SECONDS
from serving.supervisor.adapters import AdapterLoads
from serving.supervisor.engines import (
    EngineProcess,
    engine_env,
    free_port,
    free_slots,
    kill_marked_strangers,
    row_route,
    signal_group,
)
from serving.supervisor.lease import (
    DATABASE_ERRORS,
    DATABASE_RETRY_FIRST,
    DATABASE_RETRY_MAX,
    LeaseKeeping,
    lease_holder,
)
from serving.supervisor.weights import Weights

logger = logging.getLogger(__name__)


# How often a supervisor looks for hot-swap steps that are due (each a few queries).
SWAP_STEP_SECONDS = 1.0


@dataclass
class Supervisor(LeaseKeeping):
    host: str = field(default_factory=lambda: settings.WORKER_HOST)
    slots: list[str] = field(default_factory=lambda: list(settings.WORKER_SLOTS))
    # Serve only deployments of these models (public names); None: every model.
    models: frozenset[str] | None = None
    log_dir: Path = field(default_factory=lambda: Path(settings.WORKER_LOG_DIR))
    engines: dict[int, EngineProcess] = field(default_factory=dict)  # by replica id
    stopping: bool = False
    stop_announced: bool = False
    report: Callable[[str], None] = field(default=lambda message: logger.info(message))
    # An engine that ignores SIGTERM this long is killed.
    stop_grace: float = 15.0
    lease_seconds: float = field(default_factory=lambda: settings.WORKER_HOST_LEASE_SECONDS)
    holder: str = field(default_factory=lease_holder)
    # Another supervisor took this host's lease over: nothing of the host is ours any more.
    lease_lost: bool = False
    # Probes run beside the loop, so one hung engine never delays another's heartbeat; the
    # timeout stays well under the heartbeat interval.
    probe_timeout: float = field(default_factory=lambda: min(2.0, max(0.5, settings.WORKER_HEARTBEAT_SECONDS / 3)))
    _http: httpx.Client = field(init=False)
    _probes: ThreadPoolExecutor = field(init=False)
    _started: bool = field(default=False, init=False)  # the predecessor's engines are killed
    _lease_held: bool = field(default=False, init=False)
    _db_down_since: float | None = field(default=None, init=False)
    _db_retry_at: float = field(default=0.0, init=False)
    _db_retry_delay: float = field(default=DATABASE_RETRY_FIRST, init=False)
    _gone_since: float | None = field(default=None, init=False)  # shutting down: every engine has exited
    _routing_changed: bool = field(default=False, init=False)  # a replica row changed state this pass
    _announcer: ThreadPoolExecutor = field(init=False)
    _announcement: Future[None] | None = field(default=None, init=False)
    _swaps_checked_at: float = field(default=-SWAP_STEP_SECONDS, init=False)
    weights: Weights = field(init=False)  # artifacts fetched beside the loop, held while used
    adapters: AdapterLoads = field(init=False)  # LoRA adapters put into its engines

    def __post_init__(self) -> None:
        self._http = httpx.Client(timeout=self.probe_timeout)
        self._probes = ThreadPoolExecutor(max_workers=max(4, len(self.slots)), thread_name_prefix="engine-probe")
        self._announcer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="routing-announce")
        self.weights = Weights(self.report)
        self.adapters = AdapterLoads(self.report, self.weights)

    # --- lifecycle ------------------------------------------------------------------

    def run(self, *, once: bool = False) -> None:
        """Supervise until stopped. Raises ``HostLeaseHeld``, having touched nothing, when
        another supervisor holds this host; ``lease_lost`` is set when one took it over."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            # The lease first: a predecessor's engines (by their marker) and rows are ours to
            # kill and release only once no other supervisor runs this host.
            if not self._take_lease_waiting():
                return
            kill_marked_strangers(self.host, self.engines.values(), self.report)
            only = f"; models {', '.join(sorted(self.models))}" if self.models is not None else ""
            self.report(
                f"supervising engines on {self.host} (slots {', '.join(self.slots)}{only}); "
                f"holding its lease as {self.holder}"
            )
            while True:
                with contextlib.suppress(*DATABASE_ERRORS):
                    close_old_connections()
                if self.stopping:
                    if self._shutdown_step():
                        break
                else:
                    self.step()
                if once:
                    break
                time.sleep(0.5)
            self.report("all engines stopped")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            leftover = [e for e in self.engines.values() if e.alive()]
            if leftover:  # only when the loop died of a bug: never leave an engine unwatched
                self.report(f"killing {len(leftover)} engine(s) on the way out")
            self.close()

    def close(self) -> None:
        """Kill whatever engine still runs, give the host's lease up and release the probe
        threads (tests call it too)."""
        for engine in self.engines.values():
            self._kill(engine)
        for engine in self.engines.values():
            if engine.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    engine.popen.wait(5)  # after SIGKILL: only reaping, never a real wait
        if self._lease_held:  # only once no engine of ours runs: a successor starts at once
            self._lease_held = False
            with contextlib.suppress(*DATABASE_ERRORS):  # then it expires by itself
                host_lease_release(host=self.host, holder=self.holder)
        self._probes.shutdown(wait=False, cancel_futures=True)
        self._announcer.shutdown(wait=False, cancel_futures=True)
        self.adapters.close()
        self.weights.close()
        self._http.close()

    def _kill_orphans(self) -> None:
        """Engines an earlier supervisor of this host recorded and left running (it was killed)."""
        for pid in live_replica_pids(host=self.host):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue  # gone already
            if any(mark in cmdline for mark in PROCESS_MARKS):  # ours: never a reused pid's stranger
                signal_group(pid, signal.SIGKILL)
                self.report(f"killed engine pid {pid} left by an earlier supervisor")

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Only flags: the loop does the work. A handler that touched the database could
        # re-enter a query the main thread is in the middle of.
        if self.stopping:  # a second signal: stop now
            for engine in self.engines.values():
                self._kill(engine)
            raise SystemExit(1)
        self.stopping = True

    def step(self) -> None:
        """One pass: tend every engine process, then the database work. Nothing in it waits long."""
        now = time.monotonic()
        for engine in list(self.engines.values()):
            self._tend(engine, now)
        self._database_step(now)

    def _shutdown_step(self) -> bool:
        if not self.stop_announced:
            self.stop_announced = True
            self.report("stopping: draining all replicas")
        now = time.monotonic()
        for engine in list(self.engines.values()):
            self._begin_drain(engine)
        for engine in list(self.engines.values()):
            self._tend(engine, now)
        self._database_step(now)
        if not self.engines:
            return True
        if any(engine.phase != "stopped" for engine in self.engines.values()):
            return False
        if self.lease_lost:  # their rows are the new holder's to release
            self.report(f"{len(self.engines)} engine(s) stopped; their replica rows are left to the new holder")
            return True
        # Every engine has exited; only their rows wait for a database that does not answer.
        self._gone_since = self._gone_since or now
        if self._db_down_since is not None and now - self._gone_since > self.stop_grace:
            self.report(
                f"could not record {len(self.engines)} stopped replica(s): the database is unavailable; "
                "the next runworkers on this host releases them"
            )
            return True
        return False

    # --- the database side ----------------------------------------------------------

    def _database_step(self, now: float) -> None:
        if now < self._db_retry_at or self.lease_lost:
            return
        try:
            if not self._hold_lease():
                return
            if self._db_reachable_since is None:
                self._db_reachable_since = now
            if not self._started:
                self._kill_orphans()
                self._started = True
            self._check_rows()
            self._record_pending()
            self._write_heartbeats()
            if not self.stopping:
                self._routing_changed |= self.adapters.step(self.engines.values(), now)
                self._step_swaps(now)
                self._take_restart_requests()
                self._restart_due(now)
                self._release_lost_hosts(now)
                self._claim_wanted()
                self._record_pending()
            self._announce_routing_change()
        except DATABASE_ERRORS as exc:
            self._db_reachable_since = None
            self._announce_routing_change()  # what was written before the error stands
            if self._db_down_since is None:  # once per outage, not once per loop
                self._db_down_since = now
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                self.report(
                    f"database unavailable ({type(exc).__name__}: {reason}); "
                    f"{len(self.engines)} engine(s) keep running; retrying"
                )
            self._db_retry_at = now + self._db_retry_delay
            self._db_retry_delay = min(DATABASE_RETRY_MAX, self._db_retry_delay * 2)
        except (ObjectDoesNotExist, IllegalTransition) as exc:
            # A row deleted or moved by someone else halfway through the pass: the next pass
            # starts from what the database says then.
            logger.warning("supervisor pass cut short: %s", exc)
            self._announce_routing_change()
        else:
            if self._db_down_since is not None:
                self.report(f"database reachable again after {now - self._db_down_since:.0f} s")
            self._db_down_since = None
            self._db_retry_delay = DATABASE_RETRY_FIRST

    def _step_swaps(self, now: float) -> None:
        """Carry every hot-swap under way through the step now due (traffic moved once the new
        replicas are ready, old deployment drained, swap closed). Before claiming: a deployment
        set draining here is drained in the same pass."""
        if now - self._swaps_checked_at < SWAP_STEP_SECONDS:
            return
        self._swaps_checked_at = now
        for message in swap_step():
            self.report(message)

    def _check_rows(self) -> None:
        """Match this host's replica rows with the engines it runs.

        A live row of this host with no engine here is an earlier supervisor's, or a claim
        whose commit reached the database while its answer was lost: it is released, so it
        never holds a place in its deployment. An engine whose row vanished (or was stopped
        by someone else) is stopped.
        """
        released = replica_release_host(host=self.host, keep=list(self.engines))
        if released:
            self._routing_changed = True
            self.report(f"released {released} replica(s) of {self.host} that no engine here serves")
        if not self.engines:
            return
        states = replica_states(replica_ids=list(self.engines))
        for engine in list(self.engines.values()):
            if engine.row_gone:
                continue
            state = states.get(engine.replica_id)
            if state is None:
                self._lose_row(engine, "its replica row was deleted")
            elif state == Replica.State.STOPPED and engine.want != Replica.State.STOPPED:
                self._lose_row(engine, "its replica was stopped by another process")

    def _record_pending(self) -> None:
        for engine in list(self.engines.values()):
            if not engine.recorded:
                self._record(engine)
            if engine.phase == "stopped" and engine.recorded and not engine.row_gone:
                self.engines.pop(engine.replica_id, None)
                self.report(f"replica {engine.replica_id} stopped")

    def _record(self, engine: EngineProcess) -> None:
        """Bring the replica's row to ``engine.want`` through legal moves."""
        replica = replica_get(replica_id=engine.replica_id)
        if replica is None:
            self._lose_row(engine, "its replica row was deleted")
            return
        target = engine.want
        route = row_route(replica.state, target)
        if route is None:
            logger.warning("replica %s: no move from %s to %s; left as is", replica.pk, replica.state, target)
            route = []
        try:
            if not route and target == Replica.State.STARTING and engine.pid not in (None, replica.pid):
                # Claimed as starting: only the new process to record (a restart moves state and pid at once).
                assert engine.pid is not None
                replica_record_pid(replica_id=replica.pk, pid=engine.pid)
            for state in route:
                # Set before the write: one move may commit and the next fail.
                self._routing_changed = self._routing_changed or state != Replica.State.STARTING
                if state == Replica.State.READY:
                    assert engine.pid is not None or not engine.kind.runs_process
                    with transaction.atomic():
                        replica_mark_ready(replica=replica, endpoint=engine.endpoint, pid=engine.pid)
                        replica_record_load_time(replica=replica, seconds=engine.load_seconds, host=self.host)
                elif state == Replica.State.STARTING and engine.pid is not None:
                    replica_transition(replica=replica, state=state, pid=engine.pid)
                elif state == Replica.State.DRAINING and not engine.restart_requested:
                    # Leaving its deployment: a restart asked for meanwhile is moot, and must
                    # not keep the row holding a place in the deployment.
                    replica_transition(replica=replica, state=state, restart_requested_at=None)
                else:
                    replica_transition(replica=replica, state=state)
        except ObjectDoesNotExist:  # the replica, or its deployment, deleted meanwhile
            self._lose_row(engine, "its replica row was deleted")
            return
        except IllegalTransition as exc:  # moved by someone else meanwhile: theirs stands
            logger.warning("replica %s: %s", engine.replica_id, exc)
        engine.recorded = True

    def _announce_routing_change(self) -> None:
        """Tell gateways to reload their routing now when a replica became ready or left:
        ``publish_routing_change_now`` (the writes are committed by now) in a thread of its own,
        as a hung Redis must never delay a heartbeat. One announcement waiting covers any number."""
        if not self._routing_changed:
            return
        self._routing_changed = False
        pending = self._announcement
        if pending is not None and not pending.running() and not pending.done():
            return  # not sent yet: it will carry this change too
        with contextlib.suppress(RuntimeError):  # closed: shutting down
            self._announcement = self._announcer.submit(publish_routing_change_now, "replica")

    def _write_heartbeats(self) -> None:
        beating = [
            engine
            for engine in self.engines.values()
            if engine.beat_due and engine.recorded and engine.want == Replica.State.READY
        ]
        if beating:
            replica_heartbeats(replica_ids=[engine.replica_id for engine in beating])
            for engine in beating:
                engine.beat_due = False

    def _take_restart_requests(self) -> None:
        """Begin the restarts people asked for: each ready engine asked drains like one no
        longer wanted; once it has exited, ``_tend`` hands it to ``_restart_due`` instead of
        stopping it. A request for an engine in another phase is settled by the move to
        starting or stopped that phase leads to."""
        ready = [e.replica_id for e in self.engines.values() if e.phase == "ready" and not e.restart_requested]
        if not ready:
            return
        for replica_id in replicas_restart_requested(replica_ids=ready):
            engine = self.engines[replica_id]
            engine.restart_requested = True
            self.report(f"replica {replica_id}: restart requested")
            self._begin_drain(engine)

    def _restart_due(self, now: float) -> None:
        for engine in list(self.engines.values()):
            if engine.phase != "backoff" or now < engine.restart_at or not engine.recorded:
                continue
            if engine.alive():  # SIGKILL not through yet: the slot is still busy
                continue
            deployment = deployment_with_version(deployment_id=engine.deployment_id)
            if deployment is None:
                self._lose_row(engine, "its deployment was deleted")
                continue
            serving = deployment.status in (Deployment.Status.PENDING, Deployment.Status.RUNNING)
            if not serving or replica_surplus(deployment=deployment) > 0:
                self._set_stopped(engine)
                continue
            self._start(engine, deployment)

    def _claim_wanted(self) -> None:
        deployments = [d for d in serving_deployments() if self.models is None or d.version.model.name in self.models]
        wanted_ids = {d.id for d in deployments}
        for engine in list(self.engines.values()):
            if engine.deployment_id not in wanted_ids:
                self._begin_drain(engine)
        self._roll_stale_engines(deployments)
        # A serving replica failed, stopped or was lost: a ready standby takes its place first.
        self._promoted(deployments_promote_standbys(deployment_ids=list(wanted_ids)))
        for deployment in deployments:
            if is_adapter_framework(deployment.version.framework):
                continue  # no engine of its own: loaded into its base's (self.adapters)
            mine = [
                e
                for e in self.engines.values()
                if e.deployment_id == deployment.id and e.phase in ("starting", "ready", "backoff")
            ]
            try:
                # Scale-in: a standby first when the pool is over its count, else the newest serving one.
                surplus = (
                    replica_surplus_pick(deployment=deployment, replica_ids=[e.replica_id for e in mine])
                    if mine
                    else None
                )
                if surplus is not None:
                    self._begin_drain(self.engines[surplus])
                    continue
                kind = kind_of(deployment.version.framework)
                free = free_slots(kind, self.engines.values(), self.slots)
                if not free or not self._weights_here(deployment, kind):
                    continue
                replica = replica_claim(deployment=deployment, host=self.host, on_promoted=self._promoted)
            except Deployment.DoesNotExist:
                continue  # deleted since the list was read; the next pass stops its engines
            if replica is not None:
                engine = EngineProcess(
                    replica_id=replica.id,
                    deployment_id=deployment.id,
                    slot=free[0],
                    model=deployment.version.model.name,
                    version=deployment.version.version,
                    version_id=deployment.version_id,
                    max_adapters=deployment.max_adapters,
                    kind=kind,
                    artifact=deployment.version.artifact_uri if kind.runs_process else "",
                )
                self.engines[replica.id] = engine
                self._start(engine, deployment)
        in_use = {e.artifact for e in self.engines.values() if e.artifact} | self.adapters.in_use()
        self.weights.release_unused(in_use, time.monotonic())

    def _roll_stale_engines(self, deployments: list[Deployment]) -> None:
        """Restart, one replica of a deployment at a time, the ready engines started with another
        ``max_adapters`` than their deployment's now (``registry.services.deployment_adapters_set``):
        each is asked to restart as a person would ask, and ``_take_restart_requests`` begins it
        on the next pass. A deployment with an engine of this host not ready (or restarting)
        waits; so does one with such a replica elsewhere (the service checks, row locked)."""
        for deployment in deployments:
            mine = [e for e in self.engines.values() if e.deployment_id == deployment.id]
            stale = {
                e.replica_id: e.max_adapters
                for e in mine
                if e.phase == "ready" and e.recorded and e.max_adapters != deployment.max_adapters
            }
            if not stale or any(e.phase != "ready" or e.restart_requested for e in mine):
                continue
            replica_id = replica_roll_request(deployment_id=deployment.id, running=stale)
            if replica_id is not None:
                self.report(
                    f"replica {replica_id}: restarting for its deployment's max_adapters "
                    f"({stale[replica_id]} → {deployment.max_adapters})"
                )

    def _promoted(self, replica_ids: list[int]) -> None:
        if replica_ids:
            self._routing_changed = True  # announced at the end of the pass, off the loop
            self.report(f"promoted standby replica(s) {', '.join(map(str, replica_ids))}")

    def _weights_here(self, deployment: Deployment, kind: EngineKind) -> bool:
        """Whether the version's files are here (always, for a kind with no process); if not and
        a replica is wanted, their download starts beside the loop (``Weights.prepare``)."""
        if not kind.runs_process:
            return True
        return self.weights.prepare(
            deployment.version.artifact_uri,
            time.monotonic(),
            needed=lambda: replica_shortfall(deployment=deployment) > 0,
        )

    def _start(self, engine: EngineProcess, deployment: Deployment) -> None:
        """Start the replica: its engine's process, or for a kind with none (an external
        upstream) attach it to its upstream, read here (URL, served name, key). ``deployment``
        is read afresh for each start, so a restart takes the deployment's settings of now."""
        engine.max_adapters = deployment.max_adapters
        if engine.kind.runs_process:
            self._spawn(engine, deployment)
            return
        engine.upstream = upstream_targets(version_ids=[deployment.version_id]).get(deployment.version_id)
        if engine.upstream is None:
            self._fail(engine, "its version has no upstream, or the upstream's API key cannot be decrypted")
            return
        engine.attached = True
        engine.starting()
        self.report(f"replica {engine.replica_id} ({deployment.version}) attached to its upstream at {engine.endpoint}")

    # --- one engine's process (no database below this line) ---------------------------

    def _spawn(self, engine: EngineProcess, deployment: Deployment) -> None:
        engine.port = free_port(settings.WORKER_ENGINE_HOST)
        engine.log_path = self.log_dir / f"replica-{engine.replica_id}.log"
        build = engine.kind.command
        assert build is not None  # _start attaches a kind with none instead
        command = build(deployment, engine.port, self.weights.path(engine.artifact))
        env = engine_env(engine.slot, replica_id=engine.replica_id, host=self.host)
        try:
            with open(engine.log_path, "ab") as log:
                log.write(f"\n=== {timezone.now().isoformat()} starting: {shlex.join(command)}\n".encode())
                log.flush()
                engine.popen = subprocess.Popen(
                    command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        except OSError as exc:
            engine.popen = None
            self._fail(engine, f"could not start: {exc}")
            return
        engine.starting()
        self.report(
            f"replica {engine.replica_id} ({deployment.version}) starting on slot {engine.slot}, "
            f"port {engine.port}, pid {engine.pid}"
        )

    def _tend(self, engine: EngineProcess, now: float) -> None:
        if engine.phase in ("stopped", "backoff"):
            return
        if not engine.alive():
            engine.probe = None
            if engine.restart_requested and not engine.row_gone and not self.stopping:
                self._restart_when_stopped(engine)
            elif engine.phase in ("draining", "stopping") or engine.row_gone:
                self._set_stopped(engine)
            else:
                code = engine.popen.returncode if engine.popen else None
                self._fail(engine, f"engine exited with code {code}")
            return
        if engine.phase == "stopping":
            if not engine.kill_sent and now >= engine.term_deadline:
                self._kill(engine)
                self.report(f"replica {engine.replica_id} ignored SIGTERM for {self.stop_grace:.0f} s; killed")
            return
        if engine.phase == "starting":
            warming = engine.probe is not None and engine.probe[0] == "warm"
            result = engine.probe_result("warm" if warming else "health")
            if result and not warming and engine.kind.warm_up:
                engine.start_probe("warm", self._probes, self._http)  # healthy: one request before it is routed
                return
            if warming and result is False:
                self.report(f"replica {engine.replica_id}: its warm-up request was not answered; ready all the same")
            if (result is not None) if warming else result:
                engine.phase = "ready"
                engine.ready_at = engine.last_check = now
                engine.load_seconds = now - engine.started_at
                engine.want, engine.recorded = Replica.State.READY, False
                REPLICA_LOAD_SECONDS.labels(engine.model, engine.version, str(engine.replica_id)).set(
                    engine.load_seconds
                )
                self.report(
                    f"replica {engine.replica_id} ({engine.model}:{engine.version}) ready at {engine.endpoint}; "
                    f"loaded in {engine.load_seconds:.1f} s"
                )
            elif now - engine.started_at > settings.WORKER_STARTUP_TIMEOUT:
                self._kill(engine)
                self._fail(engine, f"not healthy within {settings.WORKER_STARTUP_TIMEOUT:.0f} s")
            elif engine.probe is None:
                engine.start_probe("health", self._probes, self._http)
            return
        if engine.phase == "ready":
            result = engine.probe_result("health")
            if result is True:
                engine.failed_checks = 0
                engine.beat_due = True
                if now - engine.ready_at > 60:
                    engine.restarts = 0  # stable again: the next crash restarts quickly
            elif result is False:
                engine.failed_checks += 1
                if engine.failed_checks >= 3:
                    self._kill(engine)
                    self._fail(engine, "/health failed 3 times")
                    return
            # A failed check is confirmed quickly (every third of a heartbeat), so an engine that
            # stops answering leaves routing within REPLICA_STALE_AFTER even when it stays alive.
            interval = settings.WORKER_HEARTBEAT_SECONDS / (3 if engine.failed_checks else 1)
            if engine.probe is None and now - engine.last_check >= interval:
                engine.last_check = now
                engine.start_probe("health", self._probes, self._http)
            return
        if engine.phase == "draining":
            if now >= engine.drain_deadline or engine.probe_result("idle"):
                self._stop_process(engine)
            elif engine.probe is None:
                engine.start_probe("idle", self._probes, self._http)

    def _begin_drain(self, engine: EngineProcess) -> None:
        if engine.phase in ("draining", "stopping", "stopped"):
            return
        if engine.phase == "backoff":
            self._set_stopped(engine)
            return
        if engine.phase == "starting":
            # Nothing was ever routed to it: no drain, and its row leaves the deployment now.
            engine.want, engine.recorded = Replica.State.STOPPED, False
            self._stop_process(engine)
            self.report(f"replica {engine.replica_id} stopped before it was ready")
            return
        engine.phase = "draining"
        engine.probe = None
        engine.want, engine.recorded = Replica.State.DRAINING, False
        engine.drain_deadline = time.monotonic() + settings.WORKER_DRAIN_TIMEOUT
        self.report(f"replica {engine.replica_id} draining (up to {settings.WORKER_DRAIN_TIMEOUT:.0f} s)")

    def _stop_process(self, engine: EngineProcess) -> None:
        """SIGTERM now; a later pass kills it if it is still there after ``stop_grace``."""
        engine.phase = "stopping"
        engine.probe = None
        if engine.alive():
            engine.end(signal.SIGTERM)
            engine.term_deadline = time.monotonic() + self.stop_grace

    def _kill(self, engine: EngineProcess) -> None:
        """SIGKILL, without waiting: a later pass sees the exit."""
        if engine.alive():
            engine.end(signal.SIGKILL)
            engine.kill_sent = True

    def _set_stopped(self, engine: EngineProcess) -> None:
        """The engine's process is gone for good; its row is recorded stopped next."""
        engine.end(signal.SIGKILL)  # whatever of its group outlived the leader
        engine.phase = "stopped"
        engine.probe = None
        if engine.row_gone:
            self.engines.pop(engine.replica_id, None)
            self.report(f"replica {engine.replica_id}'s engine stopped")
        else:
            engine.want, engine.recorded = Replica.State.STOPPED, False

    def _restart_when_stopped(self, engine: EngineProcess) -> None:
        """A restart asked for: the engine has exited (drained, or not); ``_restart_due`` starts
        it again at once, as it restarts a failed one, without the backoff."""
        engine.end(signal.SIGKILL)  # whatever of its group outlived the leader
        engine.phase = "backoff"
        engine.probe = None
        engine.restart_at = time.monotonic()
        self.report(f"replica {engine.replica_id} stopped for its restart; starting it again")

    def _lose_row(self, engine: EngineProcess, why: str) -> None:
        """The row is no longer ours to write: stop the engine and forget it."""
        engine.row_gone = True
        engine.recorded = True
        self.report(f"replica {engine.replica_id}: {why}; stopping its engine")
        if engine.alive() and engine.phase != "stopping":
            self._stop_process(engine)
        elif not engine.alive():
            self._set_stopped(engine)

    def _fail(self, engine: EngineProcess, reason: str) -> None:
        engine.end(signal.SIGKILL)
        engine.probe = None
        engine.want, engine.recorded = Replica.State.FAILED, False
        delay = min(settings.WORKER_MAX_BACKOFF, 2.0**engine.restarts)
        engine.restarts += 1
        engine.phase = "backoff"
        engine.restart_at = time.monotonic() + delay
        self.report(
            f"replica {engine.replica_id} failed ({reason}); restarting in {delay:.0f} s"
            + (f" (log: {engine.log_path})" if engine.log_path else "")
        )
