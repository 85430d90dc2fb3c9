"""How long what async code keeps lives: one object per event loop, a worker task kept
running on the current loop, fire-and-forget tasks held until they end, and a thread
started once per process.

asyncio holds only weak references to tasks (one nobody keeps may vanish mid-way), a client
made on one event loop cannot be used on another (tests and the console's threads run
several), and a future nobody awaits warns when it fails. Every long-lived helper in the
project goes through these, so each of those rules is kept in one place.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
F = TypeVar("F", bound=asyncio.Future[Any])


class PerLoop(Generic[T]):
    """One ``make()`` per running event loop, made on first use (and again when ``usable``
    says the kept one is not, e.g. a closed session); forgotten with its loop."""

    def __init__(self, make: Callable[[], T], *, usable: Callable[[T], bool] | None = None) -> None:
        self._make = make
        self._usable = usable
        self._values: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = weakref.WeakKeyDictionary()

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        value = self._values.get(loop)
        if value is None or (self._usable is not None and not self._usable(value)):
            value = self._values[loop] = self._make()
        return value

    def clear(self) -> None:
        """Forget every loop's object (settings changed: the next ``get`` makes a new one)."""
        self._values.clear()


class Worker:
    """A background coroutine, at most one running at a time: ``ensure()`` starts it on the
    running loop unless it runs there already. A worker that ends (its work done, or a
    loop that ran forever and failed) is started again by the next ``ensure()``."""

    def __init__(self, run: Callable[[], Coroutine[Any, Any, None]], *, name: str) -> None:
        self._run = run
        self._name = name
        self.task: asyncio.Task[None] | None = None

    def ensure(self) -> None:
        loop = asyncio.get_running_loop()
        task = self.task
        if task is None or task.done() or task.get_loop() is not loop:
            self.task = loop.create_task(self._run(), name=self._name)


class Background:
    """Fire-and-forget tasks, each referenced until it ends and its failure logged (as
    ``could not <what>``), never lost or warned about at exit."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, work: Awaitable[Any], *, what: str) -> asyncio.Task[None]:
        async def run() -> None:
            try:
                await work
            except Exception:
                logger.warning("could not %s", what, exc_info=True)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def fail_all(futures: Iterable[asyncio.Future[Any]], exc: BaseException) -> None:
    """Give each waiting future ``exc`` (a copy each: every waiter raises its own), or cancel
    it when ``exc`` is a cancellation; futures already done are left as they are."""
    for future in futures:
        if future.done():
            continue
        if isinstance(exc, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(copy.copy(exc))


def unobserved(future: F) -> F:
    """Mark a future whose failure nobody may await (a refresh ahead, a shared load): its
    exception is retrieved, so asyncio does not warn; those who await it still get it."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


class OncePerProcess:
    """``start()`` run once in this process, however many threads ask at once."""

    def __init__(self, start: Callable[[], None]) -> None:
        self._start = start
        self._lock = threading.Lock()
        self.started = False

    def ensure(self) -> None:
        if self.started:
            return
        with self._lock:
            if not self.started:
                self._start()
                self.started = True


class LazyThreadPool:
    """A pool of threads made on first use (a process that never needs it starts none), sized
    by ``size()`` then: for CPU work kept off an event loop (counting a large prompt, reading a
    large tensor)."""

    def __init__(self, name: str, size: Callable[[], int]) -> None:
        self._name = name
        self._size = size
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=self._size(), thread_name_prefix=self._name)
        return self._pool


# --- A process asked to stop while a balancer still sends it requests -----------------------

_draining = threading.Event()


def start_draining() -> None:
    """This process was asked to stop and drains (console.gateway, GATEWAY_DRAIN_SECONDS):
    /readyz fails, so the balancer takes it out, and WebSockets close once idle."""
    _draining.set()


def draining() -> bool:
    return _draining.is_set()
