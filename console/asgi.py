"""ASGI entry point: HTTP (console, REST, SSE) and WebSocket through Channels."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

from channels.routing import ProtocolTypeRouter, URLRouter
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

django_asgi = get_asgi_application()

from console.routing import websocket_urlpatterns  # noqa: E402
from serving.gateway.asgi import DataPlaneRouter  # noqa: E402

application = ProtocolTypeRouter(
    {
        # The API (/v1/...) takes the data plane's lean path (serving/gateway/asgi.py); static
        # files are served under STATIC_URL; the rest is Django as usual.
        "http": DataPlaneRouter(ASGIStaticFilesHandler(django_asgi)),
        "websocket": URLRouter(websocket_urlpatterns),
    }
)

# Everything loaded so far lives as long as the process: move it out of the collector's
# way, so a full collection under load walks only what requests allocate (the p99 spikes
# of issue 12 were partly these; docs/performance.md).
gc.collect()
gc.freeze()
