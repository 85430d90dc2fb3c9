"""The registry's management API routes, under /api/v1/ (no trailing slash, as the data plane's)."""

from __future__ import annotations

from django.urls import path

from registry import api

app_name = "registry"

urlpatterns = [
    path("models", api.model_collection, name="models"),
    path("models/<str:name>", api.model_detail, name="model"),
    path("deployments", api.deployment_collection, name="deployments"),
    path("deployments/<int:pk>/replicas", api.deployment_replicas, name="deployment-replicas"),
    path("deployments/<int:pk>/adapters", api.deployment_adapters, name="deployment-adapters"),
    path("deployments/<str:model>/traffic", api.traffic_split, name="traffic"),
    path("replicas/<int:pk>/restart", api.replica_restart, name="replica-restart"),
    path("audit", api.AuditEntryList.as_view(), name="audit"),
]
