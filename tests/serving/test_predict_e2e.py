"""Small models end to end: the unmodified tritonclient (HTTP) and plain HTTP → the gateway
→ a real predict worker (ONNX Runtime behind the dynamic batcher) started by runworkers
from the bundled digits model, with keys, limits, the result cache and metering."""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.support.gateway import committed, persisted, price_model

pytestmark = [pytest.mark.engine, pytest.mark.django_db]

DIGITS = "digits-mlp"
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


def _records_of_key(key_id: int) -> list[Any]:
    from billing.models import UsageRecord
    from billing.usage import persist_usage_stream

    persist_usage_stream()
    return list(UsageRecord.objects.filter(api_key_id=key_id).order_by("created_at"))
