"""Reads from the registry."""

from __future__ import annotations

from django.db.models import Prefetch, Q, QuerySet

from registry.models import AuditEntry, Canary, CanaryDecision, Deployment, Model, ModelVersion, Replica


def model_list_with_versions() -> QuerySet[Model]:
    return Model.objects.prefetch_related(
        Prefetch("versions", queryset=ModelVersion.objects.order_by("-created_at"))
    ).order_by("name")


def serving_deployments() -> QuerySet[Deployment]:
    """Deployments that should be serving (pending ones are starting up), with their version and model."""
    return (
        Deployment.objects.filter(status__in=[Deployment.Status.PENDING, Deployment.Status.RUNNING])
        .select_related("version__model")
        .order_by("id")
    )


def ready_replicas(*, deployment_ids: list[int]) -> QuerySet[Replica]:
    return Replica.objects.filter(deployment_id__in=deployment_ids, state=Replica.State.READY).order_by("id")


def replica_states(*, replica_ids: list[int]) -> dict[int, str]:
    """The current state of each of these replicas; a deleted one is absent."""
    return dict(Replica.objects.filter(pk__in=replica_ids).values_list("id", "state"))


def replica_get(*, replica_id: int) -> Replica | None:
    return Replica.objects.filter(pk=replica_id).first()


def deployment_with_version(*, deployment_id: int) -> Deployment | None:
    return Deployment.objects.select_related("version__model").filter(pk=deployment_id).first()


def live_replica_pids(*, host: str) -> list[int]:
    """Engine pids recorded on ``host`` by replicas that are not stopped."""
    pids = Replica.objects.filter(host=host, pid__isnull=False).exclude(state=Replica.State.STOPPED)
    return [pid for pid in pids.values_list("pid", flat=True) if pid is not None]


def models_with_deployments(*, name: str | None = None) -> QuerySet[Model]:
    """Models (or the one named) with their versions, newest first, and each version's deployments."""
    versions = ModelVersion.objects.order_by("-created_at", "-id").prefetch_related(
        Prefetch("deployments", queryset=Deployment.objects.order_by("id"))
    )
    models = Model.objects.prefetch_related(Prefetch("versions", queryset=versions)).order_by("name")
    return models.filter(name=name) if name is not None else models


def deployments_with_replicas(*, model: str | None = None) -> QuerySet[Deployment]:
    """Deployments, newest first, with their version, model and replicas (of one model if named)."""
    deployments = (
        Deployment.objects.select_related("version__model")
        .prefetch_related(Prefetch("replica_set", queryset=Replica.objects.order_by("id")))
        .order_by("-created_at", "-id")
    )
    return deployments.filter(version__model__name=model) if model is not None else deployments


def audit_entries(
    *, action: str | None = None, actor: str | None = None, target: str | None = None, q: str | None = None
) -> QuerySet[AuditEntry]:
    """Audit entries, newest first. ``actor`` is a username; ``q`` searches target, action and actor."""
    entries = AuditEntry.objects.order_by("-created_at", "-id")
    if action:
        entries = entries.filter(action=action)
    if actor:
        entries = entries.filter(actor_name=actor)
    if target:
        entries = entries.filter(target=target)
    if q:
        entries = entries.filter(Q(target__icontains=q) | Q(action__icontains=q) | Q(actor_name__icontains=q))
    return entries


def model_traffic_split(*, model: Model) -> dict[str, int]:
    """Each serving version of ``model`` and its traffic percentage (its deployments' weights added)."""
    split: dict[str, int] = {}
    for version, weight in (
        serving_deployments().filter(version__model=model).values_list("version__version", "traffic_weight")
    ):
        split[version] = split.get(version, 0) + weight
    return split


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
