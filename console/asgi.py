"""ASGI entry point: HTTP (console, REST, SSE) and WebSocket through Channels."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

from channels.routing import ProtocolTypeRouter, URLRouter
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

django_asgi = get_asgi_application()

from console.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # Static files are served by Django's own handler only under STATIC_URL; every
        # other request goes straight to the app with no extra middleware.
        "http": ASGIStaticFilesHandler(django_asgi),
        "websocket": URLRouter(websocket_urlpatterns),
    }
)
