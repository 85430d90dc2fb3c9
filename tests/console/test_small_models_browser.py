"""The small models' pages in real Chromium, against the real digits worker: a member draws a
digit on the "try it" grid and gets the model's prediction (metered to their playground
key, by the item); the admin's version page shows the signature, the batcher and the batches
its worker formed; the quickstart shows predict snippets for this server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.browser import log_in, screenshot
from tests.support.gateway import committed
from tests.support.processes import Gateway, start_gateway

pytestmark = [pytest.mark.browser, pytest.mark.engine]

DIGITS = "digits-mlp"
SENTIMENT = "sentiment-minilm"


@pytest.fixture(scope="module")
def gateway(engines, tmp_path_factory) -> Iterator[Gateway]:
    gw = start_gateway(tmp_path_factory.mktemp("small-models-gateway"))
    yield gw
    gw.stop()


@pytest.mark.django_db
def test_the_served_small_models_are_offered_with_what_their_form_needs(gateway):
    from console.pages.playground import served_small_models

    offered = {m.name: m for m in served_small_models()}
    assert {DIGITS, "breast-cancer-gbt"} <= set(offered)
    digits = offered[DIGITS]
    assert digits.try_it == {"kind": "canvas", "input": "pixels", "width": 8, "height": 8, "max": 16}
    assert len(digits.example["pixels"]) == 64
    assert digits.labels == [str(d) for d in range(10)]
    assert offered["breast-cancer-gbt"].try_it is None
    assert offered["breast-cancer-gbt"].labels == ["malignant", "benign"]
    assert offered[SENTIMENT].try_it == {"kind": "text", "input": "text"}
    assert offered[SENTIMENT].labels == ["negative", "positive"]


def draw_a_one(page: Any) -> None:
    """A vertical stroke down the middle of the grid: most of the digits model's mass says 1."""
    box = page.locator("#pd-canvas").bounding_box()
    x = box["x"] + box["width"] * 0.5
    page.mouse.move(x, box["y"] + box["height"] * 0.1)
    page.mouse.down()
    for step in range(1, 21):
        page.mouse.move(x, box["y"] + box["height"] * (0.1 + 0.04 * step))
    page.mouse.up()


