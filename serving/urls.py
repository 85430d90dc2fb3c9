"""Data-plane routes: OpenAI's paths, and the seed design's /api/v1 aliases."""

from __future__ import annotations

from django.urls import path

from serving import api, usage_api

app_name = "dataplane"

urlpatterns = [
    path("v1/models", api.models_list, name="models"),
    path("v1/models/<str:model>", api.model_detail, name="model"),
    path("v1/chat/completions", api.chat_completions, name="chat-completions"),
    path("v1/completions", api.completions, name="completions"),
    path("v1/embeddings", api.embeddings, name="embeddings"),
    path("v1/usage", usage_api.usage, name="usage"),
    path("api/v1/chat/completions", api.chat_completions, name="api-chat-completions"),
    path("api/v1/completions", api.completions, name="api-completions"),
    path("api/v1/embeddings", api.embeddings, name="api-embeddings"),
    path("api/v1/usage", usage_api.usage, name="api-usage"),
]

# Paths served by serving.middleware.DataPlaneMiddleware (and answered in OpenAI's error shape).
DATA_PLANE_PREFIXES = ("/v1/", "/api/v1/chat/", "/api/v1/completions", "/api/v1/embeddings", "/api/v1/usage")
