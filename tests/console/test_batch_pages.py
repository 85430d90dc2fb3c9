"""Batch jobs in the portal and the console, with Django's test client: progress and the time
left, cancel (and why a finished batch cannot be), file downloads kept to their organisation,
the webhooks' secret for admins only, every organisation's batches and the queue's figures."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import ApiKey, Membership, Organization, Role
from accounts.services import api_key_create, organization_create, organization_webhook_secret
from console.pages.batches import duration_text, seconds_left
from serving.batches.selectors import batch_queue_stats
from serving.batches.services import estimated_seconds
from serving.models import Batch, WebhookDelivery
from tests.support.batches import batch, stored_file

pytestmark = pytest.mark.django_db

PASSWORD = "pw-batches-123456"


@dataclass
class World:
    org: Organization
    other_org: Organization
    admin: Any
    member: Any
    outsider: Any
    platform_admin: Any
    key: ApiKey
    other_key: ApiKey

    def client(self, who: str) -> Client:
        client = Client()
        client.force_login(getattr(self, who))
        return client


@pytest.fixture
def world(store) -> World:
    users = get_user_model().objects
    org, other_org = organization_create(name="Alice Corp"), organization_create(name="Bob Corp")
    made = {
        "admin": users.create_user(username="alice-admin", password=PASSWORD),
        "member": users.create_user(username="alice-member", password=PASSWORD),
        "outsider": users.create_user(username="bob-admin", password=PASSWORD),
        "platform_admin": users.create_superuser(username="ml-team", password=PASSWORD),
    }
    Membership.objects.create(user=made["admin"], organization=org, role=Role.ORG_ADMIN)
    Membership.objects.create(user=made["member"], organization=org, role=Role.ORG_MEMBER)
    Membership.objects.create(user=made["outsider"], organization=other_org, role=Role.ORG_ADMIN)
    key = api_key_create(organization=org, name="production").api_key
    other_key = api_key_create(organization=other_org, name="bob's key").api_key
    return World(org=org, other_org=other_org, key=key, other_key=other_key, **made)


def url(name: str, org: Organization, **kwargs: str) -> str:
    return reverse(f"console:{name}", kwargs={"org_id": org.pk, **kwargs})


def downloaded(response: Any) -> bytes:
    """A streamed download's bytes (the view streams asynchronously, as the gateway serves it)."""

    async def read() -> bytes:
        return b"".join([chunk async for chunk in response.streaming_content])

    return async_to_sync(read)()


