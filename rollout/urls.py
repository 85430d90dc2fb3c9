"""Rollout's management API routes, under /api/v1/ beside the registry's."""

from __future__ import annotations

from django.urls import path

from rollout import api

app_name = "rollout"

urlpatterns = [
    path("models/<str:name>/canary", api.canary_collection, name="canary"),
    path("models/<str:name>/canary/<str:action>", api.canary_action, name="canary-action"),
    path("models/<str:name>/rollback", api.model_rollback_view, name="model-rollback"),
    path("deployments/<int:pk>/swap", api.deployment_swap, name="deployment-swap"),
    path("deployments/<int:pk>/autoscale", api.deployment_autoscale, name="deployment-autoscale"),
]
