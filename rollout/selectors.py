"""Reads of rollouts: canaries with their decisions, the latest hot-swap of a deployment, what
a version is now and the timeline of its life."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Count, Max, Prefetch, Q, QuerySet

from registry.models import AuditEntry, Deployment, Model, ModelVersion
from registry.selectors import SCALE_ACTIONS
from rollout.hotswap import SWAP, SWAP_DONE, SWAP_DRAIN, SWAP_SHIFT
from rollout.models import Canary, CanaryDecision


def canary_latest(*, model: Model) -> Canary | None:
    """The model's active canary, else its most recent one, with every decision in order."""
    canaries = (
        Canary.objects.filter(model=model)
        .select_related("model", "base_version", "canary_version", "created_by")
        .prefetch_related(
            Prefetch("decisions", queryset=CanaryDecision.objects.select_related("actor").order_by("at", "id"))
        )
    )
    return canaries.filter(status__in=Canary.ACTIVE_STATUSES).first() or canaries.order_by("-created_at", "-id").first()


def models_with_latest_canary(*, q: str = "") -> list[tuple[Model, Canary | None]]:
    """Every model (whose name contains ``q``) with its active canary, else its latest one."""
    models = list(Model.objects.filter(name__icontains=q).order_by("name") if q else Model.objects.order_by("name"))
    canaries = Canary.objects.filter(model__in=models).select_related("base_version", "canary_version")
    latest: dict[int, Canary] = {}
    for canary in canaries.order_by("created_at", "id"):
        current = latest.get(canary.model_id)
        if current is None or current.status not in Canary.ACTIVE_STATUSES:
            latest[canary.model_id] = canary
    return [(model, latest.get(model.pk)) for model in models]


def swap_latest_id(*, deployment_id: int) -> int | None:
    """The audit entry of the latest hot-swap ``deployment_id`` took part in (old or new side)."""
    return (
        AuditEntry.objects.filter(action=SWAP)
        .filter(Q(target=str(deployment_id)) | Q(after__swap_to=deployment_id))
        .order_by("-id")
        .values_list("pk", flat=True)
        .first()
    )


def canaries_live_count() -> int:
    """Canaries running or paused now (every model's)."""
    return Canary.objects.filter(status__in=[Canary.Status.RUNNING, Canary.Status.PAUSED]).count()


def canary_arm_at(*, model: str, version: str, at: datetime) -> tuple[Canary, str] | None:
    """The canary of ``model`` running at ``at`` in which ``version`` was an arm, and which arm
    ("canary" or "base"); None when no canary of the model ran then."""
    running = (
        Canary.objects.filter(model__name=model, created_at__lte=at)
        .filter(Q(status__in=Canary.ACTIVE_STATUSES) | Q(updated_at__gte=at))
        .select_related("base_version", "canary_version")
        .order_by("-created_at", "-id")
        .first()
    )
    if running is None:
        return None
    if running.canary_version.version == version:
        return running, "canary"
    if running.base_version.version == version:
        return running, "base"
    return None


def canaries_of(*, model: Model) -> QuerySet[Canary]:
    """Every canary the model ever ran, newest first, with how many decisions each made and
    when the last was."""
    return (
        Canary.objects.filter(model=model)
        .select_related("base_version", "canary_version", "created_by")
        .annotate(decision_count=Count("decisions"), last_decision_at=Max("decisions__at"))
        .order_by("-created_at", "-id")
    )


def promotions_of(*, canary_ids: list[int]) -> dict[int, list[CanaryDecision]]:
    """The promote decisions of the canaries, by canary id (the controller's or a person's)."""
    found: dict[int, list[CanaryDecision]] = {}
    for decision in CanaryDecision.objects.filter(canary_id__in=canary_ids, verdict=CanaryDecision.Verdict.PROMOTE):
        found.setdefault(decision.canary_id, []).append(decision)
    return found


@dataclass(frozen=True)
class Lifecycle:
    """What a version is now, in one word and a detail, the same on every page."""

    state: str  # serving | canary | base | deployed | promoted | rolled_back | stopped | registered
    label: str  # e.g. "canary at 25 %"


def lifecycle_of(*, versions: list[ModelVersion]) -> dict[int, Lifecycle]:
    """Each version's state now (by version id), from its deployments (prefetched or not) and
    its model's canaries: two queries for any number of versions."""
    ids = [v.pk for v in versions]
    deployments: dict[int, list[Deployment]] = {}
    for deployment in Deployment.objects.filter(version_id__in=ids):
        deployments.setdefault(deployment.version_id, []).append(deployment)
    canaries: dict[int, list[Canary]] = {}
    for canary in Canary.objects.filter(Q(canary_version_id__in=ids) | Q(base_version_id__in=ids)).order_by(
        "-created_at", "-id"
    ):
        for version_id in {canary.canary_version_id, canary.base_version_id} & set(ids):
            canaries.setdefault(version_id, []).append(canary)
    out = {}
    for version in versions:
        out[version.pk] = _lifecycle(version.pk, deployments.get(version.pk, []), canaries.get(version.pk, []))
    return out


