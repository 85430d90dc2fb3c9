"""Reads from the registry."""

from __future__ import annotations

from django.db.models import Prefetch, QuerySet

from registry.models import Model, ModelVersion


def model_list_with_versions() -> QuerySet[Model]:
    return Model.objects.prefetch_related(
        Prefetch("versions", queryset=ModelVersion.objects.order_by("-created_at"))
    ).order_by("name")
