"""Small models end to end: the unmodified tritonclient (HTTP and gRPC) and plain HTTP → the
gateway (or ``rungrpc``) → a real predict worker (ONNX Runtime behind the dynamic batcher)
started by runworkers from the bundled digits model, with keys, limits, the result cache
and metering."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.support.gateway import committed, persisted, price_model
from tests.support.processes import child_env, free_port, start_process, stop_process

pytestmark = [pytest.mark.engine, pytest.mark.django_db]

DIGITS = "digits-mlp"
SENTIMENT = "sentiment-minilm"
PER_THOUSAND = Decimal("0.05")
CACHED_PER_THOUSAND = Decimal("0.01")


@pytest.fixture(scope="module")
def digits_priced(engines, django_db_blocker):
    from billing.models import Price

    def price() -> None:
        if not Price.objects.filter(model__name=DIGITS, per_thousand_inferences=PER_THOUSAND).exists():
            price_model(
                DIGITS, input_per_million="0", output_per_million="0",
                per_thousand_inferences=PER_THOUSAND, cached_per_thousand_inferences=CACHED_PER_THOUSAND,
            )  # fmt: skip

    committed(django_db_blocker, price)
    time.sleep(0.5)  # gateways reload prices on the routing channel


def digits(rows: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data[offset : offset + rows].astype(np.float32), data.target[offset : offset + rows]


def client(gateway) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(gateway.base_url.removeprefix("http://"), network_timeout=60)


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def grpc_auth(secret: str) -> dict[str, str]:
    """gRPC metadata keys are lower case (grpcio refuses others)."""
    return {"authorization": f"Bearer {secret}"}


def infer(gateway, secret: str, pixels: np.ndarray, *, binary: bool = True, **kwargs):
    tensor = triton.InferInput("pixels", list(pixels.shape), "FP32")
    tensor.set_data_from_numpy(pixels, binary_data=binary)
    return client(gateway).infer(DIGITS, [tensor], headers=auth(secret), **kwargs)


class TestOpenInferenceProtocolOverHttp:
    def test_server_and_model_metadata(self, gateway, api_key):
        c = client(gateway)
        assert c.is_server_live()
        assert c.is_server_ready()
        assert c.is_model_ready(DIGITS, headers=auth(api_key.secret))
        meta = c.get_model_metadata(DIGITS, headers=auth(api_key.secret))
        assert meta["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}]
        assert {o["name"] for o in meta["outputs"]} == {"label", "probabilities"}
        with pytest.raises(InferenceServerException):
            c.get_model_metadata(DIGITS)  # no key

    def test_binary_predictions_are_the_models_and_metered_by_the_item(self, gateway, api_key, digits_priced):
        pixels, truth = digits(8)
        result = infer(gateway, api_key.secret, pixels)
        labels = result.as_numpy("label")
        probabilities = result.as_numpy("probabilities")
        assert labels.shape == (8,)
        assert probabilities.shape == (8, 10)
        assert (labels == truth).mean() >= 0.75  # a real classifier (96.9 % on held-out digits)
        np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-4)
        assert (labels == probabilities.argmax(axis=1)).all()
        assert "id" not in result.get_response()  # no id asked, none echoed
        records = _records_of_key(api_key.key_id)
        assert len(records) == 1
        record = records[0]
        assert (record.status_code, record.model, record.inferences, record.cache) == (200, DIGITS, 8, "miss")
        assert record.cost == 8 * PER_THOUSAND / 1000

    def test_json_tensors_and_requested_outputs(self, gateway, api_key):
        pixels, _ = digits(3, offset=40)
        binary = infer(gateway, api_key.secret, pixels)
        result = infer(
            gateway, api_key.secret, pixels, binary=False,
            outputs=[triton.InferRequestedOutput("label", binary_data=False)], request_id="mine-1",
        )  # fmt: skip
        response = result.get_response()
        assert [o["name"] for o in response["outputs"]] == ["label"]
        assert response["id"] == "mine-1"
        assert response["model_name"] == DIGITS
        np.testing.assert_array_equal(result.as_numpy("label"), binary.as_numpy("label"))

    def test_the_same_inputs_are_answered_from_the_result_cache_billed_as_cached(self, gateway, api_key, digits_priced):
        pixels, _ = digits(2, offset=100)
        body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [2, 64], "data": pixels.tolist()}]}
        url = f"{gateway.base_url}/v2/models/{DIGITS}/infer"
        first = httpx.post(url, json=body, headers=auth(api_key.secret), timeout=60)
        second = httpx.post(url, json=body, headers=auth(api_key.secret), timeout=60)
        assert (first.status_code, second.status_code) == (200, 200)
        assert (first.headers["x-cache"], second.headers["x-cache"]) == ("miss", "hit")
        assert first.json()["outputs"] == second.json()["outputs"]
        records = persisted([first.headers["x-request-id"], second.headers["x-request-id"]])
        hit = records[second.headers["x-request-id"]]
        assert (hit.cache, hit.inferences, hit.cost) == ("hit", 2, 2 * CACHED_PER_THOUSAND / 1000)

    def test_a_tensor_that_does_not_fit_is_refused_naming_it_and_never_charged(self, gateway, api_key):
        url = f"{gateway.base_url}/v2/models/{DIGITS}/infer"
        cases = {
            "wrong shape": {"name": "pixels", "datatype": "FP32", "shape": [1, 63], "data": [0.0] * 63},
            "wrong dtype": {"name": "pixels", "datatype": "INT32", "shape": [1, 64], "data": [0] * 64},
            "wrong name": {"name": "image", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64},
            "too few values": {"name": "pixels", "datatype": "FP32", "shape": [2, 64], "data": [0.0] * 64},
        }
        for case, tensor in cases.items():
            response = httpx.post(url, json={"inputs": [tensor]}, headers=auth(api_key.secret), timeout=30)
            assert response.status_code == 400, case
            assert set(response.json()) == {"error"}, case
            assert repr(tensor["name"]) in response.json()["error"], case
        with pytest.raises(InferenceServerException) as excinfo:
            infer(gateway, api_key.secret, np.zeros((1, 32), dtype=np.float32))
        assert "pixels" in str(excinfo.value)
        assert _records_of_key(api_key.key_id) == []

    def test_a_pinned_version_and_an_unknown_one(self, gateway, api_key):
        pixels, _ = digits(1)
        tensor = triton.InferInput("pixels", [1, 64], "FP32")
        tensor.set_data_from_numpy(pixels)
        result = client(gateway).infer(DIGITS, [tensor], model_version="1", headers=auth(api_key.secret))
        assert result.get_response()["model_version"] == "1"
        with pytest.raises(InferenceServerException) as excinfo:
            client(gateway).infer(DIGITS, [tensor], model_version="9", headers=auth(api_key.secret))
        assert "no version `9`" in str(excinfo.value)

    def test_limits_apply(self, gateway, make_api_key):
        key = make_api_key(rate_limit_rpm=1)
        pixels, _ = digits(1)
        infer(gateway, key.secret, pixels)
        with pytest.raises(InferenceServerException) as excinfo:
            infer(gateway, key.secret, pixels)
        assert excinfo.value.status() == "429"

    def test_an_llm_is_not_served_over_the_protocol(self, gateway, api_key):
        response = httpx.get(
            f"{gateway.base_url}/v2/models/smollm2-135m-instruct", headers=auth(api_key.secret), timeout=30
        )
        assert response.status_code == 400
        assert "LLM" in response.json()["error"]


@pytest.fixture(scope="module")
def grpc_address(engines, tmp_path_factory) -> Iterator[str]:
    """``manage.py rungrpc`` on the test database, as runplatform starts it."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("grpc") / "rungrpc.log"
    with open(log_path, "wb") as log:
        process = start_process(
            [sys.executable, "manage.py", "rungrpc", "--port", str(port)],
            env=child_env(), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if triton_grpc.InferenceServerClient(address).is_server_live():
                break
        except InferenceServerException:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"rungrpc did not start:\n{log_path.read_text()}")
        time.sleep(0.3)
    yield address
    stop_process(process)


