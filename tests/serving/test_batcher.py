"""The dynamic batcher (serving.predict.batcher): batches form under concurrency, flush on
delay, prefer the sizes a model runs best at, never queue past their bound, and a failing
batch fails only its own requests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from core.errors import InvalidInput
from serving.predict.batcher import (
    BatcherConfig,
    BatchTooLarge,
    DynamicBatcher,
    QueueFull,
    RequestTimedOut,
)


class Model:
    """Doubles every payload; records each batch; can be held (``gate``) or fail."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, payloads: list[int]) -> list[int]:
        self.gate.wait(10)
        self.batches.append(list(payloads))
        if -1 in payloads:
            raise ValueError("the model cannot take -1")
        return [p * 2 for p in payloads]


@pytest.fixture
def model() -> Iterator[Model]:
    made = Model()
    yield made
    made.gate.set()


async def started(model: Model, **config: object) -> DynamicBatcher:
    batcher = DynamicBatcher(model, BatcherConfig.from_json(config))
    batcher.start()
    return batcher


async def test_concurrent_requests_run_as_full_batches(model):
    batcher = await started(model, max_batch_size=8, max_queue_delay_us=200_000)
    try:
        results = await asyncio.gather(*(batcher.submit(i) for i in range(16)))
    finally:
        await batcher.stop()
    assert results == [i * 2 for i in range(16)]
    assert sorted(map(len, model.batches)) == [8, 8]
    assert batcher.stats.batch_sizes == {8: 2}
    assert batcher.stats.reasons == {"full": 2}


async def test_a_partial_batch_goes_when_the_oldest_has_waited_the_delay(model):
    batcher = await started(model, max_batch_size=8, max_queue_delay_us=30_000)
    try:
        began = time.monotonic()
        results = await asyncio.gather(*(batcher.submit(i) for i in range(3)))
        waited = time.monotonic() - began
    finally:
        await batcher.stop()
    assert results == [0, 2, 4]
    assert model.batches == [[0, 1, 2]]
    assert batcher.stats.reasons == {"delay": 1}
    assert waited >= 0.03


async def test_a_preferred_size_goes_at_once_and_shapes_what_the_delay_sends(model):
    batcher = await started(model, max_batch_size=16, preferred_batch_sizes=[4], max_queue_delay_us=500_000)
    try:
        await asyncio.gather(*(batcher.submit(i) for i in range(4)))
        assert batcher.stats.reasons == {"preferred": 1}  # it went at 4, not at the half-second delay
    finally:
        await batcher.stop()
    model.batches.clear()
    batcher = await started(model, max_batch_size=16, preferred_batch_sizes=[4], max_queue_delay_us=20_000)
    try:
        await asyncio.gather(*(batcher.submit(i) for i in range(6)))
    finally:
        await batcher.stop()
    assert [len(b) for b in model.batches] == [4, 2]  # at the delay: the preferred 4 first, then the rest


async def test_the_queue_is_bounded_in_rows(model):
    batcher = await started(model, max_batch_size=4, max_queue_size=4, max_queue_delay_us=0)
    model.gate.clear()  # the model is busy: the first batch holds the only runner
    try:
        first = asyncio.ensure_future(batcher.submit(1, rows=4))
        await asyncio.sleep(0.05)  # taken by the runner: the queue is empty again
        waiting = asyncio.ensure_future(batcher.submit(2, rows=3))
        await asyncio.sleep(0.01)
        assert batcher.queue_rows == 3
        with pytest.raises(QueueFull, match="4 rows waiting"):
            await batcher.submit(3, rows=2)
        assert batcher.stats.refused == 1
        model.gate.set()
        assert await first == 2
        assert await waiting == 4
    finally:
        model.gate.set()
        await batcher.stop()


async def test_a_request_still_queued_at_its_deadline_never_runs(model):
    batcher = await started(model, max_batch_size=1, max_queue_delay_us=0, timeout_s=0.05)
    model.gate.clear()
    try:
        held = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.01)
        began = time.monotonic()
        with pytest.raises(RequestTimedOut):
            await batcher.submit(2)  # the only runner is busy the whole time
        assert time.monotonic() - began < 5  # refused at its deadline, not when the runner came free
        model.gate.set()
        assert await held == 2  # its batch was on the model at its deadline: it gets its answer
        await asyncio.sleep(0.05)
        assert [1] in model.batches
        assert [2] not in model.batches
        assert batcher.stats.timed_out == 1
    finally:
        model.gate.set()
        await batcher.stop()


async def test_a_failing_batch_fails_only_its_requests(model):
    batcher = await started(model, max_batch_size=2, max_queue_delay_us=10_000)
    try:
        outcomes = await asyncio.gather(
            batcher.submit(-1), batcher.submit(5), batcher.submit(6), batcher.submit(7), return_exceptions=True
        )
    finally:
        await batcher.stop()
    assert isinstance(outcomes[0], ValueError)
    assert isinstance(outcomes[1], ValueError)  # in the same batch as -1
    assert list(outcomes[2:]) == [12, 14]


async def test_a_request_larger_than_a_batch_is_refused(model):
    batcher = await started(model, max_batch_size=4)
    try:
        with pytest.raises(BatchTooLarge, match="at most 4"):
            await batcher.submit(1, rows=5)
    finally:
        await batcher.stop()
    assert model.batches == []


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"max_batch_sise": 8}, "batcher.max_batch_sise"),
        ({"max_batch_size": 0}, "batcher.max_batch_size"),
        ({"max_batch_size": True}, "batcher.max_batch_size"),
        ({"max_batch_size": 8, "preferred_batch_sizes": [16]}, "batcher.preferred_batch_sizes"),
        ({"preferred_batch_sizes": "4"}, "batcher.preferred_batch_sizes"),
        ({"max_batch_size": 64, "max_queue_size": 8}, "batcher.max_queue_size"),
        ({"timeout_s": 0}, "batcher.timeout_s"),
        ({"max_queue_delay_us": -1}, "batcher.max_queue_delay_us"),
        ({"instances": 65}, "batcher.instances"),
        ([], "batcher"),
    ],
)
def test_a_bad_config_names_its_key(config, field):
    with pytest.raises(InvalidInput) as refused:
        BatcherConfig.from_json(config)
    assert refused.value.field == field


def test_the_config_round_trips():
    config = BatcherConfig.from_json({"max_batch_size": 16, "preferred_batch_sizes": [8, 4], "instances": 2})
    assert config.preferred_batch_sizes == (4, 8)
    assert BatcherConfig.from_json(config.as_json()) == config
