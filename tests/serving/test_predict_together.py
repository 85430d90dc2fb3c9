"""Predictions that travel together (serving.gateway.engine.Together): the ones waiting for the same
replica go to the worker in one call, and each gets exactly the answer it would get alone;
a worker without the path, or a call that fails, costs no prediction its own outcome."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import uvicorn

from registry.replica_keys import replica_api_key
from registry.small_models import build_digits
from serving.gateway import engine
from serving.gateway.engine import RawBody
from serving.gateway.errors import EngineFailed
from serving.gateway.inference_protocol import HEADER_LENGTH, MANY_PATH, decode_outputs, encode_request, read_body
from serving.gateway.routing import ReplicaRoute, Router
from serving.predict.worker import KEY_ENV, Worker

REPLICA_ID = 424242


@pytest.fixture(scope="module")
def digits_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("digits")
    return folder, build_digits(folder)


class Served:
    """A worker behind a real socket, counting the calls it gets by path; ``refuse`` answers
    a path with that status instead (a worker that lacks it, or fails it)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.calls: Counter[str] = Counter()
        self.refuse: dict[str, int] = {}
        self.cut = False  # answer the first part of a call, then drop the connection

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.calls[scope["path"]] += 1
            status = self.refuse.get(scope["path"])
            if status is not None:
                await send({"type": "http.response.start", "status": status, "headers": []})
                await send({"type": "http.response.body", "body": b"{}"})
                return
            if self.cut and scope["path"] == MANY_PATH:
                await self.worker(scope, receive, _first_frame_only(send))
                return
        await self.worker(scope, receive, send)


def _first_frame_only(send: Any) -> Any:
    async def cut(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            body = message["body"]
            size = int.from_bytes(body[:4], "big")
            length = orjson.loads(body[4 : 4 + size])[3]
            await send({**message, "body": body[: 4 + size + length]})
            raise RuntimeError("the worker died mid-answer")
        await send(message)

    return cut


@pytest.fixture
async def served(digits_artifact, monkeypatch, settings) -> AsyncIterator[tuple[Served, ReplicaRoute]]:
    folder, config = digits_artifact
    monkeypatch.setenv(KEY_ENV, replica_api_key(REPLICA_ID))
    config = {**config, "batcher": {"max_batch_size": 64, "max_queue_delay_us": 0}}
    worker = Worker(name="digits-mlp", version="1", artifact=folder, config=config, threads=1)
    worker.batcher.start()
    worker.ready = True
    app = Served(worker)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False))
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 (uvicorn says it only with this flag)
        await asyncio.sleep(0.01)
    try:
        yield app, ReplicaRoute(id=REPLICA_ID, endpoint=f"http://127.0.0.1:{port}", heartbeat_at=0.0)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await worker.batcher.stop()
        await engine.engine_session().close()


def _request(worker: Worker, pixels: np.ndarray[Any, Any]) -> RawBody:
    body, length = encode_request({"pixels": pixels}, worker.signature)
    return RawBody(body, {"content-type": "application/octet-stream", HEADER_LENGTH: str(length)})


async def _predict_all(replica: ReplicaRoute, worker: Worker, inputs: list[np.ndarray[Any, Any]]) -> list[Any]:
    router = Router()

    async def one(pixels: np.ndarray[Any, Any]) -> Any:
        lease, answer = await engine.dispatch(
            router, [replica], "/v2/models/digits-mlp/infer", _request(worker, pixels), stream=False, together=True
        )
        lease.release()
        return decode_outputs(worker.signature, read_body(answer.content, answer.inference_header))

    return await asyncio.gather(*(one(pixels) for pixels in inputs), return_exceptions=True)


def _inputs(n: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(3)
    return [rng.uniform(0, 16, size=(1 + i % 3, 64)).astype(np.float32) for i in range(n)]


async def test_concurrent_predictions_share_calls_and_keep_their_own_answers(served):
    app, replica = served
    inputs = _inputs(48)
    answers = await _predict_all(replica, app.worker, inputs)
    want = [app.worker.runner.run_batch([{"pixels": pixels}])[0] for pixels in inputs]
    for got, expected in zip(answers, want, strict=True):
        assert not isinstance(got, BaseException), got
        np.testing.assert_array_equal(got["label"], expected["label"])
        np.testing.assert_allclose(got["probabilities"], expected["probabilities"], rtol=1e-5)
    assert app.calls[MANY_PATH] >= 1  # the ones that waited went together
    assert sum(app.calls.values()) < len(inputs)


async def test_a_worker_without_the_path_gets_each_prediction_alone(served):
    app, replica = served
    app.refuse[MANY_PATH] = 404
    answers = await _predict_all(replica, app.worker, _inputs(24))
    assert all(not isinstance(a, BaseException) for a in answers), answers
    assert app.calls["/v2/models/digits-mlp/infer"] >= 24 - engine.Together.IN_FLIGHT
    assert not engine._together_for(replica).many  # it is not asked again


async def test_a_failed_call_fails_each_of_its_predictions(served):
    app, replica = served
    app.refuse[MANY_PATH] = 500
    answers = await _predict_all(replica, app.worker, _inputs(24))
    failed = [a for a in answers if isinstance(a, BaseException)]
    assert failed, "some predictions waited and went together"
    assert all(isinstance(a, EngineFailed) for a in failed), failed
    assert len(failed) + app.calls["/v2/models/digits-mlp/infer"] == 24  # the first ones went alone


async def test_a_call_cut_short_keeps_the_answers_given_and_fails_the_rest(served):
    app, replica = served
    app.cut = True
    answers = await _predict_all(replica, app.worker, _inputs(24))
    failed = [a for a in answers if isinstance(a, BaseException)]
    alone = app.calls["/v2/models/digits-mlp/infer"]
    # Those that went alone, and in each call cut short the one it answered before the cut.
    assert len(answers) - len(failed) == alone + app.calls[MANY_PATH]
    assert failed
    assert all(isinstance(a, EngineFailed) for a in failed), failed


async def test_idle_replicas_are_forgotten(monkeypatch):
    """Replicas come and go: the gateway does not keep a line for each one it ever sent to."""
    monkeypatch.setattr(engine, "TOGETHER_KEPT", 2)
    made = [engine._together_for(ReplicaRoute(id=i, endpoint=f"http://r{i}", heartbeat_at=0.0)) for i in range(5)]
    assert len(engine._together_by_loop.get()) <= 2
    assert engine._together_for(ReplicaRoute(id=4, endpoint="http://r4", heartbeat_at=0.0)) is made[4]
