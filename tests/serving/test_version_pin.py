"""X-Model-Version: pinning a request to a version of its model, and saying which version served it."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from serving.gateway import model_access
from serving.gateway.errors import EngineUnavailable, InvalidRequest, ModelNotFound
from serving.gateway.routing import ModelRoute, ReplicaRoute, VersionRoute
from serving.llm import call as orchestrator
from serving.llm.call import CHAT, InferenceCall
from serving.llm.tokens import PromptCount
from serving.semcache.policy import scope_of
from tests.support.gateway import committed, register_fake_replica, start_fake_engine
from tests.support.processes import Gateway, start_gateway

HELLO = [{"role": "user", "content": "hello"}]


# --- in process: what prepare routes to, and where the cache looks ----------------------


def version_route(vid: int, weight: int, *, replicas: int = 1) -> VersionRoute:
    return VersionRoute(
        id=vid, version=str(vid), deployment_id=vid, weight=weight, max_model_len=1024, artifact_uri="local://x",
        replicas=tuple(ReplicaRoute(id=vid * 10 + i, endpoint="http://x", heartbeat_at=time.time())
                       for i in range(replicas)),
    )  # fmt: skip


class ExactCounter:
    exact = True
    max_token_chars = None  # no cheap bound: every prompt is counted

    def count_chat(self, messages: Any, **kwargs: Any) -> PromptCount:
        return PromptCount(5, True)


@pytest.fixture
def routed_model(monkeypatch) -> ModelRoute:
    """A model whose version 1 takes all the weighted traffic, 2 has weight 0, 3 no live replica."""
    route = ModelRoute(
        name="pinned", task="chat", owner="o", created=0,
        versions=(version_route(1, 100), version_route(2, 0), version_route(3, 100, replicas=0)),
    )  # fmt: skip

    async def find_model(name: str) -> ModelRoute:
        return route

    async def counter(version: VersionRoute) -> ExactCounter:
        return ExactCounter()

    monkeypatch.setattr(model_access, "find_model", find_model)
    monkeypatch.setattr(orchestrator, "counter_of", counter)
    return route


def grant(*, allowed: frozenset[str] = frozenset()) -> Any:
    return SimpleNamespace(
        key_id=1,
        organization_id=7,
        tier="free",
        may_use=lambda model: not allowed or model in allowed,
        cache_wrong_hit_budget=None,
    )


async def prepared(pin: str | None, body: dict[str, Any] | None = None, **kwargs: Any) -> InferenceCall:
    call = InferenceCall(CHAT, grant(**kwargs), uuid.uuid4())
    raw = json.dumps(body or {"model": "pinned", "messages": HELLO, "temperature": 0}).encode()
    await call.prepare(raw, pinned_version=pin)
    return call


class TestPrepare:
    async def test_unpinned_requests_follow_the_weights(self, routed_model):
        assert {(await prepared(None, {"model": "pinned", "messages": HELLO, "user": f"u{i}"})).version.id
                for i in range(20)} == {1}  # fmt: skip

    async def test_a_pin_routes_to_that_version_even_at_weight_0(self, routed_model):
        assert (await prepared("2")).version.id == 2

    async def test_an_unknown_version_is_a_400_naming_the_header(self, routed_model):
        with pytest.raises(InvalidRequest) as caught:
            await prepared("9")
        error = caught.value
        assert (error.status, error.param, error.code) == (400, "x-model-version", "model_version_not_found")

    async def test_a_known_version_without_a_live_replica_is_a_503(self, routed_model):
        with pytest.raises(EngineUnavailable) as caught:
            await prepared("3")
        assert caught.value.status == 503
        assert "version `3`" in caught.value.message

    async def test_the_key_must_still_be_allowed_the_model(self, routed_model):
        with pytest.raises(ModelNotFound):  # outside its scope, a model does not exist
            await prepared("2", allowed=frozenset({"another-model"}))

    async def test_a_pinned_request_looks_in_its_versions_cache(self, routed_model, monkeypatch, settings):
        settings.SEMANTIC_CACHE_ENABLED = True
        probes = []

        async def lookup(probe: Any) -> None:
            probes.append(probe)

        monkeypatch.setattr(orchestrator, "lookup", lookup)
        for pin in ("2", None):
            call = await prepared(pin)
            await call.consult_cache(cache_control=None)
        pinned, unpinned = probes

        def scope(version_id: int) -> str:
            return scope_of(payload=call.payload, version_id=version_id, organization_id=7,
                            rules=routed_model.cache_rules, default_temperature=1.0)  # fmt: skip

        assert pinned.scope == scope(2)
        assert unpinned.scope == scope(1) != scope(2)


# --- through a gateway: REST, SSE and WebSocket ---------------------------------------------


@dataclass
class Pinned:
    gateway: Gateway
    model: str
    endpoints: dict[str, str]  # version → its fake engine

    def requests(self, version: str) -> int:
        return int(httpx.get(f"{self.endpoints[version]}/_stats", timeout=5).json()["requests"])


@pytest.fixture(scope="module")
def pinned(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Pinned]:
    engines = {version: start_fake_engine() for version in ("1", "2")}
    name = f"pinned-{uuid.uuid4().hex[:6]}"

    def register() -> None:
        from registry.models import Replica

        register_fake_replica(name, engines["1"][1], version="1", weight=100)
        register_fake_replica(name, engines["2"][1], version="2", weight=0)  # a candidate under test
        replica_id = register_fake_replica(name, "http://127.0.0.1:9", version="3", weight=100)
        Replica.objects.filter(pk=replica_id).update(state="starting")  # deployed, nothing live yet

    committed(django_db_blocker, register)
    gateway = start_gateway(
        tmp_path_factory.mktemp("pin-gateway"), REPLICA_STALE_AFTER="86400", ROUTING_REFRESH_SECONDS="0.2"
    )
    yield Pinned(gateway, name, {version: endpoint for version, (_, endpoint) in engines.items()})
    gateway.stop()
    for process, _ in engines.values():
        process.kill()


def chat(world: Pinned, key: Any, *, version: str | None = None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key.secret}"}
    if version is not None:
        headers["X-Model-Version"] = version
    return httpx.post(
        f"{world.gateway.base_url}/v1/chat/completions", timeout=30, headers=headers,
        json={"model": world.model, "messages": HELLO, **body},
    )  # fmt: skip


def ws_frames(world: Pinned, key: Any, messages: list[dict[str, Any]], headers: dict[str, str] | None = None):
    url = world.gateway.base_url.replace("http://", "ws://") + "/ws/v1/chat/completions"
    frames: list[dict[str, Any]] = []
    ends = {"usage", "error"}
    with connect(url, additional_headers={"Authorization": f"Bearer {key.secret}", **(headers or {})}) as socket:
        for message in messages:
            socket.send(json.dumps(message))
        while sum(f["type"] in ends for f in frames) < len(messages):
            frames.append(json.loads(socket.recv(timeout=30)))
    return frames


@pytest.mark.django_db
class TestThroughTheGateway:
    def test_every_answer_says_which_version_served_it(self, pinned, api_key):
        response = chat(pinned, api_key)
        assert response.status_code == 200, response.text
        assert response.headers["x-model-version"] == "1"
        streamed = chat(pinned, api_key, stream=True)
        assert streamed.status_code == 200
        assert streamed.headers["x-model-version"] == "1"

    def test_the_header_pins_json_and_sse_requests(self, pinned, api_key):
        before = pinned.requests("2")
        response = chat(pinned, api_key, version="2")
        assert response.status_code == 200, response.text
        assert response.headers["x-model-version"] == "2"
        streamed = chat(pinned, api_key, version="2", stream=True)
        assert streamed.status_code == 200
        assert streamed.headers["x-model-version"] == "2"
        assert "data: [DONE]" in streamed.text
        assert pinned.requests("2") == before + 2

    def test_an_unknown_version_is_a_400_in_the_openai_shape(self, pinned, api_key):
        response = chat(pinned, api_key, version="9")
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "x-model-version"
        assert response.json()["error"]["code"] == "model_version_not_found"
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert "x-model-version" not in response.headers

    def test_a_version_with_no_live_replica_is_a_503(self, pinned, api_key):
        response = chat(pinned, api_key, version="3", stream=True)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_unavailable"

    def test_a_key_not_allowed_the_model_cannot_pin_it(self, pinned, make_api_key):
        key = make_api_key(allowed_models=["something-else"])
        response = chat(pinned, key, version="2")
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "model_not_found"  # as for a model that does not exist

    def test_websocket_pins_by_handshake_header_or_per_request(self, pinned, api_key):
        body = {"model": pinned.model, "messages": HELLO}
        frames = ws_frames(
            pinned, api_key, headers={"X-Model-Version": "2"},
            messages=[
                {"type": "chat.completion", "id": "socket-pin", "body": body},
                {"type": "chat.completion", "id": "own-pin", "body": body, "model_version": "1"},
                {"type": "chat.completion", "id": "unknown", "body": body, "model_version": "9"},
            ],
        )  # fmt: skip
        final = {f["id"]: f for f in frames if f["type"] in ("usage", "error")}
        assert (final["socket-pin"]["type"], final["socket-pin"]["model_version"]) == ("usage", "2")
        assert (final["own-pin"]["type"], final["own-pin"]["model_version"]) == ("usage", "1")
        assert final["unknown"]["type"] == "error"
        assert final["unknown"]["error"]["param"] == "model_version"
        assert final["unknown"]["error"]["code"] == "model_version_not_found"

    def test_websocket_without_a_pin_reports_the_chosen_version(self, pinned, api_key):
        frames = ws_frames(pinned, api_key, [
            {"type": "chat.completion", "id": "a", "body": {"model": pinned.model, "messages": HELLO}},
        ])  # fmt: skip
        assert frames[-1]["type"] == "usage"
        assert frames[-1]["model_version"] == "1"
