"""Hot-swap of a deployment's version: reading the swaps under way and stepping each through.

A swap (``deployment_swap_version``) goes:

    starting ─(every replica of the new deployment ready)─► shifted ─(gateways reloaded)─►
    draining ─(every replica of the old one stopped)─► done

``swap_step`` makes whatever move is due, for every open swap. Each move is a service that
locks the deployment rows and checks its audit entry is not there yet, so calling it from
several processes at once (every supervisor's loop, ``manage.py swap_version``) is safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import DatabaseError, InterfaceError, transaction
from django.db.models import IntegerField, Q, Subquery
from django.db.models.fields.json import KT
from django.db.models.functions import Cast
from django.utils import timezone

from core.errors import InvalidInput
from core.events import publish_routing_change
from registry.models import AuditEntry, Deployment, ModelVersion, Replica
from registry.selectors import heartbeat_fresh_after
from registry.services import (
    HOT_SWAP,
    SERVING_STATUSES,
    Actor,
    audit_record,
    deployment_create,
    deployment_snapshot,
    deployment_transition,
)
from registry.warm_pool import standby_promote
from rollout.models import Canary

logger = logging.getLogger(__name__)

# Replicas of the old deployment that may still serve a request.
_LIVE_STATES = (Replica.State.STARTING, Replica.State.READY, Replica.State.DRAINING)


# --- The swap's writes ------------------------------------------------------------------
# A swap is recorded in the audit log, not in a table of its own: the ``deployment.swap``
# entry (target: the old deployment; after: ``swap_to``, the new one) is the intent, and its
# steps are entries that name it (``after.swap``). ``swap_step`` reads them
# and calls the functions below, each of which re-checks under a row lock, so any number of
# supervisors (and ``manage.py swap_version``) may drive the same swap.

SWAP = "deployment.swap"
SWAP_SHIFT = "deployment.swap.shift"
SWAP_DRAIN = "deployment.swap.drain"
SWAP_DONE = "deployment.swap.done"


def _swap_step_recorded(swap: AuditEntry, action: str) -> bool:
    return AuditEntry.objects.filter(action=action, after__swap=swap.pk).exists()


def _swap_to(swap: AuditEntry) -> int:
    """The new deployment of a swap."""
    return int((swap.after or {})["swap_to"])


def deployment_swap_version(*, actor: Actor, deployment: Deployment, version: ModelVersion) -> Deployment:
    """Start serving ``version`` in place of ``deployment``'s, without dropping a request.

    Creates the replacement deployment (same replicas, bounds, GPU type, autoscaling and
    warm pool, weight 0, so nothing is routed to it yet) and records the swap. The
    supervisors then start its replicas; once every one of them is ready,
    ``deployment_swap_shift`` moves the traffic, and after the gateways have reloaded the old
    deployment drains (its in-flight requests finish) and stops. Returns the new deployment.

    A warm pool of ``version`` readied beforehand (``deployment_prewarm``: weight 0, no
    serving replica, standbys) becomes the replacement instead: it takes the old one's shape
    and its ready standbys are promoted in this transaction, so the shift waits for no cold
    start (those not ready yet are promoted as they become ready).
    """
    if version.model_id != deployment.version.model_id:
        raise InvalidInput("version", f"{version} is not a version of {deployment.version.model.name}.")
    with transaction.atomic():
        old = Deployment.objects.select_for_update().select_related("version__model").get(pk=deployment.pk)
        if old.version_id == version.pk:
            raise InvalidInput("version", f"Deployment {old.pk} serves {version} already.")
        if old.status not in SERVING_STATUSES:
            raise InvalidInput("deployment", f"Deployment {old.pk} is {old.status}; only a serving one can be swapped.")
        # A canary judges (and rolls back to) the versions it was started with: swapping one of
        # them away would leave it unable to set its split, and a worse canary keeping its share.
        canary = (
            Canary.objects.filter(model_id=old.version.model_id, status__in=Canary.ACTIVE_STATUSES)
            .filter(Q(base_version_id=old.version_id) | Q(canary_version_id=old.version_id))
            .first()
        )
        if canary is not None:
            raise InvalidInput(
                "deployment",
                f"Deployment {old.pk} serves {old.version.version}, which the {canary.status} canary of "
                f"{old.version.model.name} compares; promote or roll the canary back first.",
            )
        involved = AuditEntry.objects.filter(action=SWAP).filter(Q(target=str(old.pk)) | Q(after__swap_to=old.pk))
        closed = AuditEntry.objects.filter(
            action=SWAP_DONE, after__swap__in=list(involved.values_list("pk", flat=True))
        )
        if involved.count() > closed.count():
            raise InvalidInput("deployment", f"A swap of deployment {old.pk} is under way already.")
        new = _warm_pool_of(version)
        promoted: list[int] = []
        if new is not None:
            before = deployment_snapshot(new)
            shape = {"replicas": old.replicas, "min_replicas": old.min_replicas, "max_replicas": old.max_replicas,
                     "gpu_type": old.gpu_type, "standby": old.standby}  # fmt: skip
            Deployment.objects.filter(pk=new.pk).update(**shape)
            for field, value in shape.items():
                setattr(new, field, value)
            audit_record(actor=actor, action="deployment.adopt", target_type="deployment", target=str(new.pk),
                         before=before, after=deployment_snapshot(new))  # fmt: skip
            promoted = standby_promote(deployment=new, reason="hot-swap", actor=actor)
        else:
            new = deployment_create(
                version=version,
                replicas=old.replicas,
                min_replicas=old.min_replicas,
                max_replicas=old.max_replicas,
                traffic_weight=0,
                gpu_type=old.gpu_type,
                standby=old.standby,
                actor=actor,
            )
        if old.autoscale:
            Deployment.objects.filter(pk=new.pk).update(autoscale=old.autoscale)
            new.autoscale = old.autoscale
        audit_record(
            actor=actor,
            action=SWAP,
            target_type="deployment",
            target=str(old.pk),
            before=deployment_snapshot(old),
            after={
                "swap_to": new.pk,
                "model": old.version.model.name,
                "from_version": old.version.version,
                "to_version": version.version,
                "replicas": new.replicas,
                "promoted": promoted,
            },
        )
    return new


def _warm_pool_of(version: ModelVersion) -> Deployment | None:
    """The warm pool readied for a swap to ``version`` (``deployment_prewarm``), locked; None if none."""
    return (
        Deployment.objects.select_for_update()
        .select_related("version__model")
        .filter(version=version, status__in=SERVING_STATUSES, replicas=0, traffic_weight=0)
        .order_by("id")
        .first()
    )


def deployment_prewarm(
    *, actor: Actor, deployment: Deployment, version: ModelVersion, standby: int | None = None
) -> Deployment:
    """Ready ``version`` for a swap of ``deployment``: a deployment of it with no serving replica,
    weight 0 and ``standby`` (default: ``deployment``'s replicas) warm standbys, which the
    supervisors start and keep ready, never routed. ``deployment_swap_version`` to ``version``
    then adopts it and promotes them. Returns the pool (the one there already, if any)."""
    if version.model_id != deployment.version.model_id:
        raise InvalidInput("version", f"{version} is not a version of {deployment.version.model.name}.")
    if deployment.version_id == version.pk:
        raise InvalidInput("version", f"Deployment {deployment.pk} serves {version} already.")
    with transaction.atomic():
        existing = _warm_pool_of(version)
        if existing is not None:
            return existing
        return deployment_create(
            version=version,
            replicas=0,
            min_replicas=0,
            max_replicas=max(1, deployment.max_replicas),
            traffic_weight=0,
            gpu_type=deployment.gpu_type,
            standby=deployment.replicas if standby is None else standby,
            actor=actor,
        )


def deployment_swap_shift(*, swap: AuditEntry, heartbeat_after: datetime) -> bool:
    """Move a swap's traffic to the new deployment once every replica it wants is ready (with a
    heartbeat after ``heartbeat_after``, so routable): the new one gets the old one's weight,
    the old one 0, in one transaction; gateways reload on commit. False: not yet, or done."""
    old_id, new_id = int(swap.target), _swap_to(swap)
    with transaction.atomic():
        rows = {d.pk: d for d in Deployment.objects.select_for_update().filter(pk__in=[old_id, new_id]).order_by("id")}
        old, new = rows.get(old_id), rows.get(new_id)
        if old is None or new is None or _swap_step_recorded(swap, SWAP_SHIFT):
            return False
        ready = Replica.objects.filter(
            deployment=new, state=Replica.State.READY, standby=False, last_heartbeat__gte=heartbeat_after
        ).count()
        if new.status not in SERVING_STATUSES or ready < new.replicas:
            return False
        before = {"old": old.traffic_weight, "new": new.traffic_weight}
        after = {"old": 0, "new": min(100, new.traffic_weight + old.traffic_weight)}
        Deployment.objects.filter(pk=new.pk).update(traffic_weight=after["new"])
        Deployment.objects.filter(pk=old.pk).update(traffic_weight=0)
        audit_record(
            actor=HOT_SWAP,
            action=SWAP_SHIFT,
            target_type="deployment",
            target=str(old.pk),
            before={"swap": swap.pk, "weights": before},
            after={"swap": swap.pk, "weights": after, "ready_replicas": ready},
        )
        publish_routing_change("traffic")
    return True


def deployment_swap_drain(*, swap: AuditEntry) -> bool:
    """Drain a swap's old deployment (its traffic moved a while ago): supervisors stop routing
    to its replicas and stop each once its engine is idle. False: done already."""
    with transaction.atomic():
        old = Deployment.objects.select_for_update().filter(pk=int(swap.target)).first()
        if old is None or _swap_step_recorded(swap, SWAP_DRAIN):
            return False
        before = old.status
        if old.status == Deployment.Status.RUNNING:
            deployment_transition(deployment=old, status=Deployment.Status.DRAINING)
        elif old.status == Deployment.Status.PENDING:  # never ready: nothing to drain
            deployment_transition(deployment=old, status=Deployment.Status.STOPPED)
        audit_record(
            actor=HOT_SWAP,
            action=SWAP_DRAIN,
            target_type="deployment",
            target=str(old.pk),
            before={"swap": swap.pk, "status": before},
            after={"swap": swap.pk, "status": old.status},
            always=True,  # the step's marker (swap_step reads it), even if the old one had stopped already
        )
        publish_routing_change("deployments")
    return True


def deployment_swap_finish(*, swap: AuditEntry, outcome: str, reason: str) -> bool:
    """Close a swap: ``completed`` stops its drained old deployment; ``aborted`` and
    ``cancelled`` leave the deployments as they are. False: closed already."""
    with transaction.atomic():
        old = Deployment.objects.select_for_update().filter(pk=int(swap.target)).first()
        if _swap_step_recorded(swap, SWAP_DONE):
            return False
        if outcome == "completed" and old is not None and old.status == Deployment.Status.DRAINING:
            deployment_transition(deployment=old, status=Deployment.Status.STOPPED)
        audit_record(
            actor=HOT_SWAP,
            action=SWAP_DONE,
            target_type="deployment",
            target=swap.target,
            before=None,
            after={"swap": swap.pk, "outcome": outcome, "reason": reason},
        )
    return True


def deployment_swap_cancel(*, actor: Actor, swap: AuditEntry) -> None:
    """Give up a swap whose traffic has not moved: its new deployment stops (supervisors stop
    its replicas; nothing was routed to them) and the old one serves on."""
    with transaction.atomic():
        new = Deployment.objects.select_for_update().filter(pk=_swap_to(swap)).first()
        if _swap_step_recorded(swap, SWAP_DONE):
            raise InvalidInput("swap", "The swap is over already.")
        if _swap_step_recorded(swap, SWAP_SHIFT):
            raise InvalidInput("swap", "The traffic has moved already: swap back to the old version instead.")
        if new is not None and new.status == Deployment.Status.RUNNING:
            deployment_transition(deployment=new, status=Deployment.Status.DRAINING)
        if new is not None and new.status in (Deployment.Status.PENDING, Deployment.Status.DRAINING):
            deployment_transition(deployment=new, status=Deployment.Status.STOPPED)
        audit_record(
            actor=actor,
            action=SWAP_DONE,
            target_type="deployment",
            target=swap.target,
            before=None,
            after={"swap": swap.pk, "outcome": "cancelled", "reason": "cancelled"},
        )
        publish_routing_change("deployments")


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
        if new is None or new.status not in SERVING_STATUSES:
            return _close(swap, "aborted", "the new deployment was stopped or deleted before it was ready")
        if old is None or old.status not in SERVING_STATUSES:
            return _close(swap, "aborted", "the old deployment was stopped or deleted before the traffic moved")
        fresh_after = heartbeat_fresh_after(now)
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
