"""Database calls from async code that give their pooled connection back at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import connections

P = ParamSpec("P")
R = TypeVar("R")


async def run_db(fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """Run ``fn`` (a quick ORM call) in a worker thread and return its connection to the pool.

    Under ASGI, Django runs each request's thread-sensitive ``sync_to_async`` calls in a
    thread of that request, whose pooled connection is only released when the request
    ends: for a streamed completion, the whole stream. Sixteen streams would then hold
    sixteen connections and the next request would wait for one of them to finish.
    """

    def call() -> R:
        try:
            return fn(*args, **kwargs)
        finally:
            connections.close_all()  # this thread's connections only: back to the pool

    return await sync_to_async(call, thread_sensitive=False)()
