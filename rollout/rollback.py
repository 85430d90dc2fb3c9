"""Rollback of a model to the version that served it before its last promotion or hot-swap.

What changed the version a model serves is in the audit log: a hot-swap's traffic shift
(``deployment.swap.shift``, from the swap's old version to its new one), a canary's promotion
(``canary.promote``: base to candidate), or a rollback by traffic (``model.rollback``). The
latest of them names the version to go back to. The rollback is carried out by the service
that made such changes, never by a write of its own:

- the previous version's deployments are still serving and every replica they want is ready
  (a promoted canary's base stays deployed at weight 0): ``traffic_set`` gives it all the
  traffic at once, as a canary's rollback does;
- otherwise (a hot-swap stopped the old deployment) the deployment now serving is hot-swapped
  back (``deployment_swap_version``): the previous version's replicas start, the traffic moves
  once every one is ready, then the newer ones drain.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction

from core.errors import InvalidInput
from registry.adapters import is_adapter_framework
from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica
from registry.selectors import adapter_replicas, heartbeat_fresh_after, model_traffic_split
from registry.services import SERVING_STATUSES, Actor, audit_record, traffic_set
from rollout.hotswap import SWAP, SWAP_SHIFT, deployment_swap_version, open_swaps
from rollout.models import Canary

ROLLBACK = "model.rollback"
PROMOTE = "canary.promote"
VIA_TRAFFIC = "traffic"
VIA_HOT_SWAP = "hot-swap"


@dataclass(frozen=True)
class ServingChange:
    """The latest change of the version a model serves, as the audit log recorded it."""

    entry_id: int  # the entry that recorded the change: a swap's shift, a promotion, a rollback
    kind: str  # "hot-swap" | "canary promotion" | "rollback"
    from_version: str
    to_version: str
    at: datetime
    by: str  # who started it ("" for the operator)
    deployment_id: int | None = None  # a hot-swap's new deployment: the one serving ``to_version``


@dataclass(frozen=True)
class RollbackPlan:
    """What a rollback of ``model`` would do now, or why it cannot (``refusal``)."""

    model: Model
    change: ServingChange
    via: str  # VIA_TRAFFIC or VIA_HOT_SWAP
    deployment: Deployment | None  # the deployment hot-swapped back (VIA_HOT_SWAP)
    refusal: str = ""

    @property
    def to_version(self) -> str:
        return self.change.from_version

    @property
    def from_version(self) -> str:
        return self.change.to_version

    @property
    def available(self) -> bool:
        return not self.refusal

    @property
    def deployment_id(self) -> int | None:
        return self.deployment.pk if self.deployment is not None else None


@dataclass(frozen=True)
class Rollback:
    """A rollback carried out: the traffic split it set, or the hot-swap it started."""

    plan: RollbackPlan
    weights: dict[str, int] | None = None
    swap_to: Deployment | None = None


def _last_change(model: Model) -> ServingChange | None:
    """The latest hot-swap shift, canary promotion or rollback by traffic of ``model``."""
    found: list[ServingChange] = []
    swaps = {e.pk: e for e in AuditEntry.objects.filter(action=SWAP, target_type="deployment", after__model=model.name)}
    shifts = AuditEntry.objects.filter(action=SWAP_SHIFT, after__swap__in=list(swaps))
    shift = shifts.order_by("-id").first() if swaps else None
    if shift is not None:
        swap = swaps[int((shift.after or {})["swap"])]
        facts: dict[str, Any] = swap.after or {}
        versions = str(facts.get("from_version", "")), str(facts.get("to_version", ""))
        new = int(facts["swap_to"])
        found.append(ServingChange(shift.pk, "hot-swap", *versions, shift.created_at, swap.actor_name, new))
    promotions = AuditEntry.objects.filter(action=PROMOTE, target_type="canary", target=model.name)
    promote = promotions.order_by("-id").first()
    if promote is not None:
        facts = promote.after or {}
        versions = str(facts.get("base_version", "")), str(facts.get("canary_version", ""))
        found.append(ServingChange(promote.pk, "canary promotion", *versions, promote.created_at, promote.actor_name))
    rollbacks = AuditEntry.objects.filter(action=ROLLBACK, target_type="model", target=model.name)
    rolled = rollbacks.filter(after__via=VIA_TRAFFIC).order_by("-id").first()
    if rolled is not None:
        versions = str((rolled.before or {}).get("version", "")), str((rolled.after or {}).get("version", ""))
        found.append(ServingChange(rolled.pk, "rollback", *versions, rolled.created_at, rolled.actor_name))
    return max(found, key=lambda change: change.entry_id, default=None)


def _not_ready(deployments: list[Deployment], version: ModelVersion) -> str:
    """Why traffic may not move to these deployments of ``version`` now ("" when it may): as a
    hot-swap's shift, every replica each wants is ready, routed and heart-beaten."""
    if is_adapter_framework(version.framework):
        held = adapter_replicas(version_ids=[version.pk]).get(version.pk, [])
        return "" if held else f"No ready replica of its base holds {version.version} yet."
    fresh_after = heartbeat_fresh_after()
    for deployment in deployments:
        ready = Replica.objects.filter(
            deployment=deployment, state=Replica.State.READY, standby=False, last_heartbeat__gte=fresh_after
        ).count()
        wanted = max(1, deployment.replicas)
        if ready < wanted:
            return (
                f"{version.version}'s deployment #{deployment.pk} has {ready} of {wanted} "
                f"replica{'s' if wanted != 1 else ''} ready: traffic would reach replicas that cannot serve it."
            )
    return ""