def _lifecycle(version_id: int, deployments: list[Deployment], canaries: list[Canary]) -> Lifecycle:
    active = next((c for c in canaries if c.status in Canary.ACTIVE_STATUSES), None)
    if active is not None and active.canary_version_id == version_id:
        return Lifecycle("canary", f"canary at {active.canary_percent} %")
    running = [d for d in deployments if d.status == Deployment.Status.RUNNING]
    weight = sum(d.traffic_weight for d in running)
    if active is not None:
        return Lifecycle("base", f"canary base at {100 - active.canary_percent} %")
    latest = next((c for c in canaries if c.canary_version_id == version_id), None)
    if weight > 0:
        if latest is not None and latest.status == Canary.Status.PROMOTED:
            return Lifecycle("promoted", f"promoted, serving {weight} %")
        return Lifecycle("serving", f"serving {weight} %")
    if latest is not None and latest.status == Canary.Status.ROLLED_BACK:
        return Lifecycle("rolled_back", "rolled back")
    if any(d.status in (Deployment.Status.PENDING, Deployment.Status.RUNNING) for d in deployments):
        return Lifecycle("deployed", "deployed, no traffic")
    if deployments:
        return Lifecycle("stopped", "stopped")
    return Lifecycle("registered", "registered, not deployed")


# --- A version's timeline, from the audit log ------------------------------------------------


@dataclass(frozen=True)
class TimelineEvent:
    """One event of a version's life: its audit entry (time, actor, link), a kind the page can
    style, and what happened in a few words."""

    entry: AuditEntry
    kind: str  # registered | deployed | traffic | canary | promoted | rolled_back | swap | scaled | stopped
    label: str  # e.g. "traffic 5 → 25 %"


# Changes to one of the version's deployments that its timeline shows (besides the swaps).
_DEPLOYMENT_ACTIONS = (
    "deployment.create", *SCALE_ACTIONS, "deployment.bounds", "deployment.autoscale", "deployment.adapters",
)  # fmt: skip
_SWAP_ACTIONS = (SWAP, SWAP_SHIFT, SWAP_DRAIN, SWAP_DONE)


def version_timeline(*, version: ModelVersion, limit: int = 200) -> list[TimelineEvent]:
    """The latest ``limit`` events of ``version``'s life, oldest first: registered, deployed,
    traffic changes, its canaries (started, each step, paused, completed, promoted, rolled back,
    as candidate or as base), hot-swaps to and from it, scaling and bounds, stopped. Read from
    the audit log alone (three queries), so a deleted deployment's events stay."""
    name, number = version.model.name, version.version
    ids = list(Deployment.objects.filter(version=version).values_list("pk", flat=True))
    keys = [str(pk) for pk in ids]
    about = (
        Q(target_type="model_version", target=str(version))
        | Q(target_type="deployment", target__in=keys, action__in=(*_DEPLOYMENT_ACTIONS, *_SWAP_ACTIONS))
        | Q(target_type="deployment", action=SWAP, after__swap_to__in=ids)
        | Q(target_type="model", target=name, action="traffic.set")
        & (Q(before__has_key=number) | Q(after__has_key=number))
        # A hold is an event only when it ends the steps (the canary waits for a person then).
        | Q(target_type="canary", target=name)
        & (Q(after__canary_version=number) | Q(after__base_version=number))
        & (~Q(action="canary.hold") | Q(after__status="completed"))
    )
    entries = list(AuditEntry.objects.filter(about).order_by("-created_at", "-id")[:limit])
    swaps = {e.pk: e for e in entries if e.action == SWAP}
    # The steps of a swap to this version name the deployment it replaced, not this one's.
    arriving = [pk for pk, e in swaps.items() if (e.after or {}).get("swap_to") in ids]
    if arriving:
        steps = AuditEntry.objects.filter(action__in=(SWAP_SHIFT, SWAP_DRAIN, SWAP_DONE), after__swap__in=arriving)
        seen = {e.pk for e in entries}
        entries += [e for e in steps if e.pk not in seen]
    events = []
    for entry in sorted(entries, key=lambda e: (e.created_at, e.pk)):
        event = _event(entry, number, set(keys), swaps)
        if event is not None:
            events.append(TimelineEvent(entry, *event))
    return events


