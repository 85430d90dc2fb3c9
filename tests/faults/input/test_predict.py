"""Bad input by hand on the small-model surfaces, against a real gateway, ``rungrpc`` and a fake
predict worker: the Open Inference Protocol over REST (``/v2``) and gRPC, and the seeds'
``/api/v1`` predict shapes. Every case is a clear 4xx in the protocol's error shape
(``{"error": "…"}`` on /v2, a gRPC status with a message, OpenAI's shape on /api/v1), the
worker never hears of it, nothing is metered for it and nothing lands in the result cache.

Each test ends with ``assert_nothing_ran``: a good prediction sent last reaches the worker,
is metered and fills the cache, so the check can see a request that ran; the refused ones
must show in none of them. (The LLM surfaces' cases are tests/faults/input/test_openai.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import httpx
import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.support.gateway import ApiKeyFixture, committed, register_fake_replica
from tests.support.processes import Gateway, child_env, free_port, start_gateway, start_process

pytestmark = pytest.mark.django_db

MIB = 1024 * 1024
PIXELS = {"name": "pixels", "datatype": "FP32", "shape": [-1, 4]}
TEXT = {"name": "text", "datatype": "BYTES", "shape": [-1]}
LABEL = {"name": "label", "datatype": "INT64", "shape": [-1]}


# --- a fake predict worker: counts what reaches it, answers label 0 for every row ----------------


class FakeWorker(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: WorkerServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in {"content-type": "application/json", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200, b"{}")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path.startswith("/internal/"):  # no infer-many here: each prediction comes alone
            self._send(404, b"{}")
            return
        with self.server.lock:
            self.server.requests += 1
        length = self.headers.get("inference-header-content-length")
        header = orjson.loads(body[: int(length)] if length else body)
        rows = int(header["inputs"][0]["shape"][0])
        raw = np.zeros(rows, dtype="<i8").tobytes()
        answer = orjson.dumps({"model_name": "m", "model_version": "1", "outputs": [
            {**LABEL, "shape": [rows], "parameters": {"binary_data_size": len(raw)}}]})  # fmt: skip
        self._send(200, answer + raw, {"content-type": "application/octet-stream",
                                       "inference-header-content-length": str(len(answer))})  # fmt: skip


class WorkerServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeWorker)
        self.lock = threading.Lock()
        self.requests = 0


@dataclass
class Models:
    worker: WorkerServer
    pixels: str  # FP32 [-1, 4]
    text: str  # BYTES [-1]
    llm: str  # a chat model (no engine behind it: nothing may reach one)


def register_predict_model(name: str, endpoint: str, inputs: list[dict[str, Any]]) -> None:
    from django.utils import timezone

    from registry.models import Deployment, Model, ModelVersion, Replica

    model = Model.objects.create(name=name, task="classification")
    version = ModelVersion.objects.create(
        model=model, version="1", framework="onnx", artifact_uri=f"local://fake/{name}", artifact_sha256="0" * 64,
        artifact_size=0, config={"signature": {"inputs": inputs, "outputs": [LABEL]}}, status="active",
    )  # fmt: skip
    deployment = Deployment.objects.create(version=version, status="running", traffic_weight=100)
    Replica.objects.create(deployment=deployment, host="fake", endpoint=endpoint, state="ready",
                           last_heartbeat=timezone.now())  # fmt: skip


@pytest.fixture(scope="module")
def models(django_db_setup, django_db_blocker) -> Iterator[Models]:
    server = WorkerServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    tag = uuid.uuid4().hex[:8]
    found = Models(server, f"bad-pixels-{tag}", f"bad-text-{tag}", f"bad-llm-{tag}")

    def register() -> None:
        register_predict_model(found.pixels, endpoint, [PIXELS])
        register_predict_model(found.text, endpoint, [TEXT])
        register_fake_replica(found.llm, "http://127.0.0.1:9")

    committed(django_db_blocker, register)
    yield found
    server.shutdown()


SETTINGS = {"REPLICA_STALE_AFTER": "86400", "ROUTING_REFRESH_SECONDS": "0.2", "PREDICT_DECODE_INLINE_BYTES": "4096"}


@dataclass
class Servers:
    gateway: Gateway
    grpc_address: str


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory) -> Iterator[Servers]:
    """A gateway and ``manage.py rungrpc`` (as runplatform starts it) on the test database,
    started side by side."""
    folder = tmp_path_factory.mktemp("bad-predict")
    port = free_port()
    log_path = folder / "rungrpc.log"
    with open(log_path, "wb") as log:
        rungrpc = start_process(
            [sys.executable, "manage.py", "rungrpc", "--port", str(port)],
            env=child_env(**SETTINGS), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        gateway = start_gateway(folder, **SETTINGS)
    except BaseException:
        rungrpc.kill()
        raise
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with grpc.insecure_channel(address) as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=1)
            break
        except grpc.RpcError:
            pass
        if rungrpc.poll() is not None or time.monotonic() > deadline:
            rungrpc.kill()
            gateway.stop()
            pytest.fail(f"rungrpc did not start:\n{log_path.read_text()}")
        time.sleep(0.2)
    yield Servers(gateway, address)
    rungrpc.kill()  # nothing to drain: no test leaves an RPC in flight
    gateway.stop()
    rungrpc.wait(5)


# --- the client and its checks ------------------------------------------------------------------


def binary(tensors: list[tuple[dict[str, Any], bytes]], **extra: Any) -> tuple[bytes, dict[str, str]]:
    """Triton's binary extension: the JSON header, then each tensor's bytes."""
    described = [{**tensor, "parameters": {"binary_data_size": len(raw)}} for tensor, raw in tensors]
    header = orjson.dumps({"inputs": described, **extra})
    return header + b"".join(raw for _, raw in tensors), {"Inference-Header-Content-Length": str(len(header))}


def bytes_elements(count: int, item: bytes = b"") -> bytes:
    return (len(item).to_bytes(4, "little") + item) * count


@dataclass
class Client:
    gateway: Gateway
    grpc_address: str
    key: ApiKeyFixture
    models: Models
    worker_requests: int

    def post(self, path: str, body: bytes | dict[str, Any], *, key: str | None = None,
             headers: dict[str, str] | None = None) -> httpx.Response:  # fmt: skip
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.gateway.base_url + path, content=content, timeout=60,
                          headers={"Authorization": f"Bearer {key or self.key.secret}", **(headers or {})})  # fmt: skip

    def infer(self, model: str, body: bytes | dict[str, Any], **kwargs: Any) -> httpx.Response:
        return self.post(f"/v2/models/{model}/infer", body, **kwargs)

    def grpc(self, method: str, request: Any, *, key: str | None = None) -> Any:
        with grpc.insecure_channel(self.grpc_address, options=[("grpc.max_send_message_length", 8 * MIB)]) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            return getattr(stub, method)(request, timeout=30,
                                         metadata=[("authorization", f"Bearer {key or self.key.secret}")])  # fmt: skip

    def grpc_refused(self, request: Any, code: Any, *, method: str = "ModelInfer",
                     key: str | None = None) -> str:  # fmt: skip
        """The RPC fails with ``code`` and a message (returned), never UNKNOWN or INTERNAL."""
        with pytest.raises(grpc.RpcError) as refused:
            self.grpc(method, request, key=key)
        assert refused.value.code() == code, (refused.value.code(), refused.value.details())
        details = refused.value.details()
        assert details, "a status without a message"
        assert len(details) < 2100, details[:300]
        return str(details)

    def good(self) -> None:
        response = self.infer(self.models.pixels, {"inputs": [{**PIXELS, "shape": [1, 4], "data": [1, 2, 3, 4]}]})
        assert response.status_code == 200, response.text
        assert response.headers["x-cache"] == "miss"

    def assert_nothing_ran(self) -> None:
        """Nothing reached the worker, was metered or was cached for this organisation; then a
        good prediction (sent now) does all three, so the checks can see a request that ran."""
        from billing.models import UsageRecord
        from billing.usage import persist_usage_stream
        from core import keys
        from core.redis import sync_redis

        assert self.models.worker.requests == self.worker_requests
        pattern = keys.predict_result(self.key.organization_id, "*")
        assert list(sync_redis().scan_iter(match=pattern)) == []
        self.good()
        deadline = time.monotonic() + 10
        while True:
            persist_usage_stream()
            records = list(UsageRecord.objects.filter(organization_id=self.key.organization_id))
            if records or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [(r.status_code, r.inferences) for r in records] == [(200, 1)]
        assert self.models.worker.requests == self.worker_requests + 1
        assert len(list(sync_redis().scan_iter(match=pattern))) == 1

    def key_in_org(self, django_db_blocker: Any, **limits: Any) -> str:
        """Another key of this client's organisation (so the checks above cover it too)."""
        from accounts.models import Organization
        from accounts.services import api_key_create

        def create() -> str:
            organization = Organization.objects.get(pk=self.key.organization_id)
            return api_key_create(organization=organization, name=f"k-{uuid.uuid4().hex[:6]}", **limits).secret

        return str(committed(django_db_blocker, create))


