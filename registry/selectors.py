"""Reads from the registry."""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet

from registry.models import Deployment, Model, ModelVersion, Replica


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
