"""WebSocket routes."""

from __future__ import annotations

from django.urls import URLPattern, URLResolver, path

from serving.consumers import ChatCompletionsConsumer

websocket_urlpatterns: list[URLPattern | URLResolver] = [
    path("ws/v1/chat/completions", ChatCompletionsConsumer.as_asgi()),
]
