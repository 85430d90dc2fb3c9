"""The dynamic batcher: requests that arrive close together run as one batch.

A small model (a classifier, an image or tabular model) costs nearly the same to run on 1
row as on 16: what a CPU or GPU is worth comes from batching. Requests wait in one bounded
queue; each of ``instances`` runners takes the oldest requests as one batch as soon as

- they fill ``max_batch_size`` rows (a request of n items takes n rows), or
- they reach one of ``preferred_batch_sizes`` (a size the model runs best at), or
- the oldest has waited ``max_queue_delay_us``: then the largest preferred size that the
  queue can fill goes (all that fit, when none can),

and runs it in a thread of its own (``run_batch`` is the model: a blocking call, e.g. ONNX
Runtime's, which releases the GIL). The queue never grows past ``max_queue_size`` rows: a
request beyond it is refused at once (``QueueFull``, a 429), and a request still waiting at
its deadline (``timeout_s``) is failed (``RequestTimedOut``) and never runs; one whose
batch is on the model by then gets its answer.

Configured per model version (``registry.batching.BatcherConfig``, the version's ``config["batcher"]``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from registry.batching import BatcherConfig

__all__ = ["BatchTooLarge", "BatcherConfig", "DynamicBatcher", "QueueFull", "RequestTimedOut"]


class QueueFull(Exception):
    """The queue holds ``max_queue_size`` rows already: refused at once (429), never queued."""


class RequestTimedOut(Exception):
    """The request waited past its deadline: it was not run."""


class BatchTooLarge(ValueError):
    """One request has more rows than ``max_batch_size``: it could never be batched (400)."""


@dataclass
class _Pending:
    payload: Any
    rows: int
    enqueued: float
    deadline: float
    future: asyncio.Future[Any]
    running: bool = False


@dataclass
class BatcherStats:
    """What the batcher did: batch sizes formed (rows: count) and why each went."""

    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    refused: int = 0
    timed_out: int = 0


class DynamicBatcher:
    """``await submit(payload, rows)`` → that payload's result, run in a batch with others.

    ``run_batch(payloads)`` runs one batch and returns one result per payload, in order
    (an exception fails that batch's requests, and only them). Start with ``start()`` on
    the loop that submits; ``stop()`` fails whatever still waits.
    """

    def __init__(self, run_batch: Callable[[list[Any]], Sequence[Any]], config: BatcherConfig) -> None:
        self.config = config
        self.stats = BatcherStats()
        self._run_batch = run_batch
        self._queue: collections.deque[_Pending] = collections.deque()
        self._queued_rows = 0
        self._changed: asyncio.Condition | None = None
        self._runners: list[asyncio.Task[None]] = []
        self._pool = ThreadPoolExecutor(max_workers=config.instances, thread_name_prefix="batch")

    @property
    def queue_rows(self) -> int:
        return self._queued_rows

    def start(self) -> None:
        self._changed = asyncio.Condition()
        loop = asyncio.get_running_loop()
        self._runners = [loop.create_task(self._run(), name=f"batcher-{i}") for i in range(self.config.instances)]

    async def stop(self) -> None:
        for runner in self._runners:
            runner.cancel()
        for runner in self._runners:
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        while self._queue:
            self._take_first().future.set_exception(RequestTimedOut("The model is stopping."))
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def submit(self, payload: Any, rows: int = 1) -> Any:
        if rows > self.config.max_batch_size:
            raise BatchTooLarge(f"{rows} rows in one request; this model takes at most {self.config.max_batch_size}.")
        if self._queued_rows + rows > self.config.max_queue_size:
            self.stats.refused += 1
            raise QueueFull(f"The model's queue is full ({self.config.max_queue_size} rows waiting). Retry shortly.")
        assert self._changed is not None, "start() the batcher first"
        now = time.monotonic()
        pending = _Pending(payload, rows, now, now + self.config.timeout_s, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        self._queued_rows += rows
        async with self._changed:
            self._changed.notify_all()
        try:
            return await asyncio.wait_for(asyncio.shield(pending.future), self.config.timeout_s)
        except TimeoutError:
            if pending.running:  # its batch is on the model: the answer is near, take it
                return await pending.future
            self.stats.timed_out += 1
            pending.future.cancel()  # still queued: it never runs (the runners skip it)
            raise RequestTimedOut("The request waited too long for the model.") from None
        except asyncio.CancelledError:
            pending.future.cancel()  # the caller went away: never run it
            raise

    # --- forming batches ------------------------------------------------------------------

    def _take_first(self) -> _Pending:
        pending = self._queue.popleft()
        self._queued_rows -= pending.rows
        return pending

    def _drop_expired(self, now: float) -> None:
        kept: collections.deque[_Pending] = collections.deque()
        while self._queue:
            pending = self._take_first()
            if pending.future.done() or pending.deadline <= now:  # given up (its submit says why)
                continue
            kept.append(pending)
        for pending in kept:
            self._queue.append(pending)
            self._queued_rows += pending.rows

    def _fits(self) -> int:
        """Rows of the oldest requests that fit in one batch (whole requests, in order)."""
        total = 0
        for pending in self._queue:
            if total + pending.rows > self.config.max_batch_size:
                break
            total += pending.rows
        return total

    def _ready(self, now: float) -> str | None:
        """Why a batch should go now (None: wait)."""
        if not self._queue:
            return None
        rows = self._fits()
        if rows >= self.config.max_batch_size or rows < self._queued_rows:
            return "full"
        if rows in self.config.preferred_batch_sizes:
            return "preferred"
        if now - self._queue[0].enqueued >= self.config.max_queue_delay_us / 1e6:
            return "delay"
        return None

    def _form(self, reason: str) -> list[_Pending]:
        """Take the batch: at the delay, the largest preferred size the queue can fill."""
        limit = self.config.max_batch_size
        if reason == "delay" and self.config.preferred_batch_sizes:
            fits = self._fits()
            reachable = [size for size in self.config.preferred_batch_sizes if size <= fits]
            if reachable:
                limit = reachable[-1]
        batch: list[_Pending] = []
        rows = 0
        while self._queue and rows + self._queue[0].rows <= limit:
            pending = self._take_first()
            pending.running = True
            batch.append(pending)
            rows += pending.rows
        return batch

    async def _next_batch(self) -> tuple[list[_Pending], str]:
        assert self._changed is not None
        async with self._changed:
            while True:
                now = time.monotonic()
                self._drop_expired(now)
                reason = self._ready(now)
                if reason is not None:
                    return self._form(reason), reason
                if self._queue:
                    wait = self._queue[0].enqueued + self.config.max_queue_delay_us / 1e6 - now
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), timeout=max(wait, 0))
                else:
                    await self._changed.wait()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch, reason = await self._next_batch()
            if not batch:
                continue
            self.stats.batch_sizes[sum(p.rows for p in batch)] += 1
            self.stats.reasons[reason] += 1
            payloads = [p.payload for p in batch]
            try:
                results = await loop.run_in_executor(self._pool, self._run_batch, payloads)
                if len(results) != len(batch):
                    raise RuntimeError(f"the model answered {len(results)} results for {len(batch)} requests")
            except Exception as exc:  # noqa: BLE001 - the model's failure fails its batch; the batcher goes on
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(exc)
                continue
            for pending, result in zip(batch, results, strict=True):
                if not pending.future.done():
                    pending.future.set_result(result)