class TestThePortalsBatches:
    def test_members_see_the_batches_newest_first_with_live_progress_and_time_left(self, world):
        done = batch(world.org, world.key, status="completed", lines={"succeeded": 4}, completed=4)
        running = batch(world.org, world.key, lines={"succeeded": 6, "failed": 1, "pending": 3})
        Batch.objects.filter(pk=done.pk).update(created_at=timezone.now() - timedelta(hours=1))
        batch(world.other_org, world.other_key, lines={"pending": 5})  # not theirs

        page = world.client("member").get(url("portal-batches", world.org)).content.decode()

        assert page.index(running.public_id) < page.index(done.public_id)
        assert page.count('<tr id="batch_') == 2
        assert '<progress max="10" value="7"' in page  # completed and failed, live from the lines
        assert "7 of 10" in page
        assert "1 failed" in page
        assert "left</span>" in page  # the running one's estimate
        assert '<span class="status status-in_progress">In Progress</span>' in page

    def test_the_list_filters_by_status(self, world):
        batch(world.org, world.key, status="completed", lines={"succeeded": 1}, completed=1)
        running = batch(world.org, world.key, lines={"pending": 1})
        page = world.client("member").get(url("portal-batches", world.org), {"status": "in_progress"})
        assert page.content.decode().count('<tr id="batch_') == 1
        assert running.public_id in page.content.decode()

    def test_the_detail_shows_times_metadata_validation_errors_and_files(self, world):
        input_file = stored_file(world.org, b'{"custom_id": "a"}\n', filename="requests.jsonl")
        failed = batch(
            world.org, world.key, status="failed", input_file=input_file, input_file_public_id=input_file.public_id,
            metadata={"project": "nightly eval"}, failed_at=timezone.now(),
            errors=[{"code": "mismatched_model", "line": 2, "message": "Line 2 asks for model 'b'.", "param": None}],
        )  # fmt: skip

        page = world.client("member").get(url("portal-batch", world.org, batch_id=failed.public_id)).content.decode()

        assert "Line 2 asks for model" in page
        assert "mismatched_model" in page
        assert "nightly eval" in page
        assert ">Created<" in page
        assert ">Failed<" in page
        assert ">Started<" in page
        assert url("portal-file", world.org, file_id=input_file.public_id) in page
        assert "requests.jsonl" in page
        assert "Cancel batch" not in page  # finished, and a member anyway

    def test_a_batch_stopped_by_its_budget_says_so(self, world):
        stopped = batch(world.org, world.key, status="completed", stop_reason="insufficient_quota",
                        lines={"succeeded": 1, "failed": 1}, completed=1, failed=1)  # fmt: skip
        page = world.client("member").get(url("portal-batch", world.org, batch_id=stopped.public_id)).content.decode()
        assert "stopped early: the spend cap or token quota was reached" in page

    def test_an_admin_cancels_a_running_batch(self, world):
        running = batch(world.org, world.key, lines={"succeeded": 1, "pending": 4})
        detail = url("portal-batch", world.org, batch_id=running.public_id)
        assert "Cancel batch" in world.client("admin").get(detail).content.decode()

        response = world.client("admin").post(url("portal-batch-cancel", world.org, batch_id=running.public_id),
                                              follow=True)  # fmt: skip

        running.refresh_from_db()
        assert running.status == Batch.Status.CANCELLING
        assert response.redirect_chain[-1][0] == detail
        assert "is cancelling" in response.content.decode()

    def test_a_finished_batch_is_not_cancelled_and_the_page_says_why(self, world):
        done = batch(world.org, world.key, status="completed", lines={"succeeded": 2}, completed=2)
        response = world.client("admin").post(url("portal-batch-cancel", world.org, batch_id=done.public_id),
                                              follow=True)  # fmt: skip
        done.refresh_from_db()
        assert done.status == Batch.Status.COMPLETED
        assert f"Batch {done.public_id} is completed; it can no longer be cancelled." in response.content.decode()

    def test_members_may_not_cancel(self, world):
        running = batch(world.org, world.key, lines={"pending": 2})
        detail = world.client("member").get(url("portal-batch", world.org, batch_id=running.public_id))
        assert "Cancel batch" not in detail.content.decode()
        response = world.client("member").post(url("portal-batch-cancel", world.org, batch_id=running.public_id))
        assert response.status_code == 403
        running.refresh_from_db()
        assert running.status == Batch.Status.IN_PROGRESS

    def test_a_file_downloads_with_its_name(self, world):
        content = b'{"custom_id": "a", "response": {"status_code": 200}}\n' * 3
        output = stored_file(world.org, content, purpose="batch_output", filename="batch_x_output.jsonl")
        response = world.client("member").get(url("portal-file", world.org, file_id=output.public_id))
        assert response.status_code == 200
        assert response["Content-Disposition"] == 'attachment; filename="batch_x_output.jsonl"'
        assert response["Content-Length"] == str(len(content))
        assert downloaded(response) == content

    def test_another_organisations_batch_and_file_are_not_found(self, world):
        theirs = batch(world.other_org, world.other_key, lines={"pending": 1})
        their_file = stored_file(world.other_org, b"{}\n")
        client = world.client("admin")
        assert client.get(url("portal-batch", world.org, batch_id=theirs.public_id)).status_code == 404
        assert client.post(url("portal-batch-cancel", world.org, batch_id=theirs.public_id)).status_code == 404
        assert client.get(url("portal-file", world.org, file_id=their_file.public_id)).status_code == 404
        assert client.get(url("portal-batch", world.other_org, batch_id=theirs.public_id)).status_code == 404
        theirs.refresh_from_db()
        assert theirs.status == Batch.Status.IN_PROGRESS

    def test_a_file_whose_bytes_are_gone_is_not_found(self, world, store):
        gone = stored_file(world.org, b"{}\n")
        store.delete_file(gone.uri)
        assert world.client("member").get(url("portal-file", world.org, file_id=gone.public_id)).status_code == 404