class TestOpenInferenceProtocolOverGrpc:
    def test_metadata_readiness_and_keys(self, grpc_address, api_key):
        c = triton_grpc.InferenceServerClient(grpc_address)
        assert c.is_server_ready()
        assert c.get_server_metadata().name == "inference-platform"
        assert c.is_model_ready(DIGITS, headers=grpc_auth(api_key.secret))
        meta = c.get_model_metadata(DIGITS, headers=grpc_auth(api_key.secret), as_json=True)
        assert meta["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": ["-1", "64"]}]
        with pytest.raises(InferenceServerException) as excinfo:
            c.get_model_metadata(DIGITS)
        assert excinfo.value.status() == "StatusCode.UNAUTHENTICATED"

    def test_predictions_match_http_and_are_metered(self, grpc_address, gateway, api_key, digits_priced):
        pixels, _ = digits(5, offset=500)
        tensor = triton_grpc.InferInput("pixels", [5, 64], "FP32")
        tensor.set_data_from_numpy(pixels)
        c = triton_grpc.InferenceServerClient(grpc_address)
        result = c.infer(DIGITS, [tensor], headers=grpc_auth(api_key.secret))
        over_http = infer(gateway, api_key.secret, pixels)
        np.testing.assert_array_equal(result.as_numpy("label"), over_http.as_numpy("label"))
        np.testing.assert_allclose(result.as_numpy("probabilities"), over_http.as_numpy("probabilities"))
        records = _records_of_key(api_key.key_id)
        assert [(r.inferences, r.status_code) for r in records] == [(5, 200), (5, 200)]
        assert records[0].cost == 5 * PER_THOUSAND / 1000

    def test_errors_are_grpc_statuses(self, grpc_address, api_key):
        c = triton_grpc.InferenceServerClient(grpc_address)
        wrong = triton_grpc.InferInput("pixels", [1, 60], "FP32")
        wrong.set_data_from_numpy(np.zeros((1, 60), dtype=np.float32))
        with pytest.raises(InferenceServerException) as excinfo:
            c.infer(DIGITS, [wrong], headers=grpc_auth(api_key.secret))
        assert excinfo.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "'pixels'" in excinfo.value.message()
        with pytest.raises(InferenceServerException) as excinfo:
            c.infer("no-such-model", [wrong], headers=grpc_auth(api_key.secret))
        assert excinfo.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert _records_of_key(api_key.key_id) == []


