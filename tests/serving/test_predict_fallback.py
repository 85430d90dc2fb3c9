"""A prediction that falls back (serving.predict.call.PredictCall): the version that failed
never has another version's answer kept in the result cache under its own key (issue 34,
defect 6), so the next request routed to it is not answered, as a hit, by the base version.

In process: the routing table, the worker calls and the ledger are stand-ins; the result
cache is the test Redis."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest

from core import keys
from core.redis import async_redis
from registry.signatures import Signature
from serving.gateway import call as gateway_call
from serving.gateway import engine, routing
from serving.gateway.errors import EngineUnavailable
from serving.gateway.inference_protocol import HEADER_LENGTH, encode_response
from serving.gateway.routing import ModelRoute, ReplicaRoute, RoutingTable, VersionRoute
from serving.predict import call as predict_call
from serving.predict.call import HIT, MISS, PredictCall
from serving.predict.result_cache import result_key

SIGNATURE = Signature.from_json({
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
    "outputs": [{"name": "label", "datatype": "INT64", "shape": [-1]}],
})  # fmt: skip
BASE, CANDIDATE = 1, 2
LABELS = {BASE: 3, CANDIDATE: 7}  # what each version's worker answers


def version(vid: int, weight: int) -> VersionRoute:
    replica = ReplicaRoute(id=vid * 10, endpoint=f"http://v{vid}", heartbeat_at=time.time())
    return VersionRoute(
        id=vid, version=str(vid), deployment_id=vid, weight=weight, max_model_len=0, artifact_uri="local://x",
        replicas=(replica,), predict=True, signature=SIGNATURE,
    )  # fmt: skip


class Workers:
    """The versions' workers: each answers its own label; ``failing`` ones refuse the connection."""

    def __init__(self) -> None:
        self.failing: set[int] = set()
        self.calls: list[int] = []

    async def dispatch(self, router: Any, replicas: list[ReplicaRoute], path: str, payload: Any, **_: Any) -> Any:
        replica = replicas[0]
        vid = replica.id // 10
        self.calls.append(vid)
        if vid in self.failing:
            error = EngineUnavailable("The replica refused the connection.")
            error.replicas_tried = (replica.id,)
            raise error
        header = orjson.loads(payload.content[: int(payload.headers[HEADER_LENGTH])])
        rows = int(header["inputs"][0]["shape"][0])
        content, length = encode_response(
            SIGNATURE, {"label": np.full(rows, LABELS[vid], dtype=np.int64)}, {"label": True},
            model_name="fallback", model_version=str(vid),
        )  # fmt: skip
        lease = SimpleNamespace(replica=replica, release=lambda: None)
        return lease, SimpleNamespace(content=content, inference_header=str(length))


class FreeAdmission:
    """Admits everything and meters nothing (the ledger is not what this tests)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.maybe_admitted = False
        self.rate_limits = None
        self.deferred = None

    async def admit(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def in_flight_done(self) -> None:
        return None

    async def settle(self, event: Any) -> bool:
        return False


@pytest.fixture
def workers(monkeypatch, settings) -> Workers:
    settings.PREDICT_RESULT_CACHE_TTL_SECONDS = 60
    settings.ENGINE_FALLBACK = True
    # The candidate takes every unpinned request; the base (weight 0) is where it falls back.
    model = ModelRoute(name="fallback", task="classification", owner="o", created=0,
                       versions=(version(BASE, 0), version(CANDIDATE, 100)))  # fmt: skip
    table = RoutingTable(models={model.name: model}, loaded_at=time.monotonic())

    async def routing_table(*, fresh: bool = False) -> RoutingTable:
        return table

    async def noted(*args: Any, **kwargs: Any) -> None:
        return None

    found = Workers()
    monkeypatch.setattr(routing, "routing_table", routing_table)
    monkeypatch.setattr(engine, "dispatch", found.dispatch)
    monkeypatch.setattr(gateway_call, "Admission", FreeAdmission)
    monkeypatch.setattr(gateway_call.ledger, "note_failed_attempt", noted)
    return found


def grant(organization_id: int) -> Any:
    return SimpleNamespace(key_id=1, organization_id=organization_id, tier="free", may_use=lambda model: True,
                           cache_wrong_hit_budget=None)  # fmt: skip


async def predict(organization_id: int, inputs: np.ndarray[Any, Any]) -> PredictCall:
    call = PredictCall(grant(organization_id), uuid.uuid4())
    await call.prepare("fallback")
    call.take_arrays({"x": inputs}, len(inputs))
    await call.run()
    await asyncio.gather(*predict_call._writes._tasks)  # the answer's write to the cache, if any
    return call


async def test_a_fallback_keeps_no_answer_under_the_failed_versions_key(workers):
    organization_id = random.randrange(10**9, 2 * 10**9)  # a cache of its own
    inputs = np.array([[1.0, 2.0]], dtype=np.float32)
    candidate_key = keys.predict_result(organization_id, result_key(version_id=CANDIDATE, inputs={"x": inputs}))

    workers.failing.add(CANDIDATE)
    first = await predict(organization_id, inputs)
    assert first.version.version == str(BASE)  # the candidate failed; the base answered
    assert workers.calls == [CANDIDATE, BASE]
    assert await async_redis().get(candidate_key) is None

    workers.failing.clear()
    second = await predict(organization_id, inputs)
    assert (second.version.version, second.cache) == (str(CANDIDATE), MISS)
    assert workers.calls[-1] == CANDIDATE  # the candidate itself answered it
    third = await predict(organization_id, inputs)
    assert (third.version.version, third.cache) == (str(CANDIDATE), HIT)  # its own answer, kept now