def rollback_plan(*, model: Model) -> RollbackPlan | None:
    """What rolling ``model`` back would do now; None when its serving version never changed
    (nothing to roll back to). A plan that cannot be carried out now says why in ``refusal``."""
    change = _last_change(model)
    if change is None or not change.from_version or change.from_version == change.to_version:
        return None
    previous = ModelVersion.objects.filter(model=model, version=change.from_version).first()
    serving = list(
        Deployment.objects.filter(version__model=model, status__in=SERVING_STATUSES)
        .select_related("version__model")
        .order_by("id")
    )
    back = [d for d in serving if d.version.version == change.from_version]
    newer = [d for d in serving if d.version.version == change.to_version]
    taking_over = next((d for d in newer if d.pk == change.deployment_id), None)
    ready_refusal = _not_ready(back, previous) if back and previous is not None else ""
    via = VIA_TRAFFIC if back and not ready_refusal else VIA_HOT_SWAP
    if via == VIA_HOT_SWAP and taking_over is None and len(newer) == 1:
        taking_over = newer[0]  # a promoted canary's deployment, its base stopped since
    plan = RollbackPlan(model=model, change=change, via=via, deployment=taking_over if via == VIA_HOT_SWAP else None)

    def refused(why: str) -> RollbackPlan:
        return RollbackPlan(model=model, change=change, via=via, deployment=plan.deployment, refusal=why)

    if previous is None:
        return refused(f"{change.from_version} is no longer a registered version of {model.name}.")
    canary = Canary.objects.filter(model=model, status__in=Canary.ACTIVE_STATUSES).first()
    if canary is not None:
        return refused(f"A {canary.status} canary sets {model.name}'s traffic: promote or roll the canary back.")
    under_way = next((swap for swap in open_swaps() if swap.model == model.name), None)
    if under_way is not None:
        return refused(
            f"A hot-swap of {model.name} ({under_way.from_version} → {under_way.to_version}) is under way: "
            "roll back once it has finished."
        )
    if model_traffic_split(model=model).get(change.from_version) == 100:
        return refused(f"{change.from_version} serves all of {model.name}'s traffic already.")
    if via == VIA_HOT_SWAP:
        if back:  # deployed, but not ready: moving the traffic now would drop requests
            return refused(ready_refusal)
        if plan.deployment is None:
            if change.deployment_id is not None:
                return refused(
                    f"Deployment #{change.deployment_id}, which took over from {change.from_version}, no longer serves."
                )
            count = len(newer)
            return refused(
                f"{change.to_version} has {count} serving deployment{'s' if count != 1 else ''}: "
                f"hot-swap the one to change back to {change.from_version}."
            )
    return plan


def model_rollback(*, actor: Actor, model: Model, version: str) -> Rollback:
    """Roll ``model`` back to ``version``, the version it served before its last promotion or
    hot-swap (the caller names it, so a change made since the person confirmed is refused
    rather than undone in its place). Audited ``model.rollback``, beside the entries of the
    service that carries it out (``traffic_set`` or ``deployment_swap_version``).

    Raises ``InvalidInput``: ``version`` when it is not the version to roll back to, ``model``
    when there is none or it cannot be done now (the plan's refusal)."""
    with transaction.atomic():
        # The model's row serialises rollbacks of it (and canary starts, which lock it too).
        Model.objects.select_for_update().get(pk=model.pk)
        plan = rollback_plan(model=model)
        if plan is None:
            raise InvalidInput("model", f"{model.name}'s serving version never changed: nothing to roll back to.")
        if plan.to_version != version:
            raise InvalidInput(
                "version",
                f"{model.name} would roll back to {plan.to_version}, not {version}: it changed since; look again.",
            )
        if plan.refusal:
            raise InvalidInput("model", plan.refusal)
        target = ModelVersion.objects.select_related("model").get(model=model, version=version)
        before = {"version": plan.from_version, "weights": model_traffic_split(model=model)}
        after: dict[str, Any] = {"version": version, "via": plan.via, "undoes": plan.change.entry_id}
        result: Rollback
        if plan.via == VIA_TRAFFIC:
            weights = traffic_set(actor=actor, model=model, weights={version: 100})
            after["weights"] = weights
            result = Rollback(plan=plan, weights=weights)
        else:
            assert plan.deployment is not None  # a plan via hot-swap without one is refused
            new = deployment_swap_version(actor=actor, deployment=plan.deployment, version=target)
            after |= {"deployment": plan.deployment.pk, "swap_to": new.pk}
            result = Rollback(plan=plan, swap_to=new)
        audit_record(actor=actor, action=ROLLBACK, target_type="model", target=model.name, before=before, after=after)
    return result
