"""Batch jobs in real Chromium: an org admin sees a batch's progress bar (its succeeded and failed
parts) and an id that never wraps, cancels it after the confirmation, sees a batch completed with
errors in amber, downloads a finished batch's output file, reveals the webhooks' secret, creates a
batch by uploading a file, and finds another organisation's batch and file missing; a platform
admin sees both organisations' batches and the queue on the overview.
Screenshots of each step go under tests/screenshots/."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import log_in, screenshot
from tests.support.gateway import committed
from tests.support.processes import Gateway, start_gateway

pytestmark = pytest.mark.browser

OUTPUT = b'{"id": "batch_req_1", "custom_id": "a", "response": {"status_code": 200}}\n' * 4
# A file uploaded in the portal's form.
REQUESTS = b"".join(
    b'{"custom_id": "q%d", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'
    % i
    for i in range(3)
)
UPLOADED_NAME = "browser_requests.jsonl"


@pytest.mark.django_db
def test_the_batch_pages_are_routed():
    """Also makes pytest-django create the test database when this module runs alone: the
    browser tests below reach the database through committed fixtures only."""
    from django.urls import reverse

    assert reverse("console:portal-batches", kwargs={"org_id": 3}) == "/portal/3/batches/"
    assert reverse("console:batches") == "/console/batches/"


@pytest.fixture(scope="module")
def artifact_store(tmp_path_factory) -> Iterator[Path]:
    """The files' bytes in a store of this module's own, which the gateway reads too."""
    from django.conf import settings

    from registry import artifacts

    previous = settings.ARTIFACT_STORE
    root = tmp_path_factory.mktemp("batch-files")
    settings.ARTIFACT_STORE = {"BACKEND": "registry.artifacts.LocalArtifactStore", "OPTIONS": {"root": str(root)}}
    artifacts.get_artifact_store.cache_clear()
    yield root
    settings.ARTIFACT_STORE = previous
    artifacts.get_artifact_store.cache_clear()


@pytest.fixture(scope="module")
def console_gateway(django_db_setup, artifact_store, tmp_path_factory) -> Iterator[Gateway]:
    gw = start_gateway(tmp_path_factory.mktemp("batches-gateway"))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def batches(committed_users, artifact_store, django_db_blocker) -> Iterator[dict[str, Any]]:
    """Committed: the organisation's batch in progress (7 of 10 lines done, 1 failed), a
    completed one with an output file and one completed with 3 of its 4 lines failed; another
    organisation's batch in progress, with a file."""
    from accounts.services import api_key_create
    from serving.models import Batch, BatchLine, StoredFile
    from tests.support.batches import batch, stored_file

    org, other_org = committed_users["org"], committed_users["other_org"]

    def create() -> dict[str, Any]:
        key = api_key_create(organization=org, name="batch pages").api_key
        other_key = api_key_create(organization=other_org, name="their batches").api_key
        output = stored_file(org, OUTPUT, purpose="batch_output", filename="nightly_output.jsonl")
        their_file = stored_file(other_org, b'{"custom_id": "x"}\n')
        theirs = batch(
            other_org, other_key, lines={"succeeded": 1, "pending": 4}, input_file=their_file,
            input_file_public_id=their_file.public_id,
        )  # fmt: skip
        mixed = batch(org, key, status="completed", lines={"succeeded": 1, "failed": 3}, completed=1, failed=3)
        BatchLine.objects.filter(batch=mixed, status="failed").update(
            error={"code": "engine_timeout", "message": "The engine did not answer in time."}
        )
        return {
            "keys": [key, other_key],
            "mixed": mixed,
            "done": batch(org, key, status="completed", lines={"succeeded": 4}, completed=4, output_file=output),
            "running": batch(org, key, lines={"succeeded": 6, "failed": 1, "pending": 3}),
            "theirs": theirs,
            "output": output,
            "their_file": their_file,
        }

    made = committed(django_db_blocker, create)
    yield made

    def remove() -> None:
        Batch.objects.filter(pk__in=[made[name].pk for name in ("done", "running", "mixed", "theirs")]).delete()
        Batch.objects.filter(organization=org, input_file__filename=UPLOADED_NAME).delete()  # made in the portal
        StoredFile.objects.filter(pk__in=[made["output"].pk, made["their_file"].pk]).delete()
        StoredFile.objects.filter(organization=org, filename=UPLOADED_NAME).delete()
        for key in made["keys"]:
            key.delete()

    committed(django_db_blocker, remove)


