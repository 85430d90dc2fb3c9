"""Hot-swap of a deployment's version: reading the swaps under way and stepping each through.

A swap (``registry.services.deployment_swap_version``) goes:

    starting ─(every replica of the new deployment ready)─► shifted ─(gateways reloaded)─►
    draining ─(every replica of the old one stopped)─► done

``swap_step`` makes whatever move is due, for every open swap. Each move is a service that
locks the deployment rows and checks its audit entry is not there yet, so calling it from
several processes at once (every supervisor's loop, ``manage.py swap_version``) is safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, InterfaceError
from django.db.models import IntegerField, Subquery
from django.db.models.fields.json import KT
from django.db.models.functions import Cast
from django.utils import timezone

from registry.models import AuditEntry, Deployment, Replica
from registry.services import (
    SWAP,
    SWAP_DONE,
    SWAP_DRAIN,
    SWAP_SHIFT,
    deployment_swap_drain,
    deployment_swap_finish,
    deployment_swap_shift,
)

logger = logging.getLogger(__name__)

_SERVING = (Deployment.Status.PENDING, Deployment.Status.RUNNING)
# Replicas of the old deployment that may still serve a request.
_LIVE_STATES = (Replica.State.STARTING, Replica.State.READY, Replica.State.DRAINING)


def drain_delay() -> float:
    """Seconds between moving the traffic and draining the old replicas: every gateway has
    reloaded its routing table by then (on the announcement, or at its periodic refresh), so
    none sends a new request to a replica about to stop."""
    return 2 * settings.ROUTING_REFRESH_SECONDS + 1.0


def stop_deadline() -> float:
    """Seconds after the drain began past which the swap is closed even if an old replica's
    row never says stopped (its host went away): the supervisor stops a draining engine after
    WORKER_DRAIN_TIMEOUT, and a minute covers the stop itself and a slow database."""
    return settings.WORKER_DRAIN_TIMEOUT + 60.0


@dataclass(frozen=True)
class Swap:
    entry: AuditEntry
    old_id: int
    new_id: int
    model: str
    from_version: str
    to_version: str
    started_at: datetime
    shifted_at: datetime | None = None
    drain_at: datetime | None = None
    outcome: str | None = None  # completed | aborted | cancelled, once done

    @property
    def phase(self) -> str:
        if self.outcome is not None:
            return self.outcome
        if self.drain_at is not None:
            return "draining"
        return "shifted" if self.shifted_at is not None else "starting"

    def __str__(self) -> str:
        return f"swap {self.entry.pk} of {self.model} {self.from_version} → {self.to_version}"


def _swap_of(entry: AuditEntry, steps: list[AuditEntry]) -> Swap:
    after: dict[str, Any] = entry.after or {}
    found = {step.action: step for step in steps}
    done = found.get(SWAP_DONE)
    return Swap(
        entry=entry,
        old_id=int(entry.target),
        new_id=int(after["swap_to"]),
        model=str(after.get("model", "")),
        from_version=str(after.get("from_version", "")),
        to_version=str(after.get("to_version", "")),
        started_at=entry.created_at,
        shifted_at=found[SWAP_SHIFT].created_at if SWAP_SHIFT in found else None,
        drain_at=found[SWAP_DRAIN].created_at if SWAP_DRAIN in found else None,
        outcome=str((done.after or {}).get("outcome")) if done is not None else None,
    )


def _with_steps(entries: list[AuditEntry]) -> list[Swap]:
    steps: dict[int, list[AuditEntry]] = {entry.pk: [] for entry in entries}
    if entries:
        for step in AuditEntry.objects.filter(
            action__in=[SWAP_SHIFT, SWAP_DRAIN, SWAP_DONE], after__swap__in=list(steps)
        ).order_by("id"):
            steps[int((step.after or {})["swap"])].append(step)
    return [_swap_of(entry, steps[entry.pk]) for entry in entries]


def open_swaps() -> list[Swap]:
    """Every swap not done yet, oldest first."""
    closed = (
        AuditEntry.objects.filter(action=SWAP_DONE, after__has_key="swap")
        .annotate(swap_id=Cast(KT("after__swap"), IntegerField()))
        .values("swap_id")
    )
    return _with_steps(list(AuditEntry.objects.filter(action=SWAP).exclude(pk__in=Subquery(closed)).order_by("id")))


def swap_get(*, swap_id: int) -> Swap | None:
    entry = AuditEntry.objects.filter(pk=swap_id, action=SWAP).first()
    return _with_steps([entry])[0] if entry is not None else None


def swap_step(*, now: datetime | None = None) -> list[str]:
    """Make every move that is due in every open swap; what was done, in words."""
    now = now or timezone.now()
    done: list[str] = []
    for swap in open_swaps():
        try:
            message = _step_one(swap, now)
        except (DatabaseError, InterfaceError):
            raise  # the caller's to handle: no database, no step
        except Exception:
            # One swap that cannot move (a bug, a row changed in a way no step expects) must
            # never stop the others, nor the supervisor's pass that calls this.
            logger.exception("%s: step failed", swap)
            continue
        if message:
            done.append(f"{swap}: {message}")
    return done


def _step_one(swap: Swap, now: datetime) -> str | None:
    deployments = {d.pk: d for d in Deployment.objects.filter(pk__in=[swap.old_id, swap.new_id])}
    old, new = deployments.get(swap.old_id), deployments.get(swap.new_id)
    if swap.shifted_at is None:
        if new is None or new.status not in _SERVING:
            return _close(swap, "aborted", "the new deployment was stopped or deleted before it was ready")
        if old is None or old.status not in _SERVING:
            return _close(swap, "aborted", "the old deployment was stopped or deleted before the traffic moved")
        fresh_after = now - timedelta(seconds=settings.REPLICA_STALE_AFTER)
        if deployment_swap_shift(swap=swap.entry, heartbeat_after=fresh_after):
            return f"every replica of deployment {new.pk} is ready; traffic moved to it from deployment {old.pk}"
        return None
    if swap.drain_at is None:
        if (now - swap.shifted_at).total_seconds() < drain_delay():
            return None
        return f"draining deployment {swap.old_id}" if deployment_swap_drain(swap=swap.entry) else None
    live = old is not None and Replica.objects.filter(deployment=old, state__in=_LIVE_STATES).exists()
    if live and (now - swap.drain_at).total_seconds() < stop_deadline():
        return None
    why = "old replicas still recorded live past the deadline" if live else "every old replica stopped"
    return _close(swap, "completed", why)


def _close(swap: Swap, outcome: str, reason: str) -> str | None:
    return f"{outcome} ({reason})" if deployment_swap_finish(swap=swap.entry, outcome=outcome, reason=reason) else None
