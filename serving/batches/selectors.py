"""Reads of batch jobs as the console and the portal list them: progress, queued lines, queue
stats, a batch's usage and the errors of its failed lines."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Q, QuerySet, Sum
from django.db.models.fields.json import KT
from django.utils import timezone

from billing.selectors import RequestsUsage, usage_of_requests
from serving.batches.models import Batch, BatchLine
from serving.batches.services import BadBatch, line_request_id

# Lines still to run: waiting for a worker, or with one.
_LINES_TO_RUN = (BatchLine.Status.PENDING, BatchLine.Status.RUNNING)


# Statuses whose counts are live in the lines (as ``serving.batches.selectors.request_counts`` reads them).
_COUNTED_LIVE = (Batch.Status.IN_PROGRESS, Batch.Status.FINALIZING, Batch.Status.CANCELLING)


# Throughput is the lines finished over this window, per minute.
THROUGHPUT_WINDOW = timedelta(minutes=5)

# Why a line that never ran ends in the error file, by the batch's stop reason.
NOT_RUN = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
    "insufficient_quota": (
        "insufficient_quota",
        "This request was not executed: the organization reached its spend cap or token quota.",
    ),
    "key_revoked": ("api_key_revoked", "This request was not executed: the batch's API key was revoked."),
    "key_expired": ("api_key_expired", "This request was not executed: the batch's API key expired."),
    "failed": ("batch_failed", "This request was not executed: the batch failed (see its errors)."),
}
# Batches whose error file lists the lines that never ran (``serving.batches.lines._finalize``).
_ENDED_WITH_FILES = (Batch.Status.COMPLETED, Batch.Status.CANCELLED, Batch.Status.EXPIRED)


def batches_listed(*, organization_id: int | None = None, status: str = "") -> QuerySet[Batch]:
    """Batches newest first, with their files and organisation: one organisation's, or every
    organisation's for None; only those in ``status`` when one is given."""
    batches = Batch.objects.all() if organization_id is None else Batch.objects.filter(organization_id=organization_id)
    if status:
        batches = batches.filter(status=status)
    return batches.select_related("organization", "input_file", "output_file", "error_file").order_by(
        "-created_at", "-pk"
    )


def batch_progress(batches: Iterable[Batch]) -> dict[int, dict[str, int]]:
    """``serving.batches.selectors.request_counts`` of many batches (total, completed, failed by batch id),
    with one query for the lines of those still running rather than one per batch."""
    batches = list(batches)
    live = [b.pk for b in batches if b.status in _COUNTED_LIVE]
    finished: dict[int, dict[str, int]] = defaultdict(dict)
    rows = (
        BatchLine.objects.filter(batch_id__in=live, status__in=[BatchLine.Status.SUCCEEDED, BatchLine.Status.FAILED])
        .values_list("batch_id", "status")
        .annotate(n=Count("pk"))
        .order_by()
    )
    for batch_id, status, n in rows:
        finished[batch_id][status] = n
    progress = {}
    for b in batches:
        if b.status in _COUNTED_LIVE:
            done = finished[b.pk]
            progress[b.pk] = {"total": b.total, "completed": done.get("succeeded", 0), "failed": done.get("failed", 0)}
        else:
            progress[b.pk] = {"total": b.total, "completed": b.completed, "failed": b.failed}
    return progress


def batch_lines_running(batch: Batch) -> int:
    """The batch's lines a worker runs now (they finish, whatever happens to the batch)."""
    return BatchLine.objects.filter(batch=batch, status=BatchLine.Status.RUNNING).count()


def batch_lines_queued(*, models: Collection[str]) -> dict[str, list[tuple[int, int]]]:
    """For each model, its batches in progress with lines still to run, oldest first (the order
    workers take them in), each as (batch id, lines to run). Per model these add up to
    ``serving.batches.services.enqueued_lines_of_model``."""
    rows = (
        BatchLine.objects.filter(
            batch__model__in=list(models), batch__status=Batch.Status.IN_PROGRESS, status__in=_LINES_TO_RUN
        )
        .values_list("batch__model", "batch_id", "batch__created_at")
        .annotate(n=Count("pk"))
        .order_by("batch__created_at", "batch_id")
    )
    queued: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for model, batch_id, _created, n in rows:
        queued[model].append((batch_id, n))
    return dict(queued)


def batch_queue_stats(*, now: datetime | None = None) -> dict[str, Any]:
    """The batch queue across every organisation: lines ``waiting`` (not started, in batches
    validating or in progress: the queue's depth), lines ``running``, lines ``finished_recently``
    (succeeded or failed over the last THROUGHPUT_WINDOW) and that as ``per_minute``, and the
    batches ``in_progress``."""
    now = now or timezone.now()
    # A cancelling batch's pending lines never start; a running line finishes whatever its batch.
    by_status = dict(
        BatchLine.objects.filter(
            Q(status=BatchLine.Status.PENDING, batch__status=Batch.Status.IN_PROGRESS)
            | Q(status=BatchLine.Status.RUNNING)
        )
        .values_list("status")
        .annotate(n=Count("pk"))
        .order_by()
    )
    validating = Batch.objects.filter(status=Batch.Status.VALIDATING).aggregate(n=Sum("total"))["n"] or 0
    finished = BatchLine.objects.filter(
        finished_at__gte=now - THROUGHPUT_WINDOW, status__in=[BatchLine.Status.SUCCEEDED, BatchLine.Status.FAILED]
    ).count()
    minutes = THROUGHPUT_WINDOW.total_seconds() / 60
    return {
        "waiting": by_status.get(BatchLine.Status.PENDING, 0) + int(validating),
        "running": by_status.get(BatchLine.Status.RUNNING, 0),
        "finished_recently": finished,
        "window_minutes": int(minutes),
        "per_minute": round(finished / minutes, 1),
        "in_progress": Batch.objects.filter(status=Batch.Status.IN_PROGRESS).count(),
    }