@pytest.fixture
def client(servers, api_key, models) -> Client:
    return Client(servers.gateway, servers.grpc_address, api_key, models, models.worker.requests)


def assert_protocol_error(response: httpx.Response, status: int, *, says: str | None = None) -> str:
    """A 4xx in the protocol's shape: ``{"error": "<message>"}`` as JSON, with a request id."""
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"]
    body = response.json()
    assert set(body) == {"error"}
    assert isinstance(body["error"], str)
    assert body["error"]
    assert len(body["error"]) <= 2000
    if says is not None:
        assert says in body["error"], body["error"]
    return str(body["error"])


def assert_openai_error(response: httpx.Response, status: int, *, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


def grpc_request(model: str, tensors: list[tuple[dict[str, Any], bytes | None]], **contents: Any) -> Any:
    """A ModelInferRequest; a tensor with bytes travels in raw_input_contents, else ``contents``."""
    request = service_pb2.ModelInferRequest(model_name=model)
    for tensor, raw in tensors:
        added = request.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        for field, values in contents.items():
            getattr(added.contents, field).extend(values)
        if raw is not None:
            request.raw_input_contents.append(raw)
    return request


# --- the cases ------------------------------------------------------------------------------------


class TestShapes:
    """A shape no body can hold, or one its bytes disagree with: refused before the bytes are read."""

    def test_over_rest_json(self, client):
        pixels, text = client.models.pixels, client.models.text
        cases = [
            (pixels, {**PIXELS, "shape": [2**40, 4]}, [0.0] * 4),  # 2**40 rows
            (pixels, {**PIXELS, "shape": [1, 2**40]}, [0.0] * 4),  # 2**40 columns
            (pixels, {**PIXELS, "shape": [2**62, 4]}, [0.0] * 4),
            (text, {**TEXT, "shape": [2**40]}, ["a"]),  # 2**40 strings
            (pixels, {**PIXELS, "shape": [1, -4]}, [0.0] * 4),
            (pixels, {**PIXELS, "shape": [1, 4.0]}, [0.0] * 4),
            (pixels, {**PIXELS, "shape": "1x4"}, [0.0] * 4),
            (pixels, {**PIXELS, "shape": [1] * 10_000}, [0.0] * 4),  # 10,000 dimensions
            (pixels, {**PIXELS, "shape": [0, 4]}, []),  # no rows
            (pixels, {**PIXELS, "shape": [2, 4]}, [[0.0] * 4] * 3),  # a row too many
        ]
        for model, tensor, data in cases:
            assert_protocol_error(client.infer(model, {"inputs": [{**tensor, "data": data}]}), 400)
        client.assert_nothing_ran()

    def test_over_rest_binary(self, client):
        cases = [
            binary([({**PIXELS, "shape": [2**40, 4]}, b"\0" * 16)]),  # 2**40 rows, 16 bytes
            binary([({**TEXT, "shape": [2**40]}, bytes_elements(4))]),  # 2**40 strings, 4 sent
            binary([({**PIXELS, "shape": [1, 4]}, b"\0" * 12)]),  # 12 bytes for 16
            binary([({**PIXELS, "shape": [1, 4]}, b"\0" * 20)]),  # 20 bytes for 16
            binary([({**TEXT, "shape": [2]}, bytes_elements(3, b"hi"))]),  # 3 strings for 2
            binary([({**TEXT, "shape": [1]}, b"\xff\xff\xff\x7fhi")]),  # a string's length past the end
            binary([({**TEXT, "shape": [1]}, b"\x02\0")]),  # a length cut short
        ]
        for body, headers in cases:
            model = client.models.text if b'"BYTES"' in body else client.models.pixels
            assert_protocol_error(client.infer(model, body, headers=headers), 400)
        body, headers = binary([({**PIXELS, "shape": [1, 4]}, b"\0" * 16)])
        for length in ("12", str(len(body) + 1), "-1", "lots", "0"):  # the header's length itself is wrong
            assert_protocol_error(
                client.infer(client.models.pixels, body, headers={"Inference-Header-Content-Length": length}), 400
            )
        assert_protocol_error(client.infer(client.models.pixels, body + b"extra", headers=headers), 400)
        client.assert_nothing_ran()

    def test_over_grpc(self, client):
        text, pixels = client.models.text, client.models.pixels
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        client.grpc_refused(grpc_request(text, [({**TEXT, "shape": [2**40]}, bytes_elements(4))]), invalid)
        client.grpc_refused(grpc_request(pixels, [({**PIXELS, "shape": [2**40, 4]}, b"\0" * 16)]), invalid)
        client.grpc_refused(grpc_request(pixels, [({**PIXELS, "shape": [2**40, 4]}, None)], fp32_contents=[0.0] * 4),
                            invalid)  # fmt: skip
        client.grpc_refused(grpc_request(pixels, [({**PIXELS, "shape": [1, 4]}, b"\0" * 12)]), invalid)
        client.grpc_refused(grpc_request(pixels, [({**PIXELS, "shape": [1, 4]}, None)], fp32_contents=[0.0] * 3),
                            invalid)  # fmt: skip
        client.grpc_refused(grpc_request(text, [({**TEXT, "shape": [2]}, bytes_elements(3, b"hi"))]), invalid)
        two_raw = grpc_request(pixels, [({**PIXELS, "shape": [1, 4]}, b"\0" * 16)])
        two_raw.raw_input_contents.append(b"\0" * 16)  # two raw tensors for one input
        client.grpc_refused(two_raw, invalid)
        client.assert_nothing_ran()


class TestHugeElementCounts:
    """A BYTES tensor of shape [1] holding a million empty strings (4 MB): refused after reading
    at most two of them (the unit tests count the reads), never sent on, never charged as run."""

    def test_over_rest(self, client):
        body, headers = binary([({**TEXT, "shape": [1]}, bytes_elements(1_000_000))])
        assert_protocol_error(client.infer(client.models.text, body, headers=headers), 400, says="'text'")
        data = {"inputs": [{**TEXT, "shape": [1], "data": [""] * 1_000_000}]}
        assert_protocol_error(client.infer(client.models.text, data), 400, says="'text'")
        client.assert_nothing_ran()

    def test_over_grpc(self, client):
        request = grpc_request(client.models.text, [({**TEXT, "shape": [1]}, bytes_elements(1_000_000))])
        assert "'text'" in client.grpc_refused(request, grpc.StatusCode.INVALID_ARGUMENT)
        typed = grpc_request(client.models.text, [({**TEXT, "shape": [1]}, None)], bytes_contents=[b""] * 1_000_000)
        assert "'text'" in client.grpc_refused(typed, grpc.StatusCode.INVALID_ARGUMENT)
        client.assert_nothing_ran()


class TestDatatypes:
    def test_over_rest(self, client):
        tensors = [
            {**PIXELS, "datatype": "FP64", "shape": [1, 4], "data": [0.0] * 4},
            {**PIXELS, "datatype": "BYTES", "shape": [1, 4], "data": ["a"] * 4},
            {**PIXELS, "datatype": "FLOAT", "shape": [1, 4], "data": [0.0] * 4},  # no datatype of the protocol
            {**PIXELS, "datatype": None, "shape": [1, 4], "data": [0.0] * 4},
            {**PIXELS, "shape": [1, 4], "data": ["a", "b", "c", "d"]},
            {**PIXELS, "shape": [1, 4], "data": [None] * 4},
            {**PIXELS, "shape": [1, 4], "data": [1e400] * 4},  # infinite
            {**PIXELS, "shape": [1, 4], "data": [{"a": 1}] * 4},
            {**PIXELS, "shape": [1, 4], "data": [True] * 4},
        ]
        for tensor in tensors:
            body = json.dumps({"inputs": [tensor]}).replace("Infinity", "1e400").encode()
            assert_protocol_error(client.infer(client.models.pixels, body), 400)
        not_text = {"inputs": [{**TEXT, "shape": [2], "data": [1, 2]}]}
        assert_protocol_error(client.infer(client.models.text, not_text), 400)
        client.assert_nothing_ran()

    def test_over_grpc(self, client):
        pixels, invalid = client.models.pixels, grpc.StatusCode.INVALID_ARGUMENT
        client.grpc_refused(grpc_request(pixels, [({**PIXELS, "datatype": "FP64", "shape": [1, 4]}, b"\0" * 32)]),
                            invalid)  # fmt: skip
        client.grpc_refused(grpc_request(pixels, [({**PIXELS, "datatype": "FLOAT", "shape": [1, 4]}, b"\0" * 16)]),
                            invalid)  # fmt: skip
        client.grpc_refused(grpc_request(pixels, [({**PIXELS, "datatype": "FP16", "shape": [1, 4]}, None)]),
                            invalid)  # fmt: skip
        client.grpc_refused(grpc_request(pixels, [({**PIXELS, "shape": [1, 4]}, None)], int_contents=[1, 2, 3, 4]),
                            invalid)  # fmt: skip
        client.assert_nothing_ran()


class TestRawField:
    """``_raw`` was where the gateway put a binary tensor's bytes beside its JSON: a client's own
    ``_raw`` is only an unknown field now (never a 500)."""

    def test_over_rest_json(self, client):
        for value in ("abcdefgh", "x", 12, None, {"a": 1}, ["AAAA"]):
            body = {"inputs": [{**TEXT, "shape": [1], "_raw": value}]}
            assert_protocol_error(client.infer(client.models.text, body), 400, says="data")
        client.assert_nothing_ran()

    def test_over_rest_binary_and_the_seeds_shape(self, client):
        header = {**TEXT, "shape": [2], "_raw": "abcdefgh"}
        body, headers = binary([(header, bytes_elements(3, b"hi"))])  # its real binary part is wrong
        assert_protocol_error(client.infer(client.models.text, body, headers=headers), 400)
        seeds = client.post(f"/api/v1/models/{client.models.text}/predict", {"inputs": [{"_raw": "abcdefgh"}]})
        assert_openai_error(seeds, 400, code="invalid_tensor")
        client.assert_nothing_ran()

    def test_over_grpc(self, client):
        request = grpc_request(client.models.text, [({**TEXT, "name": "_raw", "shape": [1]}, bytes_elements(1))])
        assert "_raw" in client.grpc_refused(request, grpc.StatusCode.INVALID_ARGUMENT)
        client.assert_nothing_ran()


class TestModels:
    def test_an_llm_is_not_served_over_the_protocol(self, client):
        llm = client.models.llm
        says = "LLM"
        tensor = {**TEXT, "shape": [1], "data": ["hi"]}
        assert_protocol_error(client.infer(llm, {"inputs": [tensor]}), 400, says=says)
        auth = {"Authorization": f"Bearer {client.key.secret}"}
        metadata = httpx.get(f"{client.gateway.base_url}/v2/models/{llm}", timeout=10, headers=auth)
        assert_protocol_error(metadata, 400, says=says)
        assert_openai_error(client.post(f"/api/v1/models/{llm}/predict", {"inputs": ["hi"]}), 400,
                            code="model_not_supported")  # fmt: skip
        assert_openai_error(client.post("/api/v1/predict", {"model": llm, "input": "hi"}), 400,
                            code="model_not_supported")  # fmt: skip
        request = grpc_request(llm, [({**TEXT, "shape": [1]}, bytes_elements(1, b"hi"))])
        assert says in client.grpc_refused(request, grpc.StatusCode.INVALID_ARGUMENT)
        asked = service_pb2.ModelMetadataRequest(name=llm)
        assert says in client.grpc_refused(asked, grpc.StatusCode.INVALID_ARGUMENT, method="ModelMetadata")
        client.assert_nothing_ran()

    def test_bodies_that_are_not_inference_requests(self, client):
        pixels = client.models.pixels
        for body in (b"", b"{", b"[]", b'"inputs"', b'{"inputs": {}}', b'{"inputs": []}', b'{"inputs": [1]}',
                     b'{"inputs": [{"datatype": "FP32"}]}', b'{"inputs": [{"name": "image"}]}'):  # fmt: skip
            assert_protocol_error(client.infer(pixels, body), 400)
        client.assert_nothing_ran()


class TestScope:
    """A key limited to some models is answered for any other model exactly as for one that does
    not exist (issue 34, defect 11): the same status and body, but for the name and request id."""

    def test_an_existing_model_outside_the_scope_reads_as_missing(self, client, django_db_blocker):
        scoped = client.key_in_org(django_db_blocker, allowed_models=[client.models.pixels])
        missing = f"no-such-model-{uuid.uuid4().hex[:6]}"
        base = client.gateway.base_url

        def answers(name: str) -> dict[str, tuple[int, str]]:
            auth = {"Authorization": f"Bearer {scoped}"}
            tensor = {**TEXT, "shape": [1], "data": ["hi"]}
            sent = {
                "chat": httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=10,
                                   json={"model": name, "messages": [{"role": "user", "content": "hi"}]}),
                "model": httpx.get(f"{base}/v1/models/{name}", headers=auth, timeout=10),
                "v2 infer": httpx.post(f"{base}/v2/models/{name}/infer", headers=auth, timeout=10,
                                       json={"inputs": [tensor]}),
                "v2 metadata": httpx.get(f"{base}/v2/models/{name}", headers=auth, timeout=10),
                "v2 ready": httpx.get(f"{base}/v2/models/{name}/ready", headers=auth, timeout=10),
                "seeds": httpx.post(f"{base}/api/v1/models/{name}/predict", headers=auth, timeout=10,
                                    json={"inputs": ["hi"]}),
            }  # fmt: skip
            found = {what: (r.status_code, r.text.replace(name, "<model>")) for what, r in sent.items()}
            rpcs = {
                "ModelInfer": grpc_request(name, [({**TEXT, "shape": [1]}, bytes_elements(1, b"hi"))]),
                "ModelMetadata": service_pb2.ModelMetadataRequest(name=name),
                "ModelReady": service_pb2.ModelReadyRequest(name=name),
            }
            for method, message in rpcs.items():
                with pytest.raises(grpc.RpcError) as refused:
                    client.grpc(method, message, key=scoped)
                details = refused.value.details().replace(name, "<model>")
                found[f"grpc {method}"] = (refused.value.code().value[0], details)
            return found

        unknown = answers(missing)
        outside = answers(client.models.text)
        assert outside == unknown
        assert answers(client.models.llm) == unknown
        assert outside["chat"][0] == 400
        assert json.loads(outside["chat"][1])["error"]["code"] == "model_not_found"
        assert json.loads(outside["v2 infer"][1]) == {"error": "The model `<model>` does not exist."}
        client.assert_nothing_ran()


