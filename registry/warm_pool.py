"""The warm pool: each deployment's standby replicas (loaded, ready, heart-beaten, never routed),
promoted first whenever the deployment needs one more serving replica.

A replica row is a standby while ``Replica.standby`` is set; ``Deployment.standby`` is how many
the deployment keeps beside its ``replicas``. The supervisors start standbys like any other
replica (``registry.services.replica_claim`` claims one once the serving places are full), so
the pool refills by itself; the router never reads a standby row
(``registry.selectors.ready_replicas``). Promotion is one UPDATE of the row under the
deployment's row lock, audited (``replica.promote``) and announced to the gateways.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import Count, F, Q

from core.errors import InvalidInput
from core.events import publish_routing_change
from registry.models import Deployment, Replica
from registry.selectors import heartbeat_fresh_after
from registry.services import (
    HOLDING,
    SERVING_STATUSES,
    SUPERVISOR,
    Actor,
    audit_record,
    desired_replicas,
    standby_check,
)


def desired_standby(deployment: Deployment) -> int:
    """How many standby replicas ``deployment`` keeps now: none unless it is serving."""
    return deployment.standby if deployment.status in SERVING_STATUSES else 0


@dataclass(frozen=True)
class _Place:
    id: int
    state: str
    standby: bool
    last_heartbeat: datetime | None


def _places(deployment: Deployment) -> list[_Place]:
    rows = Replica.objects.filter(HOLDING, deployment=deployment).order_by("id")
    return [_Place(*row) for row in rows.values_list("id", "state", "standby", "last_heartbeat")]


# A serving place that serves nothing now, demoted first when a standby takes its place: a
# failed engine (its restart becomes the pool's refill), one draining for a restart, then one
# still loading (it carries on loading, as a standby).
_SPARE_ORDER: dict[str, int] = {Replica.State.FAILED: 0, Replica.State.DRAINING: 1, Replica.State.STARTING: 2}


def _promote(*, deployment: Deployment, places: list[_Place], reason: str, actor: Actor, announce: bool) -> list[int]:
    """Promote ready standbys of the locked ``deployment`` while it has fewer ready serving
    replicas than it wants; each promotion that would hold more serving places than wanted
    demotes a serving place that serves nothing (``_SPARE_ORDER``) to standby instead, so the
    deployment's counts stay put and nothing is drained. Returns the promoted ids."""
    if deployment.status not in SERVING_STATUSES:
        return []
    fresh_after = heartbeat_fresh_after()
    serving = [p for p in places if not p.standby]
    ready_serving = sum(1 for p in serving if p.state == Replica.State.READY)
    need = desired_replicas(deployment) - ready_serving
    if need <= 0:
        return []
    ready_standbys = [
        p
        for p in places
        if p.standby and p.state == Replica.State.READY and p.last_heartbeat and p.last_heartbeat >= fresh_after
    ]
    spare = sorted(
        (p for p in serving if p.state != Replica.State.READY), key=lambda p: (_SPARE_ORDER.get(p.state, 3), -p.id)
    )
    holding = len(serving)
    promoted: list[int] = []
    for standby in ready_standbys[:need]:
        Replica.objects.filter(pk=standby.id).update(standby=False)
        holding += 1
        in_place_of = None
        if holding > desired_replicas(deployment) and spare:
            in_place_of = spare.pop(0).id
            Replica.objects.filter(pk=in_place_of).update(standby=True)
            holding -= 1
        audit_record(
            actor=actor,
            action="replica.promote",
            target_type="replica",
            target=str(standby.id),
            before={"standby": True},
            after={"standby": False, "deployment": deployment.pk, "reason": reason, "in_place_of": in_place_of},
        )
        promoted.append(standby.id)
    if promoted and announce:
        publish_routing_change("replica")
    return promoted


def standby_promote(
    *, deployment: Deployment, reason: str, actor: Actor = SUPERVISOR, announce: bool = True
) -> list[int]:
    """Promote ready standbys of ``deployment`` while it wants more ready serving replicas than
    it has (scaled up, a serving replica failed, stopped or lost, a hot-swap's new deployment).
    Call inside transaction.atomic with the deployment row locked (``select_for_update``).

    ``announce``: publish the routing change on commit (the supervisor announces its own, off
    its loop). Returns the ids promoted, in the order promoted.
    """
    return _promote(deployment=deployment, places=_places(deployment), reason=reason, actor=actor, announce=announce)