def test_an_org_admin_follows_a_batch_cancels_it_and_downloads_a_result(
    committed_users, batches, console_gateway, chromium
):
    base = console_gateway.base_url
    org = committed_users["org"]
    running, done, theirs = batches["running"], batches["done"], batches["theirs"]
    context = chromium.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    page = context.new_page()
    try:
        log_in(page, base, committed_users["org_admin"].username)
        page.goto(f"{base}/portal/{org.pk}/batches/")
        nav = page.locator("nav[aria-label=Portal]")
        assert nav.get_by_role("link", name="Batches", exact=True).get_attribute("aria-current") == "page"
        row = page.locator(f"tr#{running.public_id}")
        bar = row.get_by_role("progressbar")
        assert (bar.get_attribute("aria-valuenow"), bar.get_attribute("aria-valuemax")) == ("7", "10")
        width = "e => e.clientWidth"
        succeeded = row.locator(".lines-succeeded").evaluate(width)
        failed = row.locator(".lines-failed").evaluate(width)
        assert succeeded > 5 * failed > 0  # 6 succeeded, 1 failed
        assert "7 of 10" in row.inner_text()
        assert "1 failed" in row.inner_text()
        assert "In Progress" in row.inner_text()
        assert "left" in row.inner_text()  # the time left of a batch that runs
        assert row.get_by_role("button", name=f"Cancel batch {running.public_id}").count() == 1
        assert page.locator(f"tr#{done.public_id}").get_by_role("button").count() == 0
        assert page.locator(f"tr#{theirs.public_id}").count() == 0
        screenshot(page, "batches-01-portal-list")
        page.set_viewport_size({"width": 390, "height": 844})  # at phone width the table scrolls, not the page
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
        batch_id = row.locator("code.batch-id")
        height = (batch_id.bounding_box() or {"height": 0})["height"]
        assert 0 < height < 1.6 * float(batch_id.evaluate("e => parseFloat(getComputedStyle(e).fontSize)"))
        page.set_viewport_size({"width": 1280, "height": 900})

        # Its page, then Cancel, which asks first: it stops taking lines.
        row.get_by_role("link", name=running.public_id).click()
        page.wait_for_selector(f"h1:has-text('{running.public_id}')")
        screenshot(page, "batches-02-portal-detail")
        page.set_viewport_size({"width": 390, "height": 844})  # the id in the heading ends in an ellipsis
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
        screenshot(page, "batches-02-portal-detail-phone")
        page.set_viewport_size({"width": 1280, "height": 900})
        page.get_by_role("button", name="Cancel batch").click()
        page.wait_for_selector(f"h1:has-text('Cancel batch {running.public_id}')")
        assert "7 of 10 lines have run" in page.inner_text("main")
        screenshot(page, "batches-03-cancel-confirm")
        page.get_by_role("button", name="Cancel batch").click()
        page.wait_for_selector(".message-success")
        assert "is cancelling" in page.inner_text(".messages")
        assert page.inner_text("#batch-status") == "Cancelling"
        assert page.get_by_role("button", name="Cancel batch").count() == 0
        screenshot(page, "batches-04-cancelled")

        # The finished one's output file downloads as it was stored.
        page.goto(f"{base}/portal/{org.pk}/batches/{done.public_id}/")
        with page.expect_download() as info:
            page.get_by_role("link", name="nightly_output.jsonl").click()
        download = info.value
        assert download.suggested_filename == "nightly_output.jsonl"
        assert Path(download.path()).read_bytes() == OUTPUT

        # One that ran to its end with failed lines says so, in amber, with its errors counted.
        page.goto(f"{base}/portal/{org.pk}/batches/{batches['mixed'].public_id}/")
        badge = page.locator("#batch-status")
        assert badge.inner_text() == "Completed with errors"
        assert badge.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(253, 243, 225)"
        assert "engine_timeout" in page.inner_text("#batch-line-errors")
        screenshot(page, "batches-05-completed-with-errors")

        # Another organisation's batch and file are not found, under this organisation or theirs.
        for path in (
            f"/portal/{org.pk}/batches/{theirs.public_id}/",
            f"/portal/{org.pk}/files/{batches['their_file'].public_id}/",
            f"/portal/{committed_users['other_org'].pk}/batches/{theirs.public_id}/",
        ):
            assert page.request.get(f"{base}{path}").status == 404, path

        # The webhooks' secret, masked until shown.
        page.get_by_role("link", name="Webhooks", exact=True).first.click()
        secret = page.locator("#webhook-secret")
        assert secret.get_attribute("type") == "password"
        assert (secret.input_value() or "").startswith("whsec_")
        page.get_by_role("button", name="Show").click()
        assert secret.get_attribute("type") == "text"
        assert "Webhook-Signature" in page.inner_text("#verify-how")
        screenshot(page, "batches-06-webhooks")

        # A new batch from the portal: the file uploaded, the endpoint picked; its page follows it.
        page.goto(f"{base}/portal/{org.pk}/batches/")
        page.get_by_role("link", name="Create batch").click()
        page.set_input_files(
            "#id_file", files=[{"name": UPLOADED_NAME, "mimeType": "application/jsonl", "buffer": REQUESTS}]
        )
        page.select_option("#id_endpoint", "/v1/chat/completions")
        screenshot(page, "batches-07-create")
        page.get_by_role("button", name="Create batch").click()
        page.wait_for_selector(".message-success")
        assert "its 3 lines are being validated" in page.inner_text(".messages")
        assert page.locator("h1 code.batch-id").inner_text().startswith("batch_")
        screenshot(page, "batches-08-created")
    except Exception:
        screenshot(page, "batches-failure")
        raise
    finally:
        context.close()


def test_a_platform_admin_sees_every_organisations_batches_and_the_queue(
    committed_users, batches, console_gateway, chromium
):
    base = console_gateway.base_url
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    try:
        log_in(page, base, committed_users["platform_admin"].username)
        page.goto(f"{base}/console/batches/")
        for name, org in (("done", "org"), ("theirs", "other_org")):
            row = page.locator(f"tr#{batches[name].public_id}")
            assert committed_users[org].name in row.inner_text()
        screenshot(page, "batches-09-console-list")
        page.select_option("#id_status", "completed")
        page.get_by_role("button", name="Filter").click()
        page.wait_for_url("**status=completed**")
        assert page.locator(f"tr#{batches['done'].public_id}").count() == 1
        assert page.locator(f"tr#{batches['theirs'].public_id}").count() == 0

        page.get_by_role("link", name="Overview", exact=True).click()
        card = page.locator("#batch-queue")
        card.wait_for()
        assert int(card.locator("[data-batch-queue=waiting]").inner_text()) >= 4  # theirs, still to run
        assert int(card.locator("[data-batch-queue=in_progress]").inner_text()) >= 1
        assert float(card.locator("[data-batch-queue=per_minute]").inner_text()) > 0  # lines finished just now
        screenshot(page, "batches-10-overview-queue")
    except Exception:
        screenshot(page, "batches-failure-console")
        raise
    finally:
        context.close()
