"""Batch jobs' writes that users start: create a batch from an uploaded file (its checks and its
estimate), or from a file uploaded with it (the portal's form), cancel it, and wake the workers."""

from __future__ import annotations

import secrets
import uuid
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import Avg, Sum
from django.utils import timezone

from accounts.models import Organization
from billing.models import UsageRecord
from core.transitions import check_transition
from core.validators import nul_path
from serving.batches import enqueue
from serving.batches.files import BATCH_URLS, file_create, file_delete
from serving.batches.models import Batch, BatchLine, StoredFile
from serving.gateway.errors import bounded
from serving.llm.call import CHAT, COMPLETIONS, EMBEDDINGS

# The request ids of batch lines: uuid5 of this and "<batch>/<line>/<attempt>".
LINE_NAMESPACE = uuid.UUID("6f1d2b5e-6c1a-4a8e-9d55-0c7b3a1e2f40")
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/v1/embeddings": EMBEDDINGS}
PREDICT_URL = "/api/v1/predict"


# StoredFile.public_id's column: a longer id names no file.
FILE_ID_MAX_LENGTH = 40


class BadBatch(ValueError):
    """A batch the API refuses (``status`` 400, or 429 for a full queue); ``param`` names the field."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def line_request_id(batch_public_id: str, index: int, attempt: int) -> uuid.UUID:
    return uuid.uuid5(LINE_NAMESPACE, f"{batch_public_id}/{index}/{attempt}")


def _window_hours(window: str) -> int:
    if window not in settings.BATCH_COMPLETION_WINDOWS:
        raise BadBatch(
            f"completion_window must be one of {', '.join(repr(w) for w in settings.BATCH_COMPLETION_WINDOWS)}.",
            param="completion_window",
        )
    try:
        hours = int(window.removesuffix("h"))
    except ValueError:
        raise BadBatch(f"completion_window {window!r} is not a number of hours.", param="completion_window") from None
    return hours


def _check_metadata(metadata: object) -> dict[str, str]:
    """OpenAI's rule: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise BadBatch("metadata must be an object of at most 16 key-value pairs.", param="metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise BadBatch(
                "metadata's keys are strings of at most 64 characters, its values strings of at most 512.",
                param="metadata",
            )
    if nul_path(metadata) is not None:
        raise BadBatch("metadata may not hold a NUL character (\\u0000).", param="metadata")
    return dict(metadata)


def enqueued_lines(organization_id: int) -> int:
    """Lines the organisation's unfinished batches have still to run."""
    validating = Batch.objects.filter(organization_id=organization_id, status=Batch.Status.VALIDATING).aggregate(
        n=Sum("total")
    )
    to_run = BatchLine.objects.filter(
        batch__organization_id=organization_id,
        batch__status__in=Batch.UNFINISHED,
        status__in=[BatchLine.Status.PENDING, BatchLine.Status.RUNNING],
    ).count()
    return int(validating["n"] or 0) + to_run


def enqueued_lines_of_model(model: str) -> int:
    """Lines of the model that batches in progress have still to run (all organisations)."""
    return BatchLine.objects.filter(
        batch__model=model, batch__status=Batch.Status.IN_PROGRESS,
        status__in=[BatchLine.Status.PENDING, BatchLine.Status.RUNNING],
    ).count()  # fmt: skip


def estimated_seconds(model: str, lines: int) -> int:
    """How long ``lines`` requests of the model should take as batch work now: from the rate at
    which its batch lines finished over the last ten minutes, else from its requests' mean
    latency over the last hour and the lines a worker runs at once, else a second each."""
    now = timezone.now()
    recent = BatchLine.objects.filter(
        batch__model=model, finished_at__gte=now - timedelta(minutes=10), status=BatchLine.Status.SUCCEEDED
    )
    finished = recent.count()
    queued = enqueued_lines_of_model(model)
    if finished >= 20:
        first = recent.order_by("finished_at").values_list("finished_at", flat=True).first()
        span = max(1.0, (now - first).total_seconds()) if first else 600.0
        return max(1, round((lines + queued) * span / finished))
    latency = UsageRecord.objects.filter(
        model=model, status_code=200, created_at__gte=now - timedelta(hours=1)
    ).aggregate(ms=Avg("latency_ms"))["ms"]
    per_line = (latency / 1000) if latency else 1.0
    return max(1, round((lines + queued) * per_line / max(1, settings.BATCH_SLOTS_PER_REPLICA)))


