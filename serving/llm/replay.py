"""A cached answer replayed as an engine stream: the answer's text in small pieces, as events."""

from __future__ import annotations

import re
from typing import Any


class ReplayStream:
    """A cached answer standing in for an engine stream (no replica, nothing to close)."""

    replica = None
    ready = True  # every event is in memory

    def __init__(self, events: list[Any]) -> None:
        self._events = iter(events)

    def __aiter__(self) -> ReplayStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return next(self._events)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        return None


def text_pieces(text: str, size: int = 16) -> list[str]:
    """The text in pieces of about ``size`` characters, cut after whitespace, for replay."""
    pieces: list[str] = []
    current = ""
    for word in re.findall(r"\S+\s*|\s+", text):
        current += word
        if len(current) >= size:
            pieces.append(current)
            current = ""
    if current or not pieces:
        pieces.append(current)
    return pieces