class TestSeedShapes:
    def test_model_predict_with_instances(self, gateway, api_key):
        pixels, truth = digits(4, offset=200)
        response = httpx.post(
            f"{gateway.base_url}/api/v1/models/{DIGITS}/predict",
            json={"inputs": [{"pixels": row} for row in pixels.tolist()], "params": {"version": "1"}},
            headers=auth(api_key.secret),
            timeout=60,
        )
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["model"] == DIGITS
        assert data["model_version"] == "1"
        assert len(data["predictions"]) == 4
        assert sum(p["prediction"] == str(t) for p, t in zip(data["predictions"], truth, strict=True)) >= 3
        assert all(0 < p["confidence"] <= 1 for p in data["predictions"])
        assert data["latency_ms"] > 0

    def test_predict_one_input(self, gateway, api_key):
        pixels, _ = digits(1, offset=300)
        response = httpx.post(
            f"{gateway.base_url}/api/v1/predict",
            json={"model": DIGITS, "input": {"pixels": pixels[0].tolist()}},
            headers=auth(api_key.secret),
            timeout=60,
        )
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["prediction"] in [str(d) for d in range(10)]
        assert 0 < data["confidence"] <= 1
        bad = httpx.post(
            f"{gateway.base_url}/api/v1/predict",
            json={"model": DIGITS, "input": {"pixel": [0] * 64}},
            headers=auth(api_key.secret),
            timeout=60,
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_tensor"
        assert "'pixel'" in bad.json()["error"]["message"]


class TestTextModel:
    """The bundled sentiment model: a tokenizer step in the worker, strings over every API."""

    SENTENCES = [
        "This product is amazing, it works perfectly and I love it!",
        "Terrible service, rude staff and my order arrived broken.",
        "Best holiday we have had in years, everything was lovely.",
        "A complete waste of money, it stopped working after two days.",
    ]
    TRUTH = ["positive", "negative", "positive", "negative"]

    def test_the_seeds_sentiment_example(self, gateway, api_key):
        answers = [
            httpx.post(
                f"{gateway.base_url}/api/v1/predict", json={"model": SENTIMENT, "input": {"text": sentence}},
                headers=auth(api_key.secret), timeout=60,
            )
            for sentence in self.SENTENCES
        ]  # fmt: skip
        assert all(a.status_code == 200 for a in answers), answers[0].text
        data = [a.json() for a in answers]
        assert all(d["prediction"] in ("negative", "positive") and 0.5 <= d["confidence"] <= 1 for d in data)
        assert sum(d["prediction"] == t for d, t in zip(data, self.TRUTH, strict=True)) >= 3
        assert [r.inferences for r in _records_of_key(api_key.key_id)] == [1, 1, 1, 1]

    def test_tritonclient_sends_strings_over_http_and_grpc(self, gateway, grpc_address, api_key):
        texts = np.array([s.encode() for s in self.SENTENCES], dtype=np.object_)
        over_http = triton.InferInput("text", [len(texts)], "BYTES")
        over_http.set_data_from_numpy(texts)
        http_answer = client(gateway).infer(SENTIMENT, [over_http], headers=auth(api_key.secret))
        over_grpc = triton_grpc.InferInput("text", [len(texts)], "BYTES")
        over_grpc.set_data_from_numpy(texts)
        grpc_answer = triton_grpc.InferenceServerClient(grpc_address).infer(
            SENTIMENT, [over_grpc], headers=grpc_auth(api_key.secret)
        )
        np.testing.assert_array_equal(http_answer.as_numpy("label"), grpc_answer.as_numpy("label"))
        np.testing.assert_allclose(http_answer.as_numpy("probabilities"), grpc_answer.as_numpy("probabilities"))
        assert http_answer.as_numpy("probabilities").shape == (4, 2)
        numbers = triton.InferInput("text", [1], "FP32")
        numbers.set_data_from_numpy(np.zeros(1, dtype=np.float32))
        with pytest.raises(InferenceServerException, match="'text'"):
            client(gateway).infer(SENTIMENT, [numbers], headers=auth(api_key.secret))


def _records_of_key(key_id: int) -> list[Any]:
    from billing.models import UsageRecord
    from billing.usage import persist_usage_stream

    persist_usage_stream()
    return list(UsageRecord.objects.filter(api_key_id=key_id).order_by("created_at"))


class TestWorkerCrash:
    def test_a_killed_worker_is_restarted_and_what_failed_meanwhile_is_metered_free(
        self, gateway, api_key, django_db_blocker
    ):
        import os
        import signal

        from registry.models import Replica

        def replica() -> tuple[int, int]:
            row = (
                Replica.objects.filter(deployment__version__model__name=DIGITS, state="ready")
                .values_list("id", "pid")
                .first()
            )
            assert row is not None
            return row[0], int(row[1] or 0)

        replica_id, pid = committed(django_db_blocker, replica)
        os.kill(pid, signal.SIGKILL)
        rng = np.random.default_rng(7)
        url = f"{gateway.base_url}/v2/models/{DIGITS}/infer"
        statuses: list[tuple[int, str]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            data = rng.uniform(0, 16, size=64).tolist()  # never the same: the result cache cannot answer
            body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": data}]}
            response = httpx.post(url, json=body, headers=auth(api_key.secret), timeout=60)
            statuses.append((response.status_code, response.headers["x-request-id"]))
            if response.status_code == 200 and len(statuses) > 1:
                break
            assert response.status_code in (502, 503), response.text  # an error at once, never a hang
            time.sleep(0.5)
        assert statuses[-1][0] == 200
        assert statuses[0][0] in (502, 503)
        new_id, new_pid = committed(django_db_blocker, replica)
        assert new_id == replica_id
        assert new_pid != pid
        failed = [request_id for status, request_id in statuses if status != 200]
        records = persisted(failed)
        assert all((r.inferences, r.cost) == (0, 0) for r in records.values())


class TestInferencesPerMinute:
    def test_a_key_is_limited_by_the_item(self, gateway, make_api_key):
        key = make_api_key(rate_limit_rpm=1000, rate_limit_ipm=10)
        url = f"{gateway.base_url}/v2/models/{DIGITS}/infer"

        def send(rows: int, seed: int) -> httpx.Response:
            data = np.random.default_rng(seed).uniform(0, 16, size=64 * rows).tolist()
            body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [rows, 64], "data": data}]}
            return httpx.post(url, json=body, headers=auth(key.secret), timeout=60)

        first = send(8, 1)
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-inferences"] == "10"
        assert int(first.headers["x-ratelimit-remaining-inferences"]) in (2, 3)  # refilled a little meanwhile
        refused = send(8, 2)
        assert refused.status_code == 429
        assert "inferences per minute" in refused.json()["error"]
        too_large = send(11, 3)
        assert too_large.status_code == 429
        assert "Send fewer items" in too_large.json()["error"]
