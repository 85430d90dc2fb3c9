"""Bad input by hand, against a real gateway and a fake engine: every case is a clear 4xx in
OpenAI's error shape (or the WebSocket's error frame), the engine never hears of it, and
nothing is metered for it.

Each test ends with ``assert_nothing_ran``: a good request sent last reaches the engine and is
metered, so the check can see a request that ran; the refused ones must show in neither.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

from tests.support.gateway import ApiKeyFixture, committed, register_fake_replica, start_fake_engine
from tests.support.processes import Gateway, start_gateway

pytestmark = pytest.mark.django_db

HELLO = [{"role": "user", "content": "hello"}]
MIB = 1024 * 1024


@dataclass
class Models:
    """Models on one fake engine: one whose prompts the gateway cannot count (no tokenizer),
    one it counts exactly (SmolLM2's tokenizer, a 1024-token context), one for embeddings."""

    engine: str
    uncounted: str
    counted: str
    embedding: str

    def requests(self) -> int:
        return int(httpx.get(f"{self.engine}/_stats", timeout=5).json()["requests"])


@pytest.fixture(scope="module")
def models(bundled_models, django_db_blocker) -> Iterator[Models]:
    process, endpoint = start_fake_engine()
    tag = uuid.uuid4().hex[:8]
    found = Models(endpoint, f"bad-plain-{tag}", f"bad-counted-{tag}", f"bad-embed-{tag}")
    artifact = bundled_models["versions"]["smollm2-135m-instruct"].artifact_uri

    def register() -> None:
        register_fake_replica(found.uncounted, endpoint)
        register_fake_replica(found.counted, endpoint, artifact_uri=artifact)
        register_fake_replica(found.embedding, endpoint, task="embedding")

    committed(django_db_blocker, register)
    yield found
    process.kill()
    process.wait(5)


@pytest.fixture(scope="module")
def gateway(models, tmp_path_factory) -> Iterator[Gateway]:
    """Started after the bundled models' import, so it finds SmolLM2's tokenizer (a gateway
    started before would count no prompt exactly)."""
    started = start_gateway(
        tmp_path_factory.mktemp("bad-input-gateway"),
        REPLICA_STALE_AFTER="86400",
        ROUTING_REFRESH_SECONDS="0.2",
        ENGINE_FIRST_TOKEN_TIMEOUT="5",
    )
    yield started
    started.stop()


@dataclass
class Client:
    gateway: Gateway
    key: ApiKeyFixture
    models: Models
    engine_requests: int

    def post(
        self,
        body: bytes | dict[str, Any] | list[Any],
        *,
        path: str = "/v1/chat/completions",
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(
            self.gateway.base_url + path,
            content=content,
            headers={"Authorization": f"Bearer {key or self.key.secret}", "Content-Type": "application/json",
                     **(headers or {})},
            timeout=30,
        )  # fmt: skip

    def chat(self, **body: Any) -> httpx.Response:
        return self.post({"model": self.models.uncounted, "messages": HELLO, **body})

    def socket(self) -> ClientConnection:
        url = self.gateway.base_url.replace("http://", "ws://") + "/ws/v1/chat/completions"
        return connect(url, additional_headers={"Authorization": f"Bearer {self.key.secret}"}, max_size=None)

    def assert_nothing_ran(self, *, ran: Sequence[str] = ()) -> None:
        """The engine got only the good request sent now (and those of ``ran``, good requests
        a test sent itself), and only they were metered."""
        from billing.models import UsageRecord
        from billing.usage import persist_usage_stream

        good = self.chat()
        assert good.status_code == 200, good.text
        good_id = good.headers["x-request-id"]
        deadline = time.monotonic() + 10
        while True:
            persist_usage_stream()
            metered = {str(r) for r in UsageRecord.objects.filter(organization_id=self.key.organization_id)
                       .values_list("request_id", flat=True)}  # fmt: skip
            if {good_id, *ran} <= metered or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert metered == {good_id, *ran}
        assert self.models.requests() == self.engine_requests + 1 + len(ran)


@pytest.fixture
def client(gateway, api_key, models) -> Client:
    return Client(gateway, api_key, models, models.requests())


def assert_refused(response: httpx.Response, status: int, *, code: str | None = None, param: str | None = None) -> None:
    """A 4xx in OpenAI's shape, as JSON, with a request id: never an HTML page or a bare status."""
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"]
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    assert isinstance(error["type"], str)
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error


def valid_body(model: str) -> bytes:
    return json.dumps({"model": model, "messages": HELLO}).encode()


class TestBodiesThatAreNotJson:
    @pytest.mark.parametrize(
        "raw",
        [
            pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}', id="malformed"),
            pytest.param(b"", id="empty"),
            pytest.param(b"{'model': 'm'}", id="single-quotes"),
            pytest.param(b'{"model": "m",}', id="trailing-comma"),
            pytest.param(b'{"model": NaN}', id="nan"),
            pytest.param(b'{"max_tokens": 1e400}', id="number-out-of-range"),
        ],
    )
    def test_it_is_a_400(self, client, raw):
        assert_refused(client.post(raw), 400, code="invalid_json")
        client.assert_nothing_ran()

    def test_a_truncated_body(self, client):
        whole = valid_body(client.models.uncounted)
        for cut in (1, len(whole) // 2, len(whole) - 1):
            assert_refused(client.post(whole[:cut]), 400, code="invalid_json")
        client.assert_nothing_ran()

    @pytest.mark.parametrize(
        "raw",
        [
            pytest.param(b'{"model": "\xff\xfe", "messages": []}', id="invalid-utf8"),
            pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": "\xc3"}]}', id="cut-utf8"),
            pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', id="lone-surrogate"),
            pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": "a\x01b"}]}', id="raw-control"),
            pytest.param(b'{"model": "m", "messages": [{"role": "user", "content": "a\x00b"}]}', id="raw-nul"),
        ],
    )
    def test_bytes_that_are_no_json_text(self, client, raw):
        assert_refused(client.post(raw), 400, code="invalid_json")
        client.assert_nothing_ran()

    @pytest.mark.parametrize("body", [[], [{"model": "m"}], "chat", 42, None], ids=repr)
    def test_json_that_is_not_an_object(self, client, body):
        assert_refused(client.post(json.dumps(body).encode()), 400, code="invalid_json")
        client.assert_nothing_ran()


class TestWrongTypes:
    @pytest.mark.parametrize(
        ("change", "param"),
        [
            ({"model": 123}, "model"),
            ({"model": ""}, "model"),
            ({"messages": "hello"}, "messages"),
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
            ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
            ({"messages": [{"content": "hi"}]}, "messages[0].role"),
            ({"temperature": "0.5"}, "temperature"),
            ({"temperature": 3}, "temperature"),
            ({"stream": "true"}, "stream"),
            ({"n": 1.5}, "n"),
            ({"n": 17}, "n"),
            ({"max_tokens": "10"}, "max_tokens"),
            ({"max_tokens": 10.0}, "max_tokens"),
            ({"stop": 5}, "stop"),
            ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
            ({"logit_bias": {"1": 500}}, "logit_bias.1"),
            ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
            ({"tools": "all"}, "tools"),
            ({"unknown_field": 1}, "unknown_field"),
            ({"audio": {"voice": "alloy"}}, "audio"),
            ({"priority": 10}, "priority"),
        ],
    )
    def test_a_chat_field_of_the_wrong_type_or_value(self, client, change, param):
        body = {"model": client.models.uncounted, "messages": HELLO, **change}
        response = client.post(body)
        assert_refused(response, 400, param=param)
        client.assert_nothing_ran()

    @pytest.mark.parametrize(
        ("path", "body", "param"),
        [
            ("/v1/completions", {"prompt": []}, "prompt"),
            ("/v1/completions", {"prompt": [[-1]]}, "prompt"),
            ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
            ("/v1/completions", {"prompt": "hi", "suffix": "there"}, "suffix"),
            ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
            ("/v1/completions", {}, "prompt"),
            ("/v1/embeddings", {"input": []}, "input"),
            ("/v1/embeddings", {"input": 42}, "input"),
            ("/v1/embeddings", {"input": "hi", "encoding_format": "hex"}, "encoding_format"),
            ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
        ],
    )
    def test_completions_and_embeddings(self, client, path, body, param):
        model = client.models.embedding if "embeddings" in path else client.models.uncounted
        assert_refused(client.post({"model": model, **body}, path=path), 400, param=param)
        client.assert_nothing_ran()


class TestMaxTokens:
    @pytest.mark.parametrize("value", [0, -1, -(2**63)])
    def test_zero_or_negative(self, client, value):
        for field in ("max_tokens", "max_completion_tokens"):
            assert_refused(client.chat(**{field: value}), 400, param=field)
        assert_refused(client.post({"model": client.models.uncounted, "prompt": "hi", "max_tokens": value},
                                   path="/v1/completions"), 400, param="max_tokens")  # fmt: skip
        client.assert_nothing_ran()

    @pytest.mark.parametrize("value", [1025, 10**9, 2**63 - 1, 2**64 - 1])
    @pytest.mark.parametrize("counted", [True, False], ids=["counted", "uncounted"])
    def test_beyond_the_context(self, client, value, counted):
        """Beyond what the model can ever generate, whether or not the gateway counts the prompt."""
        model = client.models.counted if counted else client.models.uncounted
        for field in ("max_tokens", "max_completion_tokens"):
            response = client.post({"model": model, "messages": HELLO, field: value, "n": 16})
            assert_refused(response, 400, code="context_length_exceeded", param=field)
        response = client.post({"model": model, "prompt": ["a", "b"], "max_tokens": value, "n": 16},
                               path="/v1/completions")  # fmt: skip
        assert_refused(response, 400, code="context_length_exceeded", param="max_tokens")
        client.assert_nothing_ran()

    @pytest.mark.parametrize("value", [2**64, 10**30])
    def test_beyond_any_integer(self, client, value):
        """JSON numbers past 64 bits are read as floats, which an integer field refuses."""
        assert_refused(client.chat(max_tokens=value), 400, param="max_tokens")
        client.assert_nothing_ran()


class TestHugeStrings:
    """Within the 4 MiB body limit (a larger body is a 413 before it is read: tests/faults/test_client.py)."""

    def test_a_prompt_far_beyond_the_context(self, client):
        content = "lorem ipsum dolor sit amet " * (int(3.5 * MIB) // 27)
        response = client.post({"model": client.models.counted, "messages": [{"role": "user", "content": content}]})
        assert_refused(response, 400, code="context_length_exceeded", param="messages")
        client.assert_nothing_ran()

    def test_a_prompt_just_beyond_the_context(self, client):
        content = "lorem ipsum dolor sit amet " * 200  # about 1,200 tokens: the cheap bound lets it through
        response = client.post({"model": client.models.counted, "messages": [{"role": "user", "content": content}]})
        assert_refused(response, 400, code="context_length_exceeded")
        client.assert_nothing_ran()

    def test_a_huge_model_name(self, client):
        response = client.post({"model": "m" * (3 * MIB), "messages": HELLO})
        assert_refused(response, 400, code="model_not_found", param="model")
        assert len(response.content) < 4096  # the name is not echoed back whole
        client.assert_nothing_ran()

    def test_a_huge_unknown_field(self, client):
        response = client.post({"model": client.models.uncounted, "messages": HELLO, "x" * MIB: 1})
        assert_refused(response, 400)
        assert len(response.content) < 4096
        client.assert_nothing_ran()

    def test_a_huge_refused_value(self, client):
        response = client.post({"model": client.models.uncounted, "messages": HELLO, "stop": ["s"] * 100_000})
        assert_refused(response, 400, param="stop")
        assert len(response.content) < 4096
        client.assert_nothing_ran()


class TestModels:
    def test_an_unknown_model(self, client):
        for path, body in (("/v1/chat/completions", {"messages": HELLO}), ("/v1/completions", {"prompt": "hi"}),
                           ("/v1/embeddings", {"input": "hi"})):  # fmt: skip
            assert_refused(client.post({"model": "no-such-model", **body}, path=path), 400,
                           code="model_not_found", param="model")  # fmt: skip
        assert_refused(client.post(b"", path="/v1/models/no-such-model"), 405)  # POST on a GET path
        client.assert_nothing_ran()

    def test_a_model_outside_the_keys_allowed_models(self, client, django_db_blocker):
        from accounts.models import Organization
        from accounts.services import api_key_create

        def restricted() -> str:
            organization = Organization.objects.get(pk=client.key.organization_id)
            return api_key_create(organization=organization, name="only counted",
                                  allowed_models=[client.models.counted]).secret  # fmt: skip

        secret = committed(django_db_blocker, restricted)
        # Outside its scope a model does not exist, for this key (issue 34, defect 11).
        response = client.post({"model": client.models.uncounted, "messages": HELLO}, key=secret)
        assert_refused(response, 400, code="model_not_found", param="model")
        listed = httpx.get(f"{client.gateway.base_url}/v1/models/{client.models.uncounted}",
                           headers={"Authorization": f"Bearer {secret}"}, timeout=10)  # fmt: skip
        assert_refused(listed, 400, code="model_not_found")
        client.assert_nothing_ran()

    def test_a_model_of_another_task(self, client):
        assert_refused(client.post({"model": client.models.embedding, "messages": HELLO}), 400,
                       code="model_not_supported", param="model")  # fmt: skip
        assert_refused(client.post({"model": client.models.uncounted, "input": "hi"}, path="/v1/embeddings"), 400,
                       code="model_not_supported", param="model")  # fmt: skip
        client.assert_nothing_ran()

    def test_a_version_the_model_does_not_serve(self, client):
        response = client.post(valid_body(client.models.uncounted), headers={"X-Model-Version": "no-such-version"})
        assert_refused(response, 400, code="model_version_not_found", param="x-model-version")
        client.assert_nothing_ran()


class TestRequestsAroundTheBody:
    @pytest.mark.parametrize(
        "authorization",
        ["", "Bearer", "Basic c2stYTpi", "Bearer sk-not-a-key", "Bearer sk-\u00e9\u00ff", "sk-no-scheme"],
    )
    def test_a_missing_or_wrong_key(self, client, authorization):
        response = httpx.post(
            f"{client.gateway.base_url}/v1/chat/completions", content=valid_body(client.models.uncounted),
            headers={"Authorization": authorization.encode("latin1")} if authorization else {}, timeout=10,
        )  # fmt: skip
        assert_refused(response, 401)
        client.assert_nothing_ran()

    def test_a_wrong_method_or_path(self, client):
        assert_refused(httpx.get(f"{client.gateway.base_url}/v1/chat/completions", timeout=10), 405)
        assert_refused(client.post({}, path="/v1/models"), 405)
        assert_refused(client.post({}, path="/v1/chat/completion"), 404, code="unknown_url")
        assert_refused(client.post({}, path="/v1/chat/completions/extra"), 404, code="unknown_url")
        client.assert_nothing_ran()


def frames_until(socket: ClientConnection, count: int, timeout: float = 10) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    return [json.loads(socket.recv(timeout=max(0.1, deadline - time.monotonic()))) for _ in range(count)]


def final_frame(socket: ClientConnection, client_id: str, timeout: float = 10) -> dict[str, Any]:
    """The request's final frame (usage or error), past its chunks."""
    deadline = time.monotonic() + timeout
    while True:
        frame = json.loads(socket.recv(timeout=max(0.1, deadline - time.monotonic())))
        if frame["id"] == client_id and frame["type"] in ("usage", "error"):
            return frame


def assert_error_frame(frame: dict[str, Any], *, client_id: Any = None, param: str | None = None) -> None:
    assert frame["type"] == "error", frame
    assert frame["id"] == client_id
    assert set(frame["error"]) == {"message", "type", "param", "code"}
    assert frame["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert frame["error"]["param"] == param, frame


class TestWebSocketFrames:
    @pytest.mark.parametrize(
        ("frame", "client_id", "param"),
        [
            pytest.param("hello", None, None, id="not-json"),
            pytest.param('{"type": "chat.completion", "id": "a", "body": {', None, None, id="truncated"),
            pytest.param("", None, None, id="empty"),
            pytest.param("[1, 2]", None, None, id="array"),
            pytest.param('"chat.completion"', None, None, id="string"),
            pytest.param('{"type": "completion", "id": "a"}', "a", "type", id="unknown-type"),
            pytest.param('{"id": "a", "body": {}}', "a", "type", id="no-type"),
            pytest.param('{"type": "chat.completion", "body": {"model": "m"}}', None, "id", id="missing-id"),
            pytest.param('{"type": "chat.completion", "id": 7, "body": {"model": "m"}}', 7, "id", id="number-id"),
            pytest.param('{"type": "chat.completion", "id": "", "body": {"model": "m"}}', "", "id", id="empty-id"),
            pytest.param('{"type": "chat.completion", "id": "a", "body": "hi"}', "a", "body", id="body-string"),
            pytest.param('{"type": "chat.completion", "id": "a"}', "a", "body", id="no-body"),
            pytest.param(
                '{"type": "chat.completion", "id": "a", "body": {}, "model_version": 3}',
                "a",
                "model_version",
                id="version-number",
            ),
        ],
    )
    def test_it_gets_an_error_frame(self, client, frame, client_id, param):
        with client.socket() as socket:
            socket.send(frame)
            [answer] = frames_until(socket, 1)
            assert_error_frame(answer, client_id=client_id, param=param)
            # The socket still serves: one bad frame does not end it.
            socket.send(json.dumps({"type": "cancel", "id": "nothing"}))
            socket.send("[]")
            assert_error_frame(frames_until(socket, 1)[0])
        client.assert_nothing_ran()

    @pytest.mark.parametrize(
        "data",
        [
            pytest.param(b"\xff\xfe\x00", id="not-json"),
            pytest.param(
                json.dumps({"type": "chat.completion", "id": "a", "body": {"messages": HELLO}}).encode(),
                id="json-bytes",
            ),
        ],
    )
    def test_a_binary_frame_gets_an_error_frame(self, client, data):
        """The protocol is JSON text frames; a binary one is refused, whatever it holds."""
        with client.socket() as socket:
            socket.send(data)
            assert_error_frame(frames_until(socket, 1)[0])
        client.assert_nothing_ran()

    @pytest.mark.parametrize(
        ("body", "param"),
        [
            ({"messages": HELLO}, "model"),
            ({"model": "no-such-model", "messages": HELLO}, "model"),
            ({"messages": "hello"}, "messages"),
            ({"max_tokens": -1}, "max_tokens"),
            ({"max_tokens": 10**9}, "max_tokens"),
            ({"temperature": "hot"}, "temperature"),
        ],
    )
    def test_a_bad_request_body_ends_with_one_error_frame(self, client, body, param):
        full = {"model": client.models.uncounted, "messages": HELLO, **body}
        if "model" not in body and param == "model":
            del full["model"]
        with client.socket() as socket:
            socket.send(json.dumps({"type": "chat.completion", "id": "bad", "body": full}))
            [answer] = frames_until(socket, 1)
            assert_error_frame(answer, client_id="bad", param=param)
            # The socket still serves: a good request after it runs, and is the only one metered.
            socket.send(json.dumps({"type": "chat.completion", "id": "good",
                                    "body": {"model": client.models.uncounted, "messages": HELLO}}))  # fmt: skip
            usage = final_frame(socket, "good")
        assert (usage["type"], usage["status"]) == ("usage", "completed")
        client.assert_nothing_ran(ran=[usage["request_id"]])