def test_a_member_draws_a_digit_and_gets_a_prediction(gateway, chromium, committed_users, django_db_blocker):
    users = committed_users
    page = chromium.new_context().new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    log_in(page, gateway.base_url, users["org_member"].username)
    page.goto(f"{gateway.base_url}/portal/{users['org'].pk}/predict/")
    page.select_option("#pd-model", DIGITS)
    assert page.locator("#pd-canvas").is_visible()
    draw_a_one(page)
    page.click("#pd-send")
    page.wait_for_function("document.querySelector('#pd-prediction').textContent !== '—'", timeout=60_000)
    prediction = page.locator("#pd-prediction").inner_text()
    assert prediction in [str(d) for d in range(10)]
    assert page.locator("#pd-confidence").inner_text().endswith("%")
    assert page.locator(".pd-bar").count() == 10
    screenshot(page, "small-models-try-it")

    # The tabular model takes a field per feature (named by what it measures), prefilled with
    # a held-out example; its JSON is folded away (issue 40, item 9).
    page.select_option("#pd-model", "breast-cancer-gbt")
    fields = page.locator("#pd-features input")
    assert fields.count() == 30
    assert not page.locator("#pd-instance").is_visible()
    assert "mean radius" in page.locator("#pd-features label").first.inner_text()
    assert fields.first.input_value() != ""
    page.click("#pd-send")
    page.wait_for_function("document.querySelector('#pd-prediction').textContent !== '—'", timeout=60_000)
    assert page.locator("#pd-prediction").inner_text() in ("malignant", "benign")
    # The code for this very request, as the customer would send it with a key of theirs.
    page.click("#pd-code summary")
    curl = page.locator("#pd-code-curl").inner_text()
    assert f"{gateway.base_url}/api/v1/models/breast-cancer-gbt/predict" in curl
    assert fields.first.input_value() in curl
    assert 'httpclient.InferInput("features", list(rows.shape), "FP32")' in page.locator("#pd-code-triton").inner_text()
    screenshot(page, "small-models-tabular")

    # A field left empty is explained, not sent.
    fields.nth(3).fill("")
    page.click("#pd-send")
    page.wait_for_selector("#pd-error:not([hidden])")
    assert "needs a number" in page.locator("#pd-error").inner_text()

    # A CSV of rows: one request, a table of answers; a row of the wrong width is explained.
    row = ",".join(["1"] * 30)
    page.set_input_files("#pd-csv", files=[{"name": "rows.csv", "mimeType": "text/csv",
                                            "buffer": f"{'a,' * 29}a\n{row}\n{row}\n".encode()}])  # fmt: skip
    page.wait_for_selector("#pd-rows:not([hidden])")
    assert page.locator("#pd-rows-table tbody tr").count() == 2
    page.set_input_files("#pd-csv", files=[{"name": "bad.csv", "mimeType": "text/csv", "buffer": b"1,2\n"}])
    page.wait_for_selector("#pd-error:not([hidden])")
    assert "the model takes 30 numbers a row" in page.locator("#pd-error").inner_text()

    # A bad instance typed as JSON is explained, not thrown.
    page.click("#pd-json-panel summary")
    page.fill("#pd-instance", '{"features": [1, 2]}')
    page.click("#pd-send")
    page.wait_for_selector("#pd-error:not([hidden])")
    assert "'features'" in page.locator("#pd-error").inner_text()
    assert errors == []

    from accounts.models import ApiKey
    from billing.models import UsageRecord
    from billing.usage import persist_usage_stream

    def records() -> list[tuple[str, int, int]]:
        persist_usage_stream()
        keys = ApiKey.objects.filter(organization=users["org"])
        return list(
            UsageRecord.objects.filter(api_key__in=keys, model__in=[DIGITS, "breast-cancer-gbt"])
            .order_by("created_at")
            .values_list("model", "status_code", "inferences")
        )

    assert committed(django_db_blocker, records)[-3:] == [
        (DIGITS, 200, 1), ("breast-cancer-gbt", 200, 1), ("breast-cancer-gbt", 200, 2)
    ]  # fmt: skip

    # The text model takes a sentence in a text box (the seeds' sentiment example).
    page.select_option("#pd-model", SENTIMENT)
    assert page.locator("#pd-text").is_visible()
    assert not page.locator("#pd-instance").is_visible()
    page.fill("#pd-text", "Absolutely wonderful, I loved every minute of it!")
    page.click("#pd-send")
    page.wait_for_function("document.querySelector('#pd-prediction').textContent !== '—'", timeout=60_000)
    assert page.locator("#pd-prediction").inner_text() in ("negative", "positive")
    assert page.locator(".pd-bar").count() == 2
    assert errors == []


def test_the_version_page_shows_signature_batcher_and_batches(gateway, chromium, committed_users, django_db_blocker):
    import httpx

    from accounts.services import api_key_create

    secret = committed(
        django_db_blocker, lambda: api_key_create(organization=committed_users["org"], name="batches").secret
    )
    body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [3, 64], "data": [1.0] * 192}]}
    headers = {"Authorization": f"Bearer {secret}"}
    assert httpx.post(f"{gateway.base_url}/v2/models/{DIGITS}/infer", json=body, headers=headers, timeout=60).is_success
    page = chromium.new_context().new_page()
    log_in(page, gateway.base_url, committed_users["platform_admin"].username)
    page.goto(f"{gateway.base_url}/console/models/{DIGITS}/1/")
    assert page.locator("tr[data-tensor='pixels']").inner_text().split() == ["pixels", "input", "FP32", "[-1,", "64]"]
    assert "64 rows" in page.locator("[data-batcher]").inner_text()
    bars = page.locator("[data-replica-batches] .batch-bar")
    assert bars.count() >= 1
    assert "(on CPU)" in page.locator("[data-replica-batches] h3").first.inner_text()  # where the model ran
    screenshot(page, "small-models-version")


def test_the_quickstart_has_predict_snippets(gateway, chromium, committed_users):
    page = chromium.new_context().new_page()
    log_in(page, gateway.base_url, committed_users["org_member"].username)
    page.goto(f"{gateway.base_url}/portal/{committed_users['org'].pk}/quickstart/")
    snippets = page.locator("#qs-predict-title").locator("xpath=..")
    text = snippets.inner_text()
    assert f"{gateway.base_url}/api/v1/models/" in text
    assert "tritonclient.grpc" in text