def batch_create(
    *,
    organization_id: int,
    api_key_id: int,
    input_file_id: str,
    endpoint: str,
    completion_window: str = "24h",
    metadata: object = None,
    callback_url: str = "",
) -> Batch:
    """A new batch (validating) of the organisation's input file; ``BadBatch`` says why not.
    A batch worker starts on it as soon as the transaction commits."""
    if endpoint not in BATCH_URLS:
        raise BadBatch(f"endpoint must be one of {', '.join(BATCH_URLS)}.", param="endpoint")
    hours = _window_hours(completion_window)
    meta = _check_metadata(metadata)
    if not isinstance(input_file_id, str) or not input_file_id:
        raise BadBatch("input_file_id is required: the id of a file uploaded with purpose 'batch'.",
                       param="input_file_id")  # fmt: skip
    if len(input_file_id) > FILE_ID_MAX_LENGTH or "\x00" in input_file_id:
        raise BadBatch(f"No file {bounded(repr(input_file_id), 100)} of yours.", param="input_file_id",
                       code="file_not_found")  # fmt: skip
    with transaction.atomic():
        # One creation per organisation at a time: the enqueued-lines limit holds under races.
        Organization.objects.select_for_update().filter(pk=organization_id).first()
        file = StoredFile.objects.filter(organization_id=organization_id, public_id=input_file_id).first()
        if file is None:
            raise BadBatch(f"No file {input_file_id!r} of yours.", param="input_file_id", code="file_not_found")
        if file.purpose != "batch":
            raise BadBatch(f"File {input_file_id!r} has purpose {file.purpose!r}; a batch reads 'batch' files.",
                           param="input_file_id")  # fmt: skip
        waiting = enqueued_lines(organization_id)
        if waiting + file.lines > settings.BATCH_MAX_ENQUEUED_LINES:
            raise BadBatch(
                f"Your organization has {waiting} batch requests waiting; {file.lines} more would pass its limit "
                f"of {settings.BATCH_MAX_ENQUEUED_LINES}. Try again when some batches have finished.",
                status=429,
                code="enqueued_limit_exceeded",
            )
        batch = Batch.objects.create(
            public_id="batch_" + secrets.token_hex(12),
            organization_id=organization_id,
            api_key_id=api_key_id,
            endpoint=endpoint,
            input_file=file,
            input_file_public_id=file.public_id,
            completion_window=completion_window,
            metadata=meta,
            callback_url=callback_url,
            total=file.lines,
            expires_at=timezone.now() + timedelta(hours=hours),
        )
        transaction.on_commit(wake_workers)
    return batch


def batch_create_from_upload(
    *,
    organization_id: int,
    api_key_id: int,
    upload: Path,
    filename: str,
    endpoint: str,
    completion_window: str = "24h",
    metadata: object = None,
) -> Batch:
    """The two calls of the Files and Batch APIs in one (the portal's form): store the upload as
    an input file (``file_create``: every line checked, the storage quota), then create the
    batch of it (``batch_create``). ``BadFile`` or ``BadBatch`` say why not; a batch refused
    leaves no file behind (its uploader never saw the file's id)."""
    stored = file_create(
        organization_id=organization_id, api_key_id=api_key_id, upload=upload, filename=filename, purpose="batch"
    )
    try:
        return batch_create(
            organization_id=organization_id, api_key_id=api_key_id, input_file_id=stored.public_id,
            endpoint=endpoint, completion_window=completion_window, metadata=metadata,
        )  # fmt: skip
    except BadBatch:
        file_delete(file=stored)
        raise


def wake_workers() -> None:
    """Queue a batch_work run now rather than at the next tick (never raises: the beat comes anyway)."""
    enqueue.queue(enqueue.BATCH_WORK, expires=settings.BATCH_WORK_SECONDS)


def batch_cancel(*, batch: Batch) -> Batch:
    """Stop a batch: no line starts from now on; those in flight finish; then it is cancelled
    with what was done in its output file. A batch already finished is left as it is (409)."""
    with transaction.atomic():
        locked = Batch.objects.select_for_update().get(pk=batch.pk)
        if locked.status in (Batch.Status.CANCELLING, Batch.Status.CANCELLED):
            return locked
        if locked.status not in (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS):
            raise BadBatch(f"Batch {locked.public_id} is {locked.status}; it can no longer be cancelled.", status=409)
        check_transition(locked, Batch.Status.CANCELLING)
        locked.cancelling_at = timezone.now()
        locked.stop_reason = locked.stop_reason or "cancelled"
        locked.save(update_fields=["status", "cancelling_at", "stop_reason"])
        transaction.on_commit(wake_workers)
    return locked