def batch_for_organization(organization_id: int, public_id: str) -> Batch | None:
    return (
        Batch.objects.select_related("input_file", "output_file", "error_file")
        .filter(organization_id=organization_id, public_id=public_id)
        .first()
    )


def batches_page(organization_id: int | None, *, limit: int, after: str | None) -> tuple[list[Batch], bool]:
    """One page of batches, newest first (one organisation's, or all of them for None), and
    whether more follow."""
    batches = Batch.objects.all() if organization_id is None else Batch.objects.filter(organization_id=organization_id)
    batches = batches.select_related("input_file", "output_file", "error_file", "organization")
    batches = batches.order_by("-created_at", "-pk")
    if after:
        cursor = batches.filter(public_id=after).first()
        if cursor is None:
            raise BadBatch(f"after names no batch of yours: {after!r}.", param="after")
        batches = batches.filter(
            Q(created_at__lt=cursor.created_at) | Q(created_at=cursor.created_at, pk__lt=cursor.pk)
        )
    rows = list(batches[: limit + 1])
    return rows[:limit], len(rows) > limit


def _stamp(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value else None


def request_counts(batch: Batch) -> dict[str, int]:
    """Total, completed and failed lines; live from the lines while the batch runs
    (``serving.batches.selectors.batch_progress``, which counts many batches at once)."""
    return batch_progress([batch])[batch.pk]


def batch_object(batch: Batch, counts: dict[str, int] | None = None) -> dict[str, Any]:
    """The batch as OpenAI's API shows it (``counts``: its request counts, when read already)."""
    errors = {"object": "list", "data": batch.errors} if batch.errors else None
    return {
        "id": batch.public_id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model or None,
        "errors": errors,
        "input_file_id": batch.input_file_public_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file.public_id if batch.output_file else None,
        "error_file_id": batch.error_file.public_id if batch.error_file else None,
        "created_at": _stamp(batch.created_at),
        "in_progress_at": _stamp(batch.in_progress_at),
        "expires_at": _stamp(batch.expires_at),
        "finalizing_at": _stamp(batch.finalizing_at),
        "completed_at": _stamp(batch.completed_at),
        "failed_at": _stamp(batch.failed_at),
        "expired_at": _stamp(batch.expired_at),
        "cancelling_at": _stamp(batch.cancelling_at),
        "cancelled_at": _stamp(batch.cancelled_at),
        "request_counts": counts if counts is not None else request_counts(batch),
        "metadata": batch.metadata or None,
    }


def not_run_error(stop_reason: str) -> tuple[str, str]:
    """The error (code, message) of a line that never ran, as the batch's error file gives it."""
    return NOT_RUN.get(stop_reason, NOT_RUN["cancelled"])


def batch_usage(batch: Batch) -> RequestsUsage:
    """What the batch's lines consumed so far: the usage records of their answers, added up.
    A line's record is written moments after its answer (``serving.batches.worker``); a line
    that never reached an engine has none. A line's request id is its answering attempt's
    (``line_request_id``), the one its usage record and its result in the output file carry."""
    answered = BatchLine.objects.filter(
        batch=batch, status__in=[BatchLine.Status.SUCCEEDED, BatchLine.Status.FAILED], attempts__gte=1
    ).values_list("index", "attempts")
    request_ids = [line_request_id(batch.public_id, index, attempts) for index, attempts in answered.iterator(5000)]
    return usage_of_requests(organization_id=batch.organization_id, request_ids=request_ids)


@dataclass(frozen=True)
class LineError:
    """Failed lines of a batch that share an error code and message."""

    code: str
    message: str
    lines: int


@dataclass(frozen=True)
class ErrorSummary:
    """A batch's failed lines by error, most frequent first: the ``top`` few, and how many lines
    the others (``other_lines``, of ``other_kinds`` errors) add up to."""

    top: list[LineError]
    other_lines: int
    other_kinds: int

    @property
    def lines(self) -> int:
        return sum(e.lines for e in self.top) + self.other_lines


def batch_error_summary(batch: Batch, *, top: int = 5) -> ErrorSummary:
    """The batch's failed lines counted by error (code and message), as its error file will
    list them: those that failed, and once it has ended, those that never ran (cancelled,
    expired, stopped by a cap). Live while the batch runs."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    failed = (
        BatchLine.objects.filter(batch=batch, status=BatchLine.Status.FAILED)
        .values_list(KT("error__code"), KT("error__message"))
        .annotate(n=Count("pk"))
        .order_by()
    )
    for code, message, n in failed:
        counts[(code or "", message or "")] += n
    if batch.status in _ENDED_WITH_FILES:
        never_ran = BatchLine.objects.filter(
            batch=batch, status__in=[BatchLine.Status.PENDING, BatchLine.Status.RUNNING]
        ).count()
        if never_ran:
            counts[not_run_error(batch.stop_reason)] += never_ran
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    rest = ranked[top:]
    return ErrorSummary(
        top=[LineError(code=code, message=message, lines=n) for (code, message), n in ranked[:top]],
        other_lines=sum(n for _, n in rest),
        other_kinds=len(rest),
    )
