"""core.lifecycle: the one place async helpers get their lifetimes."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from core.lifecycle import Background, OncePerProcess, PerLoop, Worker, unobserved


def test_one_object_per_event_loop_and_a_new_one_when_unusable():
    made: list[dict[str, bool]] = []

    def make() -> dict[str, bool]:
        made.append({"open": True})
        return made[-1]

    per_loop = PerLoop(make, usable=lambda value: value["open"])

    async def get_twice() -> tuple[dict[str, bool], dict[str, bool]]:
        return per_loop.get(), per_loop.get()

    first, again = asyncio.run(get_twice())
    assert first is again
    other, _ = asyncio.run(get_twice())  # another loop: another object
    assert other is not first
    other["open"] = False

    async def get() -> dict[str, bool]:
        return per_loop.get()

    assert asyncio.run(get()) is not other
    assert len(made) == 3


async def test_a_worker_runs_once_at_a_time_and_again_when_it_ended():
    runs = 0
    release = asyncio.Event()

    async def run() -> None:
        nonlocal runs
        runs += 1
        await release.wait()

    worker = Worker(run, name="test-worker")
    worker.ensure()
    worker.ensure()
    await asyncio.sleep(0)
    assert runs == 1
    release.set()
    assert worker.task is not None
    await worker.task
    worker.ensure()
    await asyncio.sleep(0)
    assert runs == 2
    await worker.task


async def test_background_tasks_are_kept_until_done_and_their_failures_logged(caplog):
    background = Background()

    async def fail() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("boom")

    with caplog.at_level(logging.WARNING, logger="core.lifecycle"):
        task = background.spawn(fail(), what="do the test's work")
        assert len(background) == 1
        await task
    assert len(background) == 0
    assert "could not do the test's work" in caplog.text


async def test_an_unobserved_future_still_fails_for_whoever_awaits_it():
    future = unobserved(asyncio.get_running_loop().create_future())
    future.set_exception(ValueError("late"))
    with pytest.raises(ValueError, match="late"):
        await future


def test_once_per_process_starts_once_however_many_threads_ask():
    started: list[int] = []
    once = OncePerProcess(lambda: started.append(1))
    threads = [threading.Thread(target=once.ensure) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert started == [1]
