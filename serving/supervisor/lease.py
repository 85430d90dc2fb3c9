"""A supervisor's hold on its host: the lease (``registry.HostLease``) that makes it the only
supervisor of that host, taken at its start, renewed at every database pass, and lost when
another supervisor took it over while this one could not renew it; and how the loop waits
for a database that does not answer."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.db import DatabaseError, InterfaceError, close_old_connections
from django.utils import timezone

from registry.models import HostLease
from registry.selectors import host_lease_held
from registry.services import host_lease_renew, host_lease_take, replica_release_lost_hosts

if TYPE_CHECKING:
    from serving.supervisor.engines import EngineProcess

logger = logging.getLogger("serving.supervisor.host")

# InterfaceError is not a DatabaseError in Django's hierarchy; both mean "no database now".
DATABASE_ERRORS = (DatabaseError, InterfaceError)

# How long the loop waits for the database after a failure: short at first, then capped,
# so a restored database is noticed within seconds.
DATABASE_RETRY_FIRST = 0.5
DATABASE_RETRY_MAX = 5.0

# How often a supervisor looks for hosts whose lease expired (one query when there are none).
LOST_HOSTS_CHECK_SECONDS = 1.0


class HostLeaseHeld(Exception):
    """Another supervisor holds this host's lease: this one must not start."""

    def __init__(self, host: str, lease: HostLease) -> None:
        self.host, self.lease = host, lease
        until = timezone.localtime(lease.expires_at).strftime("%Y-%m-%d %H:%M:%S %Z")
        super().__init__(
            f"host {host} is already supervised by pid {lease.holder_pid} on {lease.holder_machine} "
            f"(its lease runs until {until} and is renewed while it runs): stop that supervisor first, "
            "or give this one another --host"
        )


def lease_holder() -> str:
    """This process's name as a lease holder: its pid and machine (for people), then a part no
    other process can repeat (a pid is reused, a machine name shared)."""
    return f"{os.getpid()}@{socket.gethostname()}/{uuid.uuid4().hex[:12]}"


class LeaseKeeping:
    """The lease's part of a ``Supervisor`` (serving.supervisor.host)."""

    host: str
    holder: str
    lease_seconds: float
    stopping: bool
    lease_lost: bool
    engines: dict[int, EngineProcess]
    report: Callable[[str], None]
    _lease_held: bool
    _routing_changed: bool
    # Since when (monotonic) this supervisor has reached the database without a break; None
    # while it does not. Another host is judged lost only by one that has been connected for
    # a whole lease: after an outage every host's lease has expired, and each needs a pass to
    # renew its own before anyone may take it as dead.
    _db_reachable_since: float | None = None
    _lost_hosts_checked_at: float = float("-inf")

    def _begin_drain(self, engine: EngineProcess) -> None:
        raise NotImplementedError

    def take_lease(self) -> None:
        """Take this host's lease, or raise ``HostLeaseHeld`` naming its holder."""
        while not host_lease_take(host=self.host, holder=self.holder, seconds=self.lease_seconds):
            lease = host_lease_held(host=self.host)
            if lease is not None:
                raise HostLeaseHeld(self.host, lease)
            # Expired or released between the two statements: take it again.
        self._lease_held = True

    def _take_lease_waiting(self) -> bool:
        """``take_lease``, waiting for a database that does not answer (who holds the host is
        known only there); False when stopped (a signal) meanwhile."""
        delay, reported = DATABASE_RETRY_FIRST, False
        while True:
            try:
                self.take_lease()
                return True
            except DATABASE_ERRORS as exc:
                if not reported:
                    reported = True
                    self.report(
                        f"database unavailable ({type(exc).__name__}); waiting for it to take the lease of {self.host}"
                    )
            with contextlib.suppress(*DATABASE_ERRORS):
                close_old_connections()
            if self.stopping:
                return False
            time.sleep(delay)
            delay = min(DATABASE_RETRY_MAX, delay * 2)

    def _release_lost_hosts(self, now: float) -> None:
        """Release the replicas of hosts whose supervisor's lease expired (the host died, or
        lost the database for longer than the lease): their deployments' places free up, and
        this pass's claims (and other hosts') place replacements on free slots. Gateways had
        already stopped routing to them once their heartbeats went stale."""
        if now - self._lost_hosts_checked_at < LOST_HOSTS_CHECK_SECONDS:
            return
        self._lost_hosts_checked_at = now
        if self._db_reachable_since is None or now - self._db_reachable_since < self.lease_seconds:
            return
        for host, count in replica_release_lost_hosts(exclude=self.host, by=self.holder).items():
            self._routing_changed = True
            self.report(f"host {host} lost (its supervisor's lease expired): released its {count} replica(s)")

    def _hold_lease(self) -> bool:
        """At the start of every database pass: take the lease (the first pass of a supervisor
        driven by ``step``) or renew it. False when another supervisor took it over: the
        supervisor then stops its engines without another write, and exits."""
        if not self._lease_held:
            self.take_lease()
            return True
        if host_lease_renew(host=self.host, holder=self.holder, seconds=self.lease_seconds):
            return True
        self._lease_held = False
        self.lease_lost = True
        self.stopping = True
        lease = None
        with contextlib.suppress(*DATABASE_ERRORS):  # only for the message: the loss stands
            lease = host_lease_held(host=self.host)
        holder = (
            f"now held by pid {lease.holder_pid} on {lease.holder_machine}"
            if lease is not None
            else "its lease row is gone"
        )
        message = (
            f"LEASE LOST: host {self.host} was taken over ({holder}) while this supervisor could not renew "
            f"its lease; it no longer writes any replica row of {self.host}, stops its {len(self.engines)} "
            "engine(s) and exits"
        )
        logger.error(message)
        self.report(message)
        # Drained by the probes alone (the new holder has released their rows, so nothing new
        # is routed to them), then stopped; ``_database_step`` writes nothing from now on.
        for engine in list(self.engines.values()):
            self._begin_drain(engine)
        return False
