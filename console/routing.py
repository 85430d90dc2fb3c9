"""WebSocket routes."""

from __future__ import annotations

from channels.auth import AuthMiddlewareStack
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import URLPattern, URLResolver, path

from console.consumers import LiveOverviewConsumer
from serving.llm.consumers import ChatCompletionsConsumer

websocket_urlpatterns: list[URLPattern | URLResolver] = [
    path("ws/v1/chat/completions", ChatCompletionsConsumer.as_asgi()),
    # The console's live overview: the browser's session cookie, from one of our own origins only.
    path("ws/console/live", AllowedHostsOriginValidator(AuthMiddlewareStack(LiveOverviewConsumer.as_asgi()))),
]
