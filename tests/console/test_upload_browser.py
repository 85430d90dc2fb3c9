"""Uploading an artifact in real Chromium: a folder goes up with a progress bar that reaches
100 %, and the version is registered with the checksum of the folder's files."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support.browser import log_in, screenshot

# No `db` fixture: playwright's sync API runs an event loop in this thread, where Django
# refuses ORM calls; data is read and removed from a worker thread.
pytestmark = pytest.mark.browser
T = TypeVar("T")


def off_the_loop(django_db_blocker: Any, work: Callable[[], T]) -> T:
    from django.db import connection

    def run() -> T:
        try:
            return work()
        finally:
            connection.close()

    with django_db_blocker.unblock(), ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    """A model folder with a subfolder and a few megabytes, so the upload takes a few progress events."""
    root = tmp_path / "picked-model"
    (root / "weights").mkdir(parents=True)
    (root / "config.json").write_text('{"max_position_embeddings": 128}')
    (root / "weights" / "model.safetensors").write_bytes(bytes(range(256)) * 16_384)  # 4 MiB
    return root


@pytest.fixture
def upload_name(django_db_blocker: Any) -> Iterator[str]:
    name = f"uploaded-{uuid.uuid4().hex[:6]}"
    yield name

    def remove() -> None:
        from registry.models import Model, ModelVersion

        ModelVersion.objects.filter(model__name=name).delete()  # versions protect their model
        Model.objects.filter(name=name).delete()

    off_the_loop(django_db_blocker, remove)


def test_an_admin_uploads_a_folder_and_sees_it_registered(
    committed_users: dict[str, Any],
    console_gateway: Any,
    chromium: Any,
    model_folder: Path,
    upload_name: str,
    django_db_blocker: Any,
) -> None:
    from registry.artifacts import directory_digest

    sha256, size = directory_digest(model_folder)
    page = chromium.new_page(viewport={"width": 1280, "height": 900})
    log_in(page, console_gateway.base_url, committed_users["platform_admin"].username)
    page.goto(f"{console_gateway.base_url}/console/models/")
    page.click("a:has-text('Upload an artifact')")
    page.wait_for_selector("h1:has-text('uploading its artifact')")

    # Nothing chosen: a clear error, and nothing sent.
    page.fill("#id_name", upload_name)
    page.fill("#id_version", "1")
    page.click("#upload-submit")
    page.wait_for_selector("#upload-errors:not([hidden])")
    assert "Choose a folder" in page.locator("#upload-errors").inner_text()
    screenshot(page, "console-upload-nothing-chosen")

    page.set_input_files("#id_folder", str(model_folder))
    assert "2 files" in page.locator("#upload-picked").inner_text()
    page.click("#upload-submit")
    page.wait_for_selector("#upload-result:not([hidden])", timeout=60_000)
    assert page.eval_on_selector("#upload-bar", "bar => bar.value") == 100
    assert page.locator("#upload-percent").inner_text() == "100 %"
    assert sha256 in page.locator("#upload-result").inner_text()
    screenshot(page, "console-upload-done")

    page.wait_for_url(f"**/console/models/{upload_name}/1/", timeout=10_000)
    assert page.locator("[data-checksum]").inner_text().strip() == sha256
    assert sha256 in page.locator(".message-success").inner_text()
    screenshot(page, "console-upload-registered")

    def registered() -> tuple[str, int, str]:
        from registry.models import ModelVersion

        version = ModelVersion.objects.get(model__name=upload_name, version="1")
        return version.artifact_sha256, version.artifact_size, version.artifact_uri

    assert off_the_loop(django_db_blocker, registered) == (sha256, size, f"local://{upload_name}/1")

    # At phone width the form still fits.
    page.goto(f"{console_gateway.base_url}/console/models/upload/")
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(200)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    screenshot(page, "console-upload-phone")
    page.close()


def test_the_cache_page_draws_its_chart_and_fits_a_phone(
    committed_users: dict[str, Any], console_gateway: Any, chromium: Any
) -> None:
    page = chromium.new_page(viewport={"width": 1280, "height": 900})
    log_in(page, console_gateway.base_url, committed_users["platform_admin"].username)
    page.click("nav[aria-label=Console] a:has-text('Cache')")
    page.wait_for_selector("h1:has-text('Semantic cache')")
    page.wait_for_selector("#cache-hit-rate-chart .main-svg")
    screenshot(page, "console-cache")
    page.click("a:has-text('Policies per model')")
    # Other tests commit models of their own: find it through the filter, as a person would.
    page.fill("#id_q", "smollm2")
    page.click("form.filters button[type=submit]")
    page.wait_for_selector("tr[data-model='smollm2-135m-instruct']")
    screenshot(page, "console-cache-policies")
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{console_gateway.base_url}/console/cache/")
    page.wait_for_selector("#cache-hit-rate-chart .main-svg")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    screenshot(page, "console-cache-phone")
    page.close()
