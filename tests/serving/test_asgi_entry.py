"""The data plane's ASGI entry (``serving.gateway.asgi.serve``) called in-process: how many tasks
a request costs, and how a client going away and a server stopping end a request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from billing.outcomes import CLIENT_CLOSED
from serving.gateway import asgi


def scope(path: str = "/v1/nowhere") -> dict[str, Any]:
    return {
        "type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [], "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000), "scheme": "http",
        "http_version": "1.1", "root_path": "",
    }  # fmt: skip


class Client:
    """The server's side of one connection: what was sent, and a disconnect to deliver."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


@contextlib.contextmanager
def counting_tasks() -> Iterator[list[asyncio.Task[Any]]]:
    """Every task the running loop creates inside the block."""
    loop = asyncio.get_running_loop()
    made: list[asyncio.Task[Any]] = []
    previous = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        made.append(task)
        return task

    loop.set_task_factory(factory)
    try:
        yield made
    finally:
        loop.set_task_factory(previous)


def hanging_view(closed: list[int]) -> Any:
    """A ``handle`` whose view registers a closer, then waits for ever (an engine that never answers)."""

    async def handle(request: Any, route: Any) -> Any:
        async def closer(ending: int) -> None:
            closed.append(ending)

        request.closers.append(closer)
        await asyncio.Event().wait()

    return handle


async def test_a_request_costs_one_task_besides_the_servers_own():
    client = Client()
    with counting_tasks() as counted_tasks:
        await asgi.serve(scope(), client.receive, client.send)
    assert client.sent[0]["status"] == 404
    assert len(counted_tasks) == 1, counted_tasks  # the disconnect watcher; the answer runs in this task


async def test_a_client_gone_mid_answer_ends_it_settled_499(monkeypatch):
    closed: list[int] = []
    monkeypatch.setattr(asgi, "handle", hanging_view(closed))
    client = Client()
    serving = asyncio.ensure_future(asgi.serve(scope(), client.receive, client.send))
    await asyncio.sleep(0.05)
    client.gone.set()
    await asyncio.wait_for(serving, 5)  # returns: the watcher's cancel was taken back
    assert closed == [CLIENT_CLOSED]
    assert not serving.cancelled()
    assert serving.exception() is None
    assert serving.cancelling() == 0


async def test_a_server_stopping_cancels_it_and_the_cancel_goes_on(monkeypatch):
    closed: list[int] = []
    monkeypatch.setattr(asgi, "handle", hanging_view(closed))
    client = Client()
    serving = asyncio.ensure_future(asgi.serve(scope(), client.receive, client.send))
    await asyncio.sleep(0.05)
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving
    assert closed == [CLIENT_CLOSED]


async def test_a_client_gone_after_the_answer_changes_nothing(monkeypatch):
    client = Client()
    await asgi.serve(scope(), client.receive, client.send)
    client.gone.set()
    await asyncio.sleep(0.05)
    assert [m["type"] for m in client.sent] == ["http.response.start", "http.response.body"]
    this = asyncio.current_task()
    assert this is not None
    assert this.cancelling() == 0
