"""Reads of rollouts: canaries with their decisions, the latest hot-swap of a deployment."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, Max, Prefetch, Q, QuerySet

from registry.models import AuditEntry, Deployment, Model, ModelVersion
from rollout.hotswap import SWAP
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
