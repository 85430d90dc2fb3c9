"""Data-plane routes: OpenAI's paths, and the seed design's /api/v1 aliases."""

from __future__ import annotations

from django.urls import path

from serving import key_usage_views, openai_views

app_name = "dataplane"

urlpatterns = [
    path("v1/models", openai_views.models_list, name="models"),
    path("v1/models/<str:model>", openai_views.model_detail, name="model"),
    path("v1/chat/completions", openai_views.chat_completions, name="chat-completions"),
    path("v1/completions", openai_views.completions, name="completions"),
    path("v1/embeddings", openai_views.embeddings, name="embeddings"),
    path("v1/usage", key_usage_views.usage, name="usage"),
    path("api/v1/chat/completions", openai_views.chat_completions, name="api-chat-completions"),
    path("api/v1/completions", openai_views.completions, name="api-completions"),
    path("api/v1/embeddings", openai_views.embeddings, name="api-embeddings"),
    path("api/v1/usage", key_usage_views.usage, name="api-usage"),
]

# Paths the data plane's ASGI entry serves itself (serving.asgi, answered in OpenAI's error shape).
DATA_PLANE_PREFIXES = ("/v1/", "/api/v1/chat/", "/api/v1/completions", "/api/v1/embeddings", "/api/v1/usage")