def _event(entry: AuditEntry, number: str, mine: set[str], swaps: dict[int, AuditEntry]) -> tuple[str, str] | None:
    """The kind and words of ``entry`` on the timeline of version ``number`` (whose deployments'
    ids are ``mine``), or None when it did not touch this version."""
    before: dict[str, Any] = entry.before if isinstance(entry.before, dict) else {}
    after: dict[str, Any] = entry.after if isinstance(entry.after, dict) else {}
    action = entry.action
    if entry.target_type == "model_version":
        return ("registered", "registered") if action == "model_version.register" else ("registered", action)
    if action == "traffic.set":
        old, new = before.get(number, 0), after.get(number, 0)
        return None if old == new else ("traffic", f"traffic {old} → {new} %")
    if entry.target_type == "canary":
        return _canary_event(action, before, after, number)
    if action in _SWAP_ACTIONS:
        return _swap_event(entry, after, mine, swaps)
    deployment = f"deployment #{entry.target}"
    if action == "deployment.create":
        replicas = after.get("replicas")
        return "deployed", (
            f"deployed as {deployment}: {replicas} replica{'' if replicas == 1 else 's'}, "
            f"{after.get('traffic_weight', 0)} % of traffic"
        )
    if action in SCALE_ACTIONS:
        how = "autoscaled" if action == "autoscale" else "scaled"
        return "scaled", f"{how} {deployment}: {before.get('replicas')} → {after.get('replicas')} replicas"
    if action == "deployment.bounds":
        return "scaled", f"{deployment} keeps {after.get('min_replicas')} to {after.get('max_replicas')} replicas"
    if action == "deployment.autoscale":
        enabled = bool((after.get("autoscale") or {}).get("enabled"))
        return "scaled", f"autoscaling of {deployment} {'on' if enabled else 'off'}"
    if action == "deployment.adapters":
        count, was = after.get("max_adapters"), before.get("max_adapters")
        return "scaled", f"{deployment} runs {count} LoRA adapter{'' if count == 1 else 's'} per batch (was {was})"
    return None


def _canary_event(action: str, before: dict[str, Any], after: dict[str, Any], number: str) -> tuple[str, str] | None:
    candidate, base = after.get("canary_version"), after.get("base_version")
    percent, steps = after.get("canary_percent"), after.get("steps") or []
    step = f"step {int(after.get('current_step', 0)) + 1} of {len(steps)}"
    waits = after.get("status") == "completed" and before.get("status") != "completed"
    waiting = ", waiting for a person to promote" if waits else ""
    if number == candidate:
        words = {
            "canary.create": ("canary", f"canary started against {base} at {percent} %"),
            "canary.promote_step": ("canary", f"canary {step}: {percent} %{waiting}"),
            "canary.hold": ("canary", f"canary passed every step at {percent} %{waiting}"),
            "canary.pause": ("canary", "canary paused"),
            "canary.resume": ("canary", "canary resumed"),
            "canary.promote": ("promoted", "promoted: serving 100 %"),
            "canary.rollback": ("rolled_back", "rolled back: no traffic"),
        }
    else:
        words = {
            "canary.create": ("canary", f"base of a canary of {candidate} at {percent} %"),
            "canary.promote_step": (
                "canary",
                f"canary {candidate} {step}: {percent} %, this version {100 - percent} %"
                if isinstance(percent, int)
                else f"canary {candidate} {step}",
            ),
            "canary.hold": ("canary", f"canary {candidate} passed every step{waiting}"),
            "canary.pause": ("canary", f"canary {candidate} paused"),
            "canary.resume": ("canary", f"canary {candidate} resumed"),
            "canary.promote": ("stopped", f"replaced by {candidate} (promoted): no traffic"),
            "canary.rollback": ("traffic", f"canary {candidate} rolled back: serving 100 %"),
        }
    return words.get(action)


def _swap_event(
    entry: AuditEntry, after: dict[str, Any], mine: set[str], swaps: dict[int, AuditEntry]
) -> tuple[str, str] | None:
    swap_id = after.get("swap")
    swap = entry if entry.action == SWAP else swaps.get(swap_id) if isinstance(swap_id, int) else None
    if swap is None:
        return None
    facts: dict[str, Any] = swap.after if isinstance(swap.after, dict) else {}
    leaving = swap.target in mine  # this version's deployment is the one replaced
    other = facts.get("to_version") if leaving else facts.get("from_version")
    what = f"hot-swap to {other}" if leaving else f"hot-swap from {other}"
    if entry.action == SWAP:
        return "swap", f"{what} started: deployment #{swap.target} → #{facts.get('swap_to')}"
    if entry.action == SWAP_SHIFT:
        return "swap", f"{what}: traffic moved" + ("" if leaving else " here")
    if entry.action == SWAP_DRAIN:
        return ("stopped", f"{what}: deployment #{swap.target} draining") if leaving else None
    outcome, reason = after.get("outcome"), after.get("reason")
    if outcome == "completed":
        if leaving:
            return "stopped", f"{what} completed: deployment #{swap.target} stopped"
        return "swap", f"{what} completed"
    if outcome == "cancelled" and not leaving:
        return "stopped", f"{what} cancelled: deployment #{facts.get('swap_to')} stopped"
    return "swap", f"{what} {outcome}" + (f": {reason}" if reason and reason != outcome else "")