class TestRefusedPredictionsCountAsRequests:
    """A prediction refused for its tensors still takes its place in the key's per-minute request
    bucket (as the LLM paths' refused prompts do), and a large body pays it before it is decoded:
    a 1-request-a-minute key cannot send refused predictions for free (issue 34, defect 4)."""

    def test_over_rest(self, client, django_db_blocker):
        huge, headers = binary([({**TEXT, "shape": [1]}, bytes_elements(1_000_000))])
        small = {"inputs": [{**TEXT, "shape": [1], "data": [1]}]}
        key = client.key_in_org(django_db_blocker, rate_limit_rpm=1)
        assert_protocol_error(client.infer(client.models.text, small, key=key), 400)
        refused = client.infer(client.models.text, huge, headers=headers, key=key)
        assert_protocol_error(refused, 429)
        assert refused.headers["retry-after"]
        for path, body in ((f"/api/v1/models/{client.models.text}/predict", {"inputs": [[0] * 1_000_000]}),
                           ("/api/v1/predict", {"model": client.models.text, "input": [0] * 1_000_000})):  # fmt: skip
            key = client.key_in_org(django_db_blocker, rate_limit_rpm=1)
            assert_openai_error(client.post(path, {**body, "inputs": [1]} if "inputs" in body else
                                            {**body, "input": 1}, key=key), 400)  # fmt: skip
            assert_openai_error(client.post(path, body, key=key), 429, code="rate_limit_exceeded")
        client.assert_nothing_ran()

    def test_over_grpc(self, client, django_db_blocker):
        key = client.key_in_org(django_db_blocker, rate_limit_rpm=1)
        small = grpc_request(client.models.text, [({**TEXT, "shape": [1]}, None)], int_contents=[1])
        client.grpc_refused(small, grpc.StatusCode.INVALID_ARGUMENT, key=key)
        huge = grpc_request(client.models.text, [({**TEXT, "shape": [1]}, bytes_elements(1_000_000))])
        client.grpc_refused(huge, grpc.StatusCode.RESOURCE_EXHAUSTED, key=key)
        client.assert_nothing_ran()