def claim_role(*, deployment: Deployment) -> tuple[bool | None, list[int]]:
    """What a replica claimed now for the locked ``deployment`` would be: a serving one (False),
    a standby (True), or none (None: it holds all it wants); and the standbys promoted first
    (not announced: the caller announces), so a serving place is never cold-started while a
    warm one waits. Call inside transaction.atomic with the deployment row locked."""
    places = _places(deployment)
    promoted = _promote(deployment=deployment, places=places, reason="claim", actor=SUPERVISOR, announce=False)
    if promoted:
        places = _places(deployment)
    serving = sum(1 for p in places if not p.standby)
    if serving < desired_replicas(deployment):
        return False, promoted
    if len(places) - serving < desired_standby(deployment):
        return True, promoted
    return None, promoted


def deployments_promote_standbys(*, deployment_ids: list[int]) -> list[int]:
    """Promote where promotion is due among ``deployment_ids`` (a supervisor's pass): one query
    finds the serving deployments with a fresh ready standby and fewer ready serving replicas
    than wanted, then each is locked and promoted. Not announced: the caller announces."""
    if not deployment_ids:
        return []
    ready = Q(replica_set__state=Replica.State.READY)
    due = (
        Deployment.objects.filter(pk__in=deployment_ids, status__in=SERVING_STATUSES)
        .annotate(
            ready_standby=Count(
                "replica_set",
                filter=ready & Q(replica_set__standby=True, replica_set__last_heartbeat__gte=heartbeat_fresh_after()),
            ),
            ready_serving=Count("replica_set", filter=ready & Q(replica_set__standby=False)),
        )
        .filter(ready_standby__gt=0, ready_serving__lt=F("replicas"))
        .values_list("pk", flat=True)
    )
    promoted: list[int] = []
    for pk in list(due):
        with transaction.atomic():
            locked = Deployment.objects.select_for_update().filter(pk=pk).first()
            if locked is not None:
                promoted += standby_promote(deployment=locked, reason="replacement", announce=False)
    return promoted


def replica_surplus_pick(*, deployment: Deployment, replica_ids: list[int]) -> int | None:
    """Which of ``replica_ids`` (a supervisor's live replicas of ``deployment``) to drain now,
    or None: a standby while the pool holds more than its ``standby`` (a loading one first,
    else the newest), else the newest serving one while more serving places are held than
    ``replicas`` (scale-in drains; it never demotes)."""
    deployment.refresh_from_db(fields=["status", "replicas", "standby"])
    places = _places(deployment)
    mine = [p for p in places if p.id in set(replica_ids)]
    standbys = [p for p in places if p.standby]
    if len(standbys) > desired_standby(deployment):
        candidates = [p for p in mine if p.standby]
        if candidates:
            return min(candidates, key=lambda p: (p.state == Replica.State.READY, -p.id)).id
    if len(places) - len(standbys) > desired_replicas(deployment):
        candidates = [p for p in mine if not p.standby]
        if candidates:
            return max(p.id for p in candidates)
    return None


def deployment_standby_set(*, actor: Actor, deployment: Deployment, standby: int) -> Deployment:
    """Set how many warm standby replicas ``deployment`` keeps (0 … 32767). Audited
    (``deployment.standby``); the supervisors claim the new ones on free slots, and drain
    standbys (never a serving replica) when the count is lowered."""
    standby_check(standby)
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if locked.replicas == 0 and standby == 0:
            raise InvalidInput("standby", "A deployment with no serving replica keeps at least one standby.")
        if locked.standby != standby:
            before = {"standby": locked.standby}
            Deployment.objects.filter(pk=locked.pk).update(standby=standby)
            locked.standby = standby
            audit_record(
                actor=actor, action="deployment.standby", target_type="deployment", target=str(locked.pk),
                before=before, after={"standby": standby},
            )  # fmt: skip
    deployment.standby = standby
    return locked
