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
