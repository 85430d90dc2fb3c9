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


# The semantic cache's filtered nearest-neighbour search needs pgvector 0.8's iterative index
# scans (serving/semcache/store.py); an external PostgreSQL may have an older one.
PGVECTOR_MIN = (0, 8)


def pgvector_problem(version: str | None) -> str | None:
    """Why the installed pgvector (``pg_extension.extversion``, or None when it is not
    installed) cannot serve the platform, or None when it can."""
    if version is None:
        return "the pgvector extension (vector) is not installed in this database"
    parts = version.split(".")
    try:
        found = tuple(int(part) for part in parts[:2])
    except ValueError:
        return f"pgvector's version {version!r} cannot be read"
    if found < PGVECTOR_MIN:
        need = ".".join(str(n) for n in PGVECTOR_MIN)
        return (
            f"pgvector {version} is installed; the platform needs {need} or newer: install it on the "
            "database server, then run ALTER EXTENSION vector UPDATE"
        )
    return None