class TestWebhooks:
    def test_admins_see_the_secret_masked_on_a_page_never_stored(self, world):
        secret = organization_webhook_secret(organization_id=world.org.pk)
        response = world.client("admin").get(url("portal-webhooks", world.org))
        page = response.content.decode()
        assert f'id="webhook-secret" type="password" readonly value="{secret}"' in page
        assert 'data-reveal="webhook-secret"' in page
        assert 'data-copy="webhook-secret"' in page
        assert "no-store" in response["Cache-Control"]
        assert "Webhook-Signature" in page

    def test_members_see_the_deliveries_but_not_the_secret(self, world):
        secret = organization_webhook_secret(organization_id=world.org.pk)
        running = batch(world.org, world.key, lines={"pending": 1})
        WebhookDelivery.objects.create(
            organization=world.org, batch=running, url="https://hooks.example/batches", event="batch.completed",
            payload={}, status="failed", attempts=8, next_attempt_at=timezone.now(), last_status_code=502,
            last_error="bad gateway",
        )  # fmt: skip
        page = world.client("member").get(url("portal-webhooks", world.org)).content.decode()
        assert secret not in page
        assert "Rotate" not in page
        assert "https://hooks.example/batches" in page
        assert "batch.completed" in page
        assert "HTTP 502 · bad gateway" in page
        assert running.public_id in page

    def test_an_admin_rotates_the_secret(self, world):
        before = organization_webhook_secret(organization_id=world.org.pk)
        response = world.client("admin").post(url("portal-webhook-rotate", world.org), follow=True)
        after = organization_webhook_secret(organization_id=world.org.pk)
        assert after != before
        assert after in response.content.decode()
        assert before not in response.content.decode()
        assert world.client("member").post(url("portal-webhook-rotate", world.org)).status_code == 403
        assert organization_webhook_secret(organization_id=world.org.pk) == after


class TestTheConsole:
    def test_every_organisations_batches_are_listed_and_filtered_by_status(self, world):
        ours = batch(world.org, world.key, lines={"succeeded": 1, "pending": 1})
        theirs = batch(world.other_org, world.other_key, status="completed", lines={"succeeded": 2}, completed=2)
        client = world.client("platform_admin")

        page = client.get(reverse("console:batches")).content.decode()
        assert ours.public_id in page
        assert theirs.public_id in page
        assert "Alice Corp" in page
        assert "Bob Corp" in page
        filtered = client.get(reverse("console:batches"), {"status": "completed"}).content.decode()
        assert theirs.public_id in filtered
        assert ours.public_id not in filtered
        assert world.client("admin").get(reverse("console:batches")).status_code == 403

    def test_the_overview_shows_the_batch_queue(self, world):
        batch(world.org, world.key, lines={"succeeded": 10, "failed": 2, "running": 3, "pending": 20})
        batch(world.other_org, world.other_key, status="validating", total=7)
        cancelling = batch(world.other_org, world.other_key, status="cancelling", lines={"pending": 50})
        assert cancelling.pk  # its pending lines never start: not waiting

        stats = batch_queue_stats()
        assert stats == {
            "waiting": 27, "running": 3, "finished_recently": 12, "window_minutes": 5, "per_minute": 2.4,
            "in_progress": 1,
        }  # fmt: skip
        page = world.client("platform_admin").get(reverse("console:overview")).content.decode()
        assert 'id="batch-queue"' in page
        assert '<dd data-batch-queue="waiting">27</dd>' in page
        assert '<dd data-batch-queue="per_minute">2.4</dd>' in page

    def test_lines_finished_before_the_window_are_not_throughput(self, world):
        batch(world.org, world.key, lines={"succeeded": 4})
        later = timezone.now() + timedelta(minutes=6)
        assert batch_queue_stats(now=later)["finished_recently"] == 0


class TestTimeLeft:
    def test_a_batch_waits_for_the_older_batches_of_its_model(self, world):
        older = batch(world.org, world.key, model="eta-model", lines={"pending": 30})
        newer = batch(world.other_org, world.other_key, model="eta-model", lines={"pending": 90})
        Batch.objects.filter(pk=older.pk).update(created_at=timezone.now() - timedelta(minutes=5))
        older.refresh_from_db()

        left = seconds_left([newer, older])

        backlog = estimated_seconds("eta-model", 0)  # all 120 lines
        assert left[newer.pk] == backlog
        assert left[older.pk] == max(1, round(backlog * 30 / 120))
        assert left[older.pk] < left[newer.pk]

    def test_only_batches_in_progress_have_a_time_left(self, world):
        done = batch(world.org, world.key, status="completed", lines={"succeeded": 1}, completed=1)
        validating = batch(world.org, world.key, status="validating", total=5)
        assert seconds_left([done, validating]) == {}

    @pytest.mark.parametrize(
        ("seconds", "text"),
        [(5, "under a minute"), (89, "about 1 min"), (3600, "about 1 h"), (3 * 3600 + 300, "about 3 h 5 min"),
         (3 * 86400, "about 3 days")],
    )  # fmt: skip
    def test_it_reads_as_words(self, seconds, text):
        assert duration_text(seconds) == text
