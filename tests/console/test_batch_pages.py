"""Batch jobs in the portal and the console, with Django's test client: progress and the time
left, a batch completed with errors, its tokens and cost, its failed lines by error, cancel
from its page and from the lists (and why a finished batch cannot be), file downloads kept to
their organisation, the webhooks' secret for admins only, every organisation's batches and the
queue's figures."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import ApiKey, Membership, Organization, Role
from accounts.services import api_key_create, organization_create, organization_webhook_secret
from console.pages.batches import duration_text, seconds_left
from serving.batches.selectors import batch_error_summary, batch_queue_stats, batch_usage
from serving.batches.services import estimated_seconds, line_request_id
from serving.models import Batch, BatchLine, StoredFile, WebhookDelivery
from tests.support.batches import batch, stored_file
from tests.support.usage_records import make_record

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
        assert 'aria-valuemax="10" aria-valuenow="7"' in page  # completed and failed, live from the lines
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
                                              {"confirm": "yes"}, follow=True)  # fmt: skip

        running.refresh_from_db()
        assert running.status == Batch.Status.CANCELLING
        assert response.redirect_chain[-1][0] == detail
        assert "is cancelling" in response.content.decode()

    def test_cancel_asks_first(self, world):
        running = batch(world.org, world.key, lines={"succeeded": 3, "running": 1, "pending": 4})
        cancel = url("portal-batch-cancel", world.org, batch_id=running.public_id)

        for asked in (world.client("admin").get(cancel), world.client("admin").post(cancel)):
            page = asked.content.decode()
            assert asked.status_code == 200
            assert f"<title>Cancel batch {running.public_id} · Alice Corp</title>" in page
            assert f"{running.public_id}</code>?</h1>" in page
            assert "3 of 8 lines have run" in page
            assert "the 1 line running now finishes" in page
            assert '<input type="hidden" name="confirm" value="yes">' in page
            assert url("portal-batch", world.org, batch_id=running.public_id) in page  # keep it running: back
        running.refresh_from_db()
        assert running.status == Batch.Status.IN_PROGRESS

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


class TestCompletedWithErrors:
    def test_a_completed_batch_with_failed_lines_says_so_in_amber_with_both_parts_of_its_bar(self, world):
        mixed = batch(world.org, world.key, status="completed", lines={"succeeded": 10, "failed": 30},
                      completed=10, failed=30, completed_at=timezone.now())  # fmt: skip
        clean = batch(world.org, world.key, status="completed", lines={"succeeded": 4}, completed=4)
        badge = '<span class="status status-completed_with_errors" id="batch-status">Completed with errors</span>'
        bar = '<span class="lines-succeeded" style="width: 25%"></span><span class="lines-failed" style="width: 75%">'

        listed = world.client("member").get(url("portal-batches", world.org)).content.decode()
        detail = world.client("member").get(url("portal-batch", world.org, batch_id=mixed.public_id)).content.decode()
        console = world.client("platform_admin").get(reverse("console:batches")).content.decode()

        for page in (listed, console):
            assert '<span class="status status-completed_with_errors">Completed with errors</span>' in page
            assert bar in page
            assert 'aria-valuetext="40 of 40 lines done: 10 succeeded, 30 failed"' in page
            assert '<span class="status status-completed">Completed</span>' in page  # the clean one
            assert '<span class="lines-succeeded" style="width: 100%"></span>' in page
        assert badge in detail
        assert bar in detail
        assert clean.public_id in listed

    def test_one_failure_in_many_lines_still_shows_on_the_bar(self, world):
        batch(world.org, world.key, status="completed", lines={"succeeded": 999, "failed": 1}, completed=999,
              failed=1)  # fmt: skip
        page = world.client("member").get(url("portal-batches", world.org)).content.decode()
        bar = '<span class="lines-succeeded" style="width: 99.9%"></span><span class="lines-failed" style="width: 1%">'
        assert bar in page

    def test_amber_is_the_colour_of_completed_with_errors(self):
        from django.conf import settings

        css = (settings.BASE_DIR / "static" / "console" / "console.css").read_text()
        amber = next(rule for rule in css.split("}") if ".status-cancelling," in rule)
        assert ".status-completed_with_errors," in amber


class TestTokensAndCost:
    def _answered(self, made: Batch, key: ApiKey, tokens: list[tuple[int, int, int, str]]) -> None:
        """Usage records of the batch's lines, in line order: (prompt, cached, completion, cost)."""
        for line, (prompt, cached, completion, cost) in zip(made.lines.order_by("index"), tokens, strict=False):
            make_record(key, at=timezone.now(), request_id=line_request_id(made.public_id, line.index, line.attempts),
                        prompt=prompt, cached=cached, completion=completion, cost=cost, batch=True)  # fmt: skip

    def test_a_batch_adds_up_the_usage_records_of_its_lines_answering_attempts(self, world):
        made = batch(world.org, world.key, status="completed", lines={"succeeded": 2, "failed": 1}, completed=2,
                     failed=1)  # fmt: skip
        BatchLine.objects.filter(batch=made, index=1).update(attempts=3)  # given back twice, answered at the third
        self._answered(made, world.key, [(100, 20, 50, "0.0011"), (200, 0, 70, "0.0022"), (30, 0, 0, "0.0003")])
        # Not the batch's: an earlier attempt of line 1 (never billed, were it written) and another request.
        make_record(world.key, at=timezone.now(), request_id=line_request_id(made.public_id, 1, 1), prompt=999)
        make_record(world.key, at=timezone.now(), prompt=999)

        usage = batch_usage(made)

        assert (usage.requests, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (3, 330, 20, 120)
        assert usage.input_tokens == 310
        assert usage.cost == Decimal("0.0036")

    def test_the_batch_page_shows_its_tokens_and_cost(self, world):
        made = batch(world.org, world.key, status="completed", lines={"succeeded": 2}, completed=2)
        self._answered(made, world.key, [(12_000, 2_000, 3_000, "1.2345"), (500, 0, 250, "0.05")])
        page = world.client("member").get(url("portal-batch", world.org, batch_id=made.public_id)).content.decode()
        assert '<dd id="batch-tokens">' in page
        assert '<span title="10500">10.5k</span> input' in page
        assert '<span title="2000">2,000</span> cached input' in page
        assert '<span title="3250">3,250</span> output' in page
        assert '<dd id="batch-cost"><span title="1.2845 USD">$1.28</span>' in page
        assert "so far" not in page

    def test_a_running_batch_counts_so_far_and_one_without_usage_says_so(self, world):
        running = batch(world.org, world.key, lines={"succeeded": 1, "pending": 3})
        self._answered(running, world.key, [(10, 0, 5, "0.001")])
        waiting = batch(world.org, world.key, lines={"pending": 3})
        client = world.client("member")
        page = client.get(url("portal-batch", world.org, batch_id=running.public_id)).content.decode()
        assert "so far" in page
        assert '<span title="0.001 USD">$0.001</span>' in page
        none = client.get(url("portal-batch", world.org, batch_id=waiting.public_id)).content.decode()
        assert "none yet" in none

    def test_another_organisations_records_never_count(self, world):
        made = batch(world.org, world.key, status="completed", lines={"succeeded": 1}, completed=1)
        make_record(world.other_key, at=timezone.now(), request_id=line_request_id(made.public_id, 0, 1), prompt=7)
        assert batch_usage(made).requests == 0


class TestErrorSummary:
    def _fail(self, made: Batch, errors: list[dict[str, str] | None]) -> None:
        for line, error in zip(made.lines.filter(status="failed").order_by("index"), errors, strict=True):
            BatchLine.objects.filter(pk=line.pk).update(error=error, status_code=500)

    def test_failed_lines_are_counted_by_error_most_frequent_first(self, world):
        made = batch(world.org, world.key, lines={"succeeded": 1, "failed": 9, "pending": 2})
        timeout = {"code": "engine_timeout", "message": "The engine did not answer in time."}
        too_long = {"code": "context_length_exceeded", "message": "The prompt is too long."}
        self._fail(made, [timeout] * 5 + [too_long] * 3 + [None])

        summary = batch_error_summary(made, top=2)

        assert [(e.code, e.lines) for e in summary.top] == [("engine_timeout", 5), ("context_length_exceeded", 3)]
        assert (summary.other_lines, summary.other_kinds, summary.lines) == (1, 1, 9)

    def test_an_ended_batch_counts_its_lines_that_never_ran(self, world):
        made = batch(world.org, world.key, status="completed", stop_reason="insufficient_quota",
                     lines={"succeeded": 1, "failed": 1, "pending": 4}, completed=1, failed=5)  # fmt: skip
        self._fail(made, [{"code": "engine_error", "message": "boom"}])
        summary = batch_error_summary(made)
        assert [(e.code, e.lines) for e in summary.top] == [("insufficient_quota", 4), ("engine_error", 1)]

    def test_the_batch_page_summarises_the_errors_and_links_the_error_file(self, world):
        errors = stored_file(world.org, b"{}\n" * 4, purpose="batch_output", filename="nightly_errors.jsonl")
        made = batch(world.org, world.key, status="completed", lines={"succeeded": 2, "failed": 4}, completed=2,
                     failed=4, error_file=errors)  # fmt: skip
        timeout = {"code": "engine_timeout", "message": "The engine did not answer in time."}
        self._fail(made, [timeout] * 3 + [{"code": "invalid_request_error", "message": "max_tokens is too big."}])

        page = world.client("member").get(url("portal-batch", world.org, batch_id=made.public_id)).content.decode()

        assert 'id="line-errors-heading">Failed lines by error<' in page
        assert "4 lines failed." in page
        row = '<td><code>engine_timeout</code></td><td>The engine did not answer in time.</td><td class="num">3</td>'
        assert row in page
        assert page.index("engine_timeout") < page.index("invalid_request_error")
        error_file = url("portal-file", world.org, file_id=errors.public_id)
        assert f'<a href="{error_file}" download>error file</a>' in page

    def test_a_batch_without_failures_has_no_summary(self, world):
        made = batch(world.org, world.key, status="completed", lines={"succeeded": 2}, completed=2)
        page = world.client("member").get(url("portal-batch", world.org, batch_id=made.public_id)).content.decode()
        assert "Failed lines by error" not in page


class TestFilesAndIds:
    def test_written_when_the_batch_ends_is_said_only_before_it_ends(self, world):
        running = batch(world.org, world.key, lines={"pending": 2})
        all_failed = batch(world.org, world.key, status="completed", lines={"failed": 2}, failed=2)
        all_good = batch(world.org, world.key, status="completed", lines={"succeeded": 2}, completed=2)
        why = {"code": "invalid_file", "message": "no lines", "line": None, "param": None}
        refused = batch(world.org, world.key, status="failed", failed_at=timezone.now(), errors=[why])
        client = world.client("member")

        def files_of(made: Batch) -> str:
            page = client.get(url("portal-batch", world.org, batch_id=made.public_id)).content.decode()
            return page[page.index('id="batch-files"') :]

        assert files_of(running).count("written when the batch ends") == 2
        for ended in (all_failed, all_good, refused):
            assert "written when the batch ends" not in files_of(ended)
        assert "none: no line succeeded" in files_of(all_failed)
        assert "none: no line failed" in files_of(all_good)
        assert files_of(refused).count("none: the batch failed before its results were written") == 2

    def test_batch_ids_do_not_wrap_and_the_page_offers_to_copy_one(self, world):
        made = batch(world.org, world.key, lines={"pending": 1})
        shown = f'<code class="batch-id" title="{made.public_id}">{made.public_id}</code>'
        listed = world.client("member").get(url("portal-batches", world.org)).content.decode()
        console = world.client("platform_admin").get(reverse("console:batches")).content.decode()
        detail = world.client("member").get(url("portal-batch", world.org, batch_id=made.public_id)).content.decode()
        for page in (listed, console, detail):
            assert shown in page
        assert f'data-copy-text="{made.public_id}"' in detail
        assert "console/batches.js" in detail

        from django.conf import settings

        css = (settings.BASE_DIR / "static" / "console" / "batches.css").read_text()
        rule = css.split(".batch-id {")[1].split("}")[0]
        assert "white-space: nowrap" in rule


class TestCancelFromTheList:
    def test_an_admin_has_a_cancel_form_on_each_cancellable_row(self, world):
        running = batch(world.org, world.key, lines={"pending": 2})
        validating = batch(world.org, world.key, status="validating", total=3)
        done = batch(world.org, world.key, status="completed", lines={"succeeded": 1}, completed=1)
        listing = url("portal-batches", world.org)

        page = world.client("admin").get(listing, {"status": ""}).content.decode()

        for made in (running, validating):
            cancel = url("portal-batch-cancel", world.org, batch_id=made.public_id)
            assert f'<form method="post" action="{cancel}">' in page
            assert f'Cancel<span class="visually-hidden"> batch {made.public_id}</span>' in page
        assert url("portal-batch-cancel", world.org, batch_id=done.public_id) not in page
        assert f'<input type="hidden" name="next" value="{listing}?status=">' in page
        member = world.client("member").get(listing).content.decode()
        assert url("portal-batch-cancel", world.org, batch_id=running.public_id) not in member

    def test_the_confirmed_cancel_goes_back_to_the_list(self, world):
        running = batch(world.org, world.key, lines={"pending": 2})
        listing = url("portal-batches", world.org) + "?status=in_progress"
        cancel = url("portal-batch-cancel", world.org, batch_id=running.public_id)

        asked = world.client("admin").post(cancel, {"next": listing}).content.decode()
        assert '<input type="hidden" name="next" value="/portal/' in asked
        response = world.client("admin").post(cancel, {"confirm": "yes", "next": listing}, follow=True)

        running.refresh_from_db()
        assert running.status == Batch.Status.CANCELLING
        assert response.redirect_chain[-1][0] == listing
        assert "is cancelling" in response.content.decode()

    def test_next_never_leaves_the_site(self, world):
        running = batch(world.org, world.key, lines={"pending": 2})
        cancel = url("portal-batch-cancel", world.org, batch_id=running.public_id)
        for elsewhere in ("https://evil.example/", "//evil.example/portal/", "javascript:alert(1)"):
            response = world.client("admin").post(cancel, {"confirm": "yes", "next": elsewhere})
            assert response["Location"] == url("portal-batch", world.org, batch_id=running.public_id)

    def test_a_platform_admin_cancels_from_the_console_list(self, world):
        theirs = batch(world.other_org, world.other_key, lines={"pending": 2})
        client = world.client("platform_admin")
        page = client.get(reverse("console:batches")).content.decode()
        cancel = url("portal-batch-cancel", world.other_org, batch_id=theirs.public_id)
        assert f'<form method="post" action="{cancel}">' in page
        assert f'<input type="hidden" name="next" value="{reverse("console:batches")}">' in page

        response = client.post(cancel, {"confirm": "yes", "next": reverse("console:batches")})

        assert response["Location"] == reverse("console:batches")
        theirs.refresh_from_db()
        assert theirs.status == Batch.Status.CANCELLING


def requests_file(*models: str, url: str = "/v1/chat/completions") -> bytes:
    lines = [
        f'{{"custom_id": "r{i}", "method": "POST", "url": "{url}", "body": {{"model": "{m}", "messages": []}}}}'
        for i, m in enumerate(models)
    ]
    return ("\n".join(lines) + "\n").encode()


class TestCreateFromThePortal:
    def _post(self, world: World, content: bytes, who: str | Client = "admin", **fields: Any) -> Any:
        form = {
            "file": SimpleUploadedFile("nightly.jsonl", content, content_type="application/jsonl"),
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "api_key": world.key.pk,
            **fields,
        }
        client = who if isinstance(who, Client) else world.client(who)
        return client.post(url("portal-batch-create", world.org), form)

    def test_an_admin_uploads_a_file_and_the_batch_is_created(self, world):
        admin = world.client("admin")
        response = self._post(world, requests_file("m", "m", "m"), admin)

        made = Batch.objects.get(organization=world.org)
        assert response.status_code == 302
        assert response["Location"] == url("portal-batch", world.org, batch_id=made.public_id)
        assert (made.status, made.endpoint, made.completion_window) == ("validating", "/v1/chat/completions", "24h")
        assert made.total == 3
        assert made.api_key_id == world.key.pk
        assert made.input_file is not None
        assert (made.input_file.filename, made.input_file.lines, made.input_file.purpose) == (
            "nightly.jsonl",
            3,
            "batch",
        )
        page = admin.get(response["Location"]).content.decode()
        assert f"Batch {made.public_id} created: its 3 lines are being validated." in page

    def test_a_bad_line_refuses_the_file_as_the_api_does(self, world):
        content = requests_file("m") + b"not json\n"
        response = self._post(world, content)
        assert response.status_code == 400
        assert "Line 2 is not JSON." in response.content.decode()
        assert 'id="id_file-errors"' in response.content.decode()
        assert not Batch.objects.filter(organization=world.org).exists()
        assert not StoredFile.objects.filter(organization=world.org).exists()

    def test_a_batch_refused_leaves_no_file_behind(self, world, settings):
        settings.BATCH_MAX_ENQUEUED_LINES = 2
        response = self._post(world, requests_file("m", "m", "m"))
        assert response.status_code == 429
        assert "would pass its limit of 2" in response.content.decode()
        assert not StoredFile.objects.filter(organization=world.org).exists()

    def test_only_the_organisations_working_keys_are_offered(self, world):
        revoked = api_key_create(organization=world.org, name="old").api_key
        ApiKey.objects.filter(pk=revoked.pk).update(is_active=False)
        expired = api_key_create(organization=world.org, name="expired").api_key
        ApiKey.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(minutes=1))

        page = world.client("admin").get(url("portal-batch-create", world.org)).content.decode()

        assert f'<option value="{world.key.pk}">production (sk-' in page
        for other in (revoked, expired, world.other_key):
            assert f'<option value="{other.pk}"' not in page
        assert '<option value="/api/v1/predict">' in page
        assert 'enctype="multipart/form-data"' in page
        for other in (revoked, world.other_key):
            response = self._post(world, requests_file("m"), api_key=other.pk)
            assert response.status_code == 400
        assert not Batch.objects.filter(organization=world.org).exists()

    def test_without_a_working_key_the_page_says_to_create_one(self, world):
        ApiKey.objects.filter(pk=world.key.pk).update(is_active=False)
        page = world.client("admin").get(url("portal-batch-create", world.org)).content.decode()
        assert url("portal-key-create", world.org) in page
        assert '<form method="post" enctype' not in page

    def test_a_body_larger_than_a_file_may_be_is_refused_before_it_is_read(self, world, settings):
        settings.FILES_MAX_BYTES = 100
        settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100
        response = self._post(world, requests_file(*["m"] * 10))
        assert response.status_code == 413
        assert "larger than the limit of 100" in response.content.decode()
        assert not StoredFile.objects.filter(organization=world.org).exists()

    def test_the_form_is_protected_from_cross_site_posts(self, world):
        """Its view is csrf_exempt only to choose where the upload goes: the check comes after."""
        client = Client(enforce_csrf_checks=True)
        client.force_login(world.admin)
        assert self._post(world, requests_file("m"), client).status_code == 403
        client.get(url("portal-batch-create", world.org))
        token = client.cookies["csrftoken"].value
        assert self._post(world, requests_file("m"), client, csrfmiddlewaretoken=token).status_code == 302
        assert Batch.objects.filter(organization=world.org).count() == 1

    def test_members_may_not_create_and_see_no_button(self, world):
        assert world.client("member").get(url("portal-batch-create", world.org)).status_code == 403
        assert self._post(world, requests_file("m"), who="member").status_code == 403
        assert not Batch.objects.filter(organization=world.org).exists()
        create = url("portal-batch-create", world.org)
        assert create not in world.client("member").get(url("portal-batches", world.org)).content.decode()
        assert create in world.client("admin").get(url("portal-batches", world.org)).content.decode()


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
