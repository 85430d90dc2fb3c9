"""Batch jobs: an organisation's batches, their files and its webhooks in the portal; every
organisation's batches in the console (the queue's figures are on the overview).

Who may do what follows the Batch and Files APIs, where any key of the organisation sees its
batches and reads their files: every member sees the batches, what they cost and downloads
their files; its admins cancel a batch (from its page or the lists, after a confirmation), and
see and rotate the secret that signs its webhooks (a secret, so, like a key's, never shown to
plain members, and the page that shows it is never stored). Reads are serving's
(``serving.batches.selectors``, ``serving.batches``); writes its services'.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

from django import forms
from django.conf import settings
from django.contrib import messages
from django.core.files.uploadhandler import TemporaryFileUploadHandler
from django.db.models import QuerySet, prefetch_related_objects
from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.template.defaultfilters import filesizeformat
from django.urls import URLPattern, URLResolver, path, reverse
from django.utils import timezone
from django.utils.http import content_disposition_header, url_has_allowed_host_and_scheme
from django.views.decorators.csrf import csrf_exempt, csrf_protect
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts.models import ApiKey
from accounts.selectors import api_keys_of
from accounts.services import organization_webhook_secret
from console.pages.access import ORG_ADMIN_ROLES, OrgRequest, org_member_required, platform_admin_required
from console.pages.lists import never_stored, page_of, query_without_page
from console.pages.nav import CONSOLE, PORTAL, NavItem
from registry.artifacts import get_artifact_store
from serving.batches.files import BATCH_URLS, BadFile, file_for_organization, file_quota_check
from serving.batches.selectors import (
    batch_error_summary,
    batch_for_organization,
    batch_lines_queued,
    batch_lines_running,
    batch_progress,
    batch_usage,
    batches_listed,
)
from serving.batches.services import BadBatch, batch_cancel, batch_create_from_upload, estimated_seconds
from serving.batches.webhooks import SIGNATURE_HEADER, deliveries_of
from serving.models import Batch

BATCHES_PER_PAGE = 25
DELIVERIES_SHOWN = 20
# What a download reads at a time, in a thread, while the event loop sends the previous one.
DOWNLOAD_CHUNK_BYTES = 256 * 1024
# A cancel is taken while no line has finished the batch yet (serving.batches.services.batch_cancel).
CANCELLABLE = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS)
# Why a batch stopped before running every line (Batch.stop_reason), where its status does not say.
STOP_REASONS = {
    "cancelled": "cancelled",
    "expired": "the completion window ended",
    "insufficient_quota": "the spend cap or token quota was reached",
    "key_revoked": "its API key was revoked",
}
# The detail page's timestamps, in the order a batch lives them.
TIMESTAMPS = (
    ("created_at", "Created"),
    ("in_progress_at", "Started"),
    ("cancelling_at", "Cancel requested"),
    ("finalizing_at", "Finalizing"),
    ("completed_at", "Completed"),
    ("failed_at", "Failed"),
    ("expired_at", "Expired"),
    ("cancelled_at", "Cancelled"),
    ("expires_at", "Completion window ends"),
)


class BatchFilterForm(forms.Form):
    status = forms.ChoiceField(label="Status", choices=[("", "All"), *Batch.Status.choices], required=False)


class KeyChoiceField(forms.ModelChoiceField[ApiKey]):
    def label_from_instance(self, obj: ApiKey) -> str:
        return f"{obj.name} ({obj.masked})"


class BatchCreateForm(forms.Form):
    """A batch from the portal: the fields of ``POST /v1/files`` and ``POST /v1/batches`` in one
    form; what they must hold is the APIs' (``batch_create_from_upload``), not this form's."""

    file = forms.FileField(label="Input file (JSONL)", allow_empty_file=True)
    endpoint = forms.ChoiceField(label="Endpoint", choices=[(url, url) for url in BATCH_URLS])
    completion_window = forms.ChoiceField(
        label="Completion window",
        help_text="The time it has to run every line: those not run by then are listed in its error file.",
    )
    api_key = KeyChoiceField(
        label="API key", queryset=ApiKey.objects.none(), empty_label=None,
        help_text="Its lines run under this key's models, limits and budget, and are billed to it.",
    )  # fmt: skip

    def __init__(self, *args: Any, keys: QuerySet[ApiKey], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        window, api_key = self.fields["completion_window"], self.fields["api_key"]
        assert isinstance(window, forms.ChoiceField)
        assert isinstance(api_key, KeyChoiceField)
        window.choices = [(w, w) for w in settings.BATCH_COMPLETION_WINDOWS]
        api_key.queryset = keys
        self.keys = keys
        self.fields["file"].help_text = (
            'One request a line: <code>{"custom_id": "…", "method": "POST", "url": "/v1/chat/completions", '
            '"body": {"model": "…", …}}</code>, each line\'s url the endpoint above; at most '
            f"{settings.FILES_MAX_LINES:,} requests and {filesizeformat(settings.FILES_MAX_BYTES)}."
        )


# A refusal of the APIs, on the form's field it is about.
_FIELD_OF_PARAM = {
    "file": "file", "input_file_id": "file", "endpoint": "endpoint", "completion_window": "completion_window",
}  # fmt: skip


def duration_text(seconds: int) -> str:
    """An estimate for people: "under a minute", "about 12 min", "about 3 h 5 min"."""
    if seconds < 60:
        return "under a minute"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"about {minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours >= 48:
        return f"about {round(hours / 24)} days"
    return f"about {hours} h {minutes} min" if minutes else f"about {hours} h"


def seconds_left(batches: list[Batch]) -> dict[int, int]:
    """How long until each batch in progress should have run its last line, by batch id.

    Workers take a model's batches oldest first, so a batch waits for the lines of those ahead
    of it as well as its own. ``estimated_seconds(model, 0)`` is how long the lines queued for
    the model take now (it counts those already enqueued, this batch's among them); a batch's
    share of that is the lines up to and including its own, in the workers' order.
    """
    running = [b for b in batches if b.status == Batch.Status.IN_PROGRESS and b.model]
    left: dict[int, int] = {}
    for model, queue in batch_lines_queued(models={b.model for b in running}).items():
        queued = sum(lines for _, lines in queue)
        if not queued:
            continue
        backlog = estimated_seconds(model, 0)
        ahead = 0
        for batch_id, lines in queue:
            ahead += lines
            left[batch_id] = max(1, round(backlog * ahead / queued))
    return {b.pk: left[b.pk] for b in running if b.pk in left}


def status_shown(batch: Batch, progress: dict[str, int]) -> tuple[str, str]:
    """The batch's status as its badge reads: (its CSS name, its words). The API says
    "completed" for a batch that ran to its end whatever its lines did; a page says when some
    of them failed."""
    if batch.status == Batch.Status.COMPLETED and progress["failed"]:
        return "completed_with_errors", "Completed with errors"
    return batch.status, batch.get_status_display()


def _percent(part: int, total: int) -> str:
    """A part of the progress bar, in percent for its CSS width: a part that is not empty is
    never narrower than 1 %, so that one failed line in thousands still shows."""
    if not part or not total:
        return "0"
    return f"{max(1.0, round(100 * part / total, 1)):g}"


def batch_rows(batches: list[Batch]) -> list[dict[str, Any]]:
    """Each batch with its progress (total, completed, failed), the widths of its bar's
    succeeded and failed parts, its status as shown, whether it may still be cancelled and,
    while it runs, the time left."""
    progress = batch_progress(batches)
    left = seconds_left(batches)
    rows = []
    for b in batches:
        counts = progress[b.pk]
        status, status_label = status_shown(b, counts)
        rows.append(
            {
                "batch": b,
                "progress": counts,
                "bar": {
                    "succeeded": _percent(counts["completed"], counts["total"]),
                    "failed": _percent(counts["failed"], counts["total"]),
                },
                "status": status,
                "status_label": status_label,
                "cancellable": b.status in CANCELLABLE,
                "left": duration_text(left[b.pk]) if b.pk in left else "",
            }
        )
    return rows


def _filtered(request: HttpRequest, organization_id: int | None) -> tuple[BatchFilterForm, Any]:
    form = BatchFilterForm(request.GET or None)
    status = form.cleaned_data["status"] if form.is_valid() else ""
    page = page_of(request, batches_listed(organization_id=organization_id, status=status), BATCHES_PER_PAGE)
    return form, page


# --- The portal ----------------------------------------------------------------------------


def _is_admin(request: OrgRequest) -> bool:
    return request.org_role in ORG_ADMIN_ROLES


@org_member_required()
@require_GET
def portal_batches(request: OrgRequest, org_id: int) -> HttpResponse:
    """The organisation's batches, newest first, with their progress."""
    form, page = _filtered(request, request.organization.pk)
    context = {
        "organization": request.organization,
        "form": form,
        "page": page,
        "rows": batch_rows(list(page.object_list)),
        "query": query_without_page(request),
        "can_manage": _is_admin(request),
    }
    return render(request, "console/portal/batches.html", context)


def _usable_keys(organization_id: int) -> QuerySet[ApiKey]:
    """The organisation's keys a batch may run under: not revoked, not expired."""
    return api_keys_of(organization_id=organization_id).filter(is_active=True).exclude(expires_at__lte=timezone.now())


@csrf_exempt  # checked by _batch_create, once the upload is known to go to a temporary file
@org_member_required(admin=True)
@require_http_methods(["GET", "POST"])
def portal_batch_create(request: OrgRequest, org_id: int) -> HttpResponse:
    """A batch from an uploaded file: the Files API's upload and the Batch API's create, as
    its org admins' form. A body larger than a file may be, or than the organisation's storage
    has room for, is refused before it is read."""
    if request.method == "POST":
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
        refusal = ""
        if declared > settings.FILES_MAX_BYTES + settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
            refusal = f"The file is larger than the limit of {filesizeformat(settings.FILES_MAX_BYTES)}."
        else:
            try:
                file_quota_check(request.organization.pk, incoming_bytes=declared)
            except BadFile as exc:
                refusal = exc.message
        if refusal:
            return _batch_form(request, BatchCreateForm(keys=_usable_keys(request.organization.pk)), refusal=refusal,
                               status=413)  # fmt: skip
        request.upload_handlers = [TemporaryFileUploadHandler(request)]  # file_create reads it from disk
    return _batch_create(request)


def _batch_form(request: OrgRequest, form: BatchCreateForm, *, refusal: str = "", status: int = 200) -> HttpResponse:
    """The form; ``refusal``: why an upload was refused before its form could be read."""
    context = {"organization": request.organization, "form": form, "has_keys": form.keys.exists(), "refusal": refusal}
    return render(request, "console/portal/batch_form.html", context, status=status)


@csrf_protect
def _batch_create(request: OrgRequest) -> HttpResponse:
    organization = request.organization
    keys = _usable_keys(organization.pk)
    if request.method != "POST":
        return _batch_form(request, BatchCreateForm(keys=keys))
    form = BatchCreateForm(request.POST, request.FILES, keys=keys)
    if not form.is_valid():
        return _batch_form(request, form, status=400)
    data = form.cleaned_data
    upload = data["file"]
    try:
        batch = batch_create_from_upload(
            organization_id=organization.pk, api_key_id=data["api_key"].pk, upload=Path(upload.temporary_file_path()),
            filename=upload.name or "batch.jsonl", endpoint=data["endpoint"],
            completion_window=data["completion_window"],
        )  # fmt: skip
    except (BadFile, BadBatch) as exc:
        form.add_error(_FIELD_OF_PARAM.get(exc.param or ""), exc.message)
        return _batch_form(request, form, status=exc.status if exc.status == 429 else 400)
    finally:
        upload.close()  # removes the temporary file
    messages.success(request, f"Batch {batch.public_id} created: its {batch.total:,} lines are being validated.")
    return redirect("console:portal-batch", org_id=organization.pk, batch_id=batch.public_id)


def _batch_of(request: OrgRequest, batch_id: str) -> Batch:
    batch = batch_for_organization(request.organization.pk, batch_id)
    if batch is None:
        raise Http404("No such batch.")
    return batch


def _stopped_because(batch: Batch) -> str:
    """Why the batch stopped early, where its status does not say so already."""
    said = {"cancelled": (Batch.Status.CANCELLING, Batch.Status.CANCELLED), "expired": (Batch.Status.EXPIRED,)}
    if batch.status in said.get(batch.stop_reason, ()):
        return ""
    return STOP_REASONS.get(batch.stop_reason, batch.stop_reason)


def _output_files(batch: Batch) -> list[tuple[str, Any, str]]:
    """The batch's output and error files as its page lists them: (label, the file or None,
    why there is none). Each is written when the batch ends, and only when it has lines."""
    ended = batch.status not in Batch.UNFINISHED
    files = []
    for label, file, lines, none in (
        ("Output", batch.output_file, batch.completed, "none: no line succeeded"),
        ("Errors", batch.error_file, batch.failed, "none: no line failed"),
    ):
        if file is not None:
            why = ""
        elif not ended:
            why = "written when the batch ends"
        elif batch.status == Batch.Status.FAILED:
            why = "none: the batch failed before its results were written"
        elif not lines:
            why = none
        else:  # written, then deleted (FILES_OUTPUT_RETENTION_DAYS)
            why = "deleted"
        files.append((label, file, why))
    return files


@org_member_required()
@require_GET
def portal_batch(request: OrgRequest, org_id: int, batch_id: str) -> HttpResponse:
    """One batch: its progress, usage and cost, timestamps, metadata, validation errors, its
    failed lines by error, and its files."""
    batch = _batch_of(request, batch_id)
    row = batch_rows([batch])[0]
    usage = batch_usage(batch)
    input_missing = "" if batch.input_file else "deleted"
    context = {
        "organization": request.organization,
        "batch": batch,
        "row": row,
        "usage": usage,
        "cost_exact": f"{usage.cost.normalize():f}",  # its title: the exact sum, the page rounds to cents
        "currency": settings.BILLING_CURRENCY,
        "line_errors": batch_error_summary(batch),
        "timestamps": [(label, getattr(batch, name)) for name, label in TIMESTAMPS if getattr(batch, name)],
        "files": [("Input", batch.input_file, input_missing), *_output_files(batch)],
        "stopped_because": _stopped_because(batch),
        "running": batch.status in CANCELLABLE,
        "ended": batch.status not in Batch.UNFINISHED,
        "can_cancel": _is_admin(request) and batch.status in CANCELLABLE,
        "can_manage": _is_admin(request),
    }
    return render(request, "console/portal/batch_detail.html", context)


def _next_page(request: HttpRequest) -> str:
    """The page a cancel came from (a list, with its filter), if it is one of this site's."""
    target = request.POST.get("next") or request.GET.get("next") or ""
    if target.startswith("/") and url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return target
    return ""


@org_member_required(admin=True)
@require_http_methods(["GET", "POST"])
def portal_batch_cancel(request: OrgRequest, org_id: int, batch_id: str) -> HttpResponse:
    """Stop the batch: no line starts from now on; those in flight finish. Asks first (GET, or
    a POST without ``confirm``, as a list's Cancel button sends); then back to ``next`` (the
    list it came from), else to the batch's page."""
    batch = _batch_of(request, batch_id)
    detail = reverse("console:portal-batch", kwargs={"org_id": org_id, "batch_id": batch.public_id})
    back = _next_page(request)
    if batch.status in CANCELLABLE and (request.method == "GET" or request.POST.get("confirm") != "yes"):
        row = batch_rows([batch])[0]
        counts = row["progress"]
        context = {
            "organization": request.organization,
            "batch": batch,
            "row": row,
            "done": counts["completed"] + counts["failed"],
            "in_flight": batch_lines_running(batch),
            "next": back,
            "back": back or detail,
        }
        return render(request, "console/portal/batch_cancel.html", context)
    try:
        cancelled = batch_cancel(batch=batch)
    except BadBatch as exc:  # finished meanwhile (409)
        messages.error(request, exc.message)
    else:
        if cancelled.status == Batch.Status.CANCELLED:
            messages.info(request, f"Batch {batch.public_id} was cancelled already.")
        else:
            messages.success(
                request, f"Batch {batch.public_id} is cancelling: lines in flight finish, no other line starts."
            )
    return redirect(back or detail)


async def _chunks(handle: BinaryIO) -> AsyncIterator[bytes]:
    """The file's bytes, read in a thread a chunk at a time: the gateway's event loop never
    waits on the disk, and a file is never held in memory whole."""
    try:
        while chunk := await asyncio.to_thread(handle.read, DOWNLOAD_CHUNK_BYTES):
            yield chunk
    finally:
        handle.close()


@org_member_required()
@require_GET
def portal_file(request: OrgRequest, org_id: int, file_id: str) -> StreamingHttpResponse:
    """One of the organisation's files (a batch's input, output or errors), as a download.
    Another organisation's file is a 404, as one that does not exist."""
    stored = file_for_organization(request.organization.pk, file_id)
    if stored is None:
        raise Http404("No such file.")
    try:
        handle = get_artifact_store().open_file(stored.uri)
    except FileNotFoundError:  # its bytes are gone (deleted or expired): the row alone is no file
        raise Http404("This file is no longer stored.") from None
    response = StreamingHttpResponse(_chunks(handle), content_type="application/jsonl")
    response["Content-Disposition"] = content_disposition_header(True, stored.filename) or "attachment"
    response["Content-Length"] = str(stored.bytes)
    return response


@org_member_required()
@require_GET
def portal_webhooks(request: OrgRequest, org_id: int) -> HttpResponse:
    """The organisation's recent webhooks and, for its admins, the secret that signs them."""
    organization = request.organization
    can_manage = _is_admin(request)
    deliveries = deliveries_of(organization.pk, limit=DELIVERIES_SHOWN)
    prefetch_related_objects(deliveries, "batch")  # each links to its batch
    context = {
        "organization": organization,
        "can_manage": can_manage,
        "secret": organization_webhook_secret(organization_id=organization.pk) if can_manage else "",
        "deliveries": deliveries,
        "signature_header": SIGNATURE_HEADER,
        "tolerance_minutes": settings.WEBHOOK_TOLERANCE_SECONDS // 60,
    }
    response = render(request, "console/portal/webhooks.html", context)
    return never_stored(response) if can_manage else response


@org_member_required(admin=True)
@require_POST
def portal_webhook_secret_rotate(request: OrgRequest, org_id: int) -> HttpResponse:
    """A new signing secret, at once: every webhook from now on, retries included, is signed with it."""
    organization_webhook_secret(organization_id=request.organization.pk, rotate=True)
    messages.success(request, "The signing secret is rotated: webhooks are signed with the new one from now on.")
    return redirect("console:portal-webhooks", org_id=org_id)


# --- The console ---------------------------------------------------------------------------


@platform_admin_required
@require_GET
def console_batches(request: HttpRequest) -> HttpResponse:
    """Every organisation's batches, newest first, filtered by status."""
    form, page = _filtered(request, None)
    context = {
        "form": form,
        "page": page,
        "rows": batch_rows(list(page.object_list)),
        "query": query_without_page(request),
        "can_manage": True,  # a platform admin acts as every organisation's admin
    }
    return render(request, "console/batches/list.html", context)


P = "portal/<int:org_id>/"
urlpatterns: list[URLPattern | URLResolver] = [
    path("console/batches/", console_batches, name="batches"),
    path(f"{P}batches/", portal_batches, name="portal-batches"),
    path(f"{P}batches/new/", portal_batch_create, name="portal-batch-create"),
    path(f"{P}batches/<str:batch_id>/", portal_batch, name="portal-batch"),
    path(f"{P}batches/<str:batch_id>/cancel/", portal_batch_cancel, name="portal-batch-cancel"),
    path(f"{P}files/<str:file_id>/", portal_file, name="portal-file"),
    path(f"{P}webhooks/", portal_webhooks, name="portal-webhooks"),
    path(f"{P}webhooks/rotate/", portal_webhook_secret_rotate, name="portal-webhook-rotate"),
]
NAV: list[NavItem] = [
    NavItem("Batches", "batches", CONSOLE),
    NavItem("Batches", "portal-batches", PORTAL),
    NavItem("Webhooks", "portal-webhooks", PORTAL),
]
