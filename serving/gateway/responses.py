"""Response types of the data plane."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from django.http import StreamingHttpResponse


class EventStreamResponse(StreamingHttpResponse):
    """A server-sent event stream; ``serving.gateway.asgi`` iterates ``events`` itself and closes it."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, content_type="text/event-stream")
        self.events = events
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"  # proxies must not buffer the stream
