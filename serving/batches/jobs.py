"""Batch jobs: the requests of an uploaded file run offline, each exactly once, at the batch price.

OpenAI's Batch API (``/v1/batches``, ``serving.batches.views``) and the seeds' ``/api/v1/batch``
create a ``Batch`` from a file of requests (``serving.batches.files``). Celery's ``batch`` queue does
the rest (``serving.tasks.batch_work`` → ``work``): it validates the file into ``BatchLine``
rows (validating → in_progress), runs the lines through the same request scripts as
interactive traffic (``InferenceCall``, ``PredictCall``: routing, canaries, the caches,
metering) at a low priority, and when no line is left to run writes the output and error
files in line order (finalizing → completed; or expired, cancelled).

Exactly once, whoever dies:

- A worker claims lines (``SELECT … FOR UPDATE SKIP LOCKED``): running, with a lease it
  renews while they run, and an attempt number. Attempt *k* of line *i* is the request
  ``uuid5(batch, i, k)`` in the ledger.
- A line's answer is written (conditionally: still running, same attempt) *before* its usage
  event; the event is written once the answer is stored, and kept on the row until then
  (``metered``), so a worker that dies between the two leaves it for the next tick to write.
  The ledger writes an event once per request id, so writing it twice changes nothing.
- A line whose worker died (its lease ran out) goes back to pending; its attempt's admission
  is given back (``ledger.release``: no event, nothing charged) and it runs again as the
  next attempt. The sweeper of lost gateways leaves batch lines' admissions to this.
- An engine that fails or vanishes mid-line gives the line back the same way, up to
  ``BATCH_MAX_ATTEMPTS``; a request the model refuses (4xx) is an answer: it fails, in the
  error file, metered as interactive traffic would be.

A batch whose organisation reaches a spend cap or token quota stops taking lines: the rest
end in the error file as ``insufficient_quota`` (nothing is overspent: each line is
admitted against the budgets like any request). Cancel stops new lines at once; lines in
flight finish. At the completion window's end the batch expires: lines done are kept, the
rest end as ``batch_expired``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import math
import os
import secrets
import socket
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
from django.conf import settings
from django.db import InterfaceError, OperationalError, transaction
from django.db.models import Avg, Count, Exists, F, OuterRef, Q, Sum
from django.utils import timezone
from redis.exceptions import RedisError

from accounts.grants import KeyGrant
from accounts.models import ApiKey, Organization
from billing import ledger
from billing.ledger import UsageEvent
from billing.models import UsageRecord
from core import keys
from core.db import run_db
from core.redis import async_redis
from core.transitions import check_transition
from core.validators import nul_path, without_nul
from registry.artifacts import get_artifact_store
from serving.batches import enqueue
from serving.batches.files import BATCH_URLS, check_line, files_purge_expired
from serving.batches.models import Batch, BatchLine, StoredFile
from serving.batches.selectors import batch_progress
from serving.batches.webhooks import webhook_enqueue, webhooks_deliver_due
from serving.gateway.admission import status_of
from serving.gateway.errors import APIError, bounded
from serving.gateway.routing import find_model, router
from serving.llm.call import CHAT, COMPLETIONS, EMBEDDINGS, InferenceCall
from serving.predict.call import PredictCall
from serving.predict.instances import predict_answer

logger = logging.getLogger(__name__)

# The request ids of batch lines: uuid5 of this and "<batch>/<line>/<attempt>".
LINE_NAMESPACE = uuid.UUID("6f1d2b5e-6c1a-4a8e-9d55-0c7b3a1e2f40")
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/v1/embeddings": EMBEDDINGS}
PREDICT_URL = "/api/v1/predict"
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
# StoredFile.public_id's column: a longer id names no file.
FILE_ID_MAX_LENGTH = 40
# The database is away (not a batch's fault): the step is tried again on the next turn.
DATABASE_DOWN = (OperationalError, InterfaceError)
# Failures an engine (or the platform) may not repeat: the line is given back and tried again.
RETRYABLE = frozenset({500, 502, 503, 504})


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


# --- create, cancel ------------------------------------------------------------------------


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


# --- reads -----------------------------------------------------------------------------------


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


# --- validation: the file becomes lines --------------------------------------------------------


def _read_lines(file: StoredFile) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """The file's requests, numbered from 1: each as ``check_line`` reads it, or why it is not
    one (a file stored before a rule of ``check_line`` was added may break it)."""
    with get_artifact_store().open_file(file.uri) as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                yield number, check_line(raw)
            except ValueError as why:
                yield number, f"Line {number} {why}."


def validate_one() -> bool:
    """Validate one batch waiting for it (its lines written, in_progress; or failed, with the
    errors OpenAI's shape gives). All in one transaction: a worker that dies midway leaves it
    validating for the next. A batch whose file cannot be read into lines for any other reason
    (the store lost it, the database refuses a line) fails with that reason, so the batches
    behind it go on. False when none was waiting."""
    with transaction.atomic():
        batch = (
            Batch.objects.select_for_update(skip_locked=True)
            .filter(status=Batch.Status.VALIDATING)
            .order_by("created_at")
            .first()
        )
        if batch is None:
            return False
        try:
            with transaction.atomic():  # a savepoint: what it wrote goes if it fails
                _validate(batch)
        except DATABASE_DOWN:
            raise  # not this batch's fault: it stays validating for the next run
        except Exception as exc:
            logger.exception("batch %s could not be validated", batch.public_id)
            batch.refresh_from_db()
            _fail(batch, code="validation_failed",
                  message=f"The input file could not be read into requests: {bounded(str(exc), 500)}")  # fmt: skip
    return True


def _validate(batch: Batch) -> None:
    errors: list[dict[str, Any]] = []
    lines: list[BatchLine] = []
    model = ""
    file = batch.input_file
    if file is None:
        errors.append({"code": "file_not_found", "message": "The input file was deleted.", "param": None,
                       "line": None})  # fmt: skip
    else:
        for index, (number, line) in enumerate(_read_lines(file)):
            if isinstance(line, str):
                errors.append({"code": "invalid_line", "param": None, "line": number, "message": line})
            elif line.get("url") != batch.endpoint:
                errors.append({
                    "code": "mismatched_endpoint", "param": "url", "line": number,
                    "message": f"Line {number} has url {line.get('url')!r}; this batch runs {batch.endpoint}.",
                })  # fmt: skip
            else:
                named = line["body"]["model"]
                if model and named != model:
                    errors.append({
                        "code": "mismatched_model", "param": "body.model", "line": number,
                        "message": f"Line {number} asks for model {bounded(repr(named), 100)}; a batch runs one "
                                   f"model ({model!r}).",
                    })  # fmt: skip
                model = model or named
                lines.append(BatchLine(batch=batch, index=index, custom_id=line["custom_id"], body=line["body"]))
            if len(errors) >= 10:
                break
    now = timezone.now()
    if errors:
        check_transition(batch, Batch.Status.FAILED)
        batch.errors, batch.failed_at = errors, now
        batch.save(update_fields=["status", "errors", "failed_at"])
        transaction.on_commit(functools.partial(_announce, batch.pk))
        return
    BatchLine.objects.bulk_create(lines, batch_size=2000)
    check_transition(batch, Batch.Status.IN_PROGRESS)
    batch.model, batch.total, batch.in_progress_at = model, len(lines), now
    batch.save(update_fields=["status", "model", "total", "in_progress_at"])


def _fail(batch: Batch, *, code: str, message: str) -> None:
    """End a batch the worker cannot carry on (locked by the caller): failed, with the reason
    in its errors; nothing more of it starts (lines in flight still finish and are metered)."""
    check_transition(batch, Batch.Status.FAILED)
    batch.errors = [*(batch.errors or []), {"code": code, "message": message, "param": None, "line": None}]
    batch.failed_at = timezone.now()
    batch.stop_reason = batch.stop_reason or "failed"
    batch.save(update_fields=["status", "errors", "failed_at", "stop_reason"])
    transaction.on_commit(functools.partial(_announce, batch.pk))


# --- claiming and leases (sync; each a short transaction) -----------------------------------------


@dataclass(frozen=True)
class Claimed:
    line_id: int
    batch_id: int
    batch_public_id: str
    api_key_id: int
    endpoint: str
    index: int
    attempt: int
    body: dict[str, Any]

    @property
    def request_id(self) -> uuid.UUID:
        return line_request_id(self.batch_public_id, self.index, self.attempt)

    @property
    def previous_request_id(self) -> uuid.UUID | None:
        return line_request_id(self.batch_public_id, self.index, self.attempt - 1) if self.attempt > 1 else None


@dataclass(frozen=True)
class Runnable:
    """A batch with lines waiting, as the fair claim weighs it."""

    batch_id: int
    public_id: str
    organization_id: int
    weight: int  # the organisation's batch_weight
    api_key_id: int
    endpoint: str

    def line(self, line_id: int, index: int, attempt: int, body: dict[str, Any]) -> Claimed:
        return Claimed(line_id, self.batch_id, self.public_id, self.api_key_id, self.endpoint, index, attempt, body)


def runnable_models() -> dict[str, list[Runnable]]:
    """Batches with lines to run, by model (oldest first): in progress, not stopped, not expired."""
    out: dict[str, list[Runnable]] = defaultdict(list)
    pending = BatchLine.objects.filter(batch=OuterRef("pk"), status=BatchLine.Status.PENDING)
    rows = (
        Batch.objects.filter(status=Batch.Status.IN_PROGRESS, stop_reason="", expires_at__gt=timezone.now())
        .filter(Exists(pending))
        .order_by("created_at", "pk")
        .values_list(
            "model", "pk", "public_id", "organization_id", "organization__batch_weight", "api_key_id", "endpoint"
        )
    )
    for model, pk, public_id, organization_id, weight, api_key_id, endpoint in rows:
        out[model].append(Runnable(pk, public_id, organization_id, max(1, weight or 1), api_key_id, endpoint))
    return out


def fair_shares(batches: list[Runnable], running: dict[int, int], slots: int) -> dict[int, int]:
    """How many of ``slots`` new lines each batch gets (by batch id), so that lines in flight
    are shared fairly: between organisations in proportion to their ``weight`` (the one with
    the fewest in flight per unit of weight gets the next slot), and between one
    organisation's batches evenly; ties go to the oldest. ``running``: lines in flight now, by
    batch (every worker's: one organisation's 50,000-line batch holds at most its share)."""
    by_org: dict[int, list[Runnable]] = defaultdict(list)
    for batch in batches:  # oldest first
        by_org[batch.organization_id].append(batch)
    load = {b.batch_id: running.get(b.batch_id, 0) for b in batches}
    org_load = {org: sum(load[b.batch_id] for b in own) for org, own in by_org.items()}
    order = {org: i for i, org in enumerate(by_org)}  # the organisation of the oldest batch first
    weight = {org: own[0].weight for org, own in by_org.items()}
    heap = [(org_load[org] / weight[org], order[org], org) for org in by_org]
    heapq.heapify(heap)
    shares: dict[int, int] = defaultdict(int)
    for _ in range(max(0, slots)):
        _, rank, org = heapq.heappop(heap)
        own = by_org[org]
        chosen = min(own, key=lambda b: (load[b.batch_id], own.index(b)))
        load[chosen.batch_id] += 1
        shares[chosen.batch_id] += 1
        org_load[org] += 1
        heapq.heappush(heap, (org_load[org] / weight[org], rank, org))
    return dict(shares)


def claim(*, batches: list[Runnable], owner: str, limit: int) -> list[Claimed]:
    """Take up to ``limit`` pending lines of these batches for ``owner``, shared fairly
    between their organisations and batches (``fair_shares``); a batch with fewer pending
    lines than its share leaves the rest to the others."""
    if limit <= 0 or not batches:
        return []
    lease = timezone.now() + timedelta(seconds=settings.BATCH_LEASE_SECONDS)
    claimed: list[Claimed] = []
    with transaction.atomic():
        live = set(
            Batch.objects.filter(
                pk__in=[b.batch_id for b in batches], status=Batch.Status.IN_PROGRESS, stop_reason="",
                expires_at__gt=timezone.now(),
            ).values_list("pk", flat=True)
        )  # fmt: skip
        candidates = [b for b in batches if b.batch_id in live]
        running = dict(
            BatchLine.objects.filter(batch_id__in=live, status=BatchLine.Status.RUNNING)
            .values("batch_id")
            .annotate(n=Count("pk"))
            .values_list("batch_id", "n")
        )
        while candidates and len(claimed) < limit:
            shares = fair_shares(candidates, running, limit - len(claimed))
            exhausted: set[int] = set()
            for batch in candidates:
                want = shares.get(batch.batch_id, 0)
                if not want:
                    continue
                rows = list(
                    BatchLine.objects.select_for_update(skip_locked=True)
                    .filter(batch_id=batch.batch_id, status=BatchLine.Status.PENDING)
                    .order_by("index")
                    .only("pk", "index", "attempts", "body")[:want]
                )
                if len(rows) < want:
                    exhausted.add(batch.batch_id)
                if not rows:
                    continue
                BatchLine.objects.filter(pk__in=[r.pk for r in rows]).update(
                    status=BatchLine.Status.RUNNING, attempts=F("attempts") + 1, lease_until=lease, owner=owner
                )
                running[batch.batch_id] = running.get(batch.batch_id, 0) + len(rows)
                claimed += [batch.line(r.pk, r.index, r.attempts + 1, r.body) for r in rows]
            if not exhausted:
                break
            candidates = [b for b in candidates if b.batch_id not in exhausted]
    return claimed


def renew_leases(*, owner: str) -> int:
    until = timezone.now() + timedelta(seconds=settings.BATCH_LEASE_SECONDS)
    return BatchLine.objects.filter(owner=owner, status=BatchLine.Status.RUNNING).update(lease_until=until)


def reclaim_lost() -> list[uuid.UUID]:
    """Give back lines whose worker's lease ran out (it died, or lost the database): pending
    again. Returns their attempts' request ids, for the ledger to release (after this commits,
    so a late worker can no longer store that attempt's answer)."""
    released: list[uuid.UUID] = []
    with transaction.atomic():
        rows = list(
            BatchLine.objects.select_for_update(skip_locked=True)
            .filter(status=BatchLine.Status.RUNNING, lease_until__lt=timezone.now())
            .select_related("batch")
            .only("pk", "index", "attempts", "batch__public_id")[:1000]
        )
        if rows:
            BatchLine.objects.filter(pk__in=[r.pk for r in rows]).update(
                status=BatchLine.Status.PENDING, owner="", lease_until=None
            )
            released = [line_request_id(r.batch.public_id, r.index, r.attempts) for r in rows]
            logger.warning("gave back %d batch lines whose worker stopped renewing them", len(rows))
    return released


def store_answer(
    line: Claimed, *, owner: str, succeeded: bool, status_code: int, response: Any, error: Any,
    event: UsageEvent | None,
) -> bool:  # fmt: skip
    """Write a line's answer if it is still this owner's attempt (False: it was given back)."""
    done = BatchLine.Status.SUCCEEDED if succeeded else BatchLine.Status.FAILED
    return bool(
        BatchLine.objects.filter(
            pk=line.line_id, status=BatchLine.Status.RUNNING, owner=owner, attempts=line.attempt
        ).update(
            # PostgreSQL's JSON cannot hold NUL, which a model may generate: U+FFFD in its place.
            status=done, status_code=status_code, response=without_nul(response), error=without_nul(error),
            usage_event=event.to_fields() if event is not None else None, metered=event is None,
            finished_at=timezone.now(), lease_until=None,
        )
    )  # fmt: skip


def give_back(
    line: Claimed, *, owner: str, exhausted_error: Any = None, status_code: int = 0, failure: bool = True
) -> bool:
    """Put a line back to pending (its engine failed; tried again later), or, past
    BATCH_MAX_ATTEMPTS failures, fail it with ``exhausted_error``; ``failure=False``: it did
    not fail (its batch stopped, or it yielded to interactive requests), it is only put back.
    False when it was not this owner's."""
    mine = BatchLine.objects.filter(pk=line.line_id, status=BatchLine.Status.RUNNING, owner=owner,
                                    attempts=line.attempt)  # fmt: skip
    if not failure:
        return bool(mine.update(status=BatchLine.Status.PENDING, owner="", lease_until=None,
                                attempts=F("attempts") - 1))  # fmt: skip
    if line.attempt >= settings.BATCH_MAX_ATTEMPTS:
        return bool(mine.update(
            status=BatchLine.Status.FAILED, status_code=status_code, response=None, error=exhausted_error,
            metered=True, finished_at=timezone.now(), lease_until=None,
        ))  # fmt: skip
    return bool(mine.update(status=BatchLine.Status.PENDING, owner="", lease_until=None))


def mark_metered(line_id: int) -> None:
    BatchLine.objects.filter(pk=line_id).update(metered=True, usage_event=None)


def unmetered(limit: int = 500) -> list[tuple[int, dict[str, str] | None]]:
    return list(
        BatchLine.objects.filter(
            metered=False, status__in=[BatchLine.Status.SUCCEEDED, BatchLine.Status.FAILED]
        ).values_list("pk", "usage_event")[:limit]
    )


def stop_batch(batch_id: int, reason: str) -> None:
    """No more lines of this batch start (a cap reached, its key revoked); it finalizes."""
    Batch.objects.filter(pk=batch_id, stop_reason="").update(stop_reason=reason)


def expire_due() -> int:
    """Stop the batches whose completion window ended: one in progress stops taking lines and
    finalizes as expired; one still validating (no line ever ran) expires at once."""
    now = timezone.now()
    stopped = Batch.objects.filter(status=Batch.Status.IN_PROGRESS, stop_reason="", expires_at__lte=now).update(
        stop_reason="expired"
    )
    with transaction.atomic():
        # A batch a worker is validating now is locked: skipped, it is looked at next time.
        waiting = list(
            Batch.objects.select_for_update(skip_locked=True).filter(
                status=Batch.Status.VALIDATING, expires_at__lte=now
            )[:100]
        )
        for batch in waiting:
            check_transition(batch, Batch.Status.EXPIRED)
            batch.expired_at, batch.stop_reason = now, "expired"
            batch.save(update_fields=["status", "expired_at", "stop_reason"])
            transaction.on_commit(functools.partial(_announce, batch.pk))
    return stopped + len(waiting)


# --- finalizing: the output and error files ----------------------------------------------------


def _result_line(batch: Batch, line: BatchLine) -> dict[str, Any]:
    request_id = line_request_id(batch.public_id, line.index, max(1, line.attempts))
    out: dict[str, Any] = {"id": f"batch_req_{request_id.hex}", "custom_id": line.custom_id}
    if line.status in (BatchLine.Status.SUCCEEDED, BatchLine.Status.FAILED) and line.response is not None:
        out["response"] = {"status_code": line.status_code, "request_id": request_id.hex, "body": line.response}
        out["error"] = None
    elif line.status == BatchLine.Status.FAILED:
        out["response"] = None
        out["error"] = line.error
    else:  # never ran (or was given back): why, from the batch's stop
        code, message = NOT_RUN.get(batch.stop_reason, NOT_RUN["cancelled"])
        out["response"] = None
        out["error"] = {"code": code, "message": message}
    return out


def _write_file(batch: Batch, rows: Iterator[dict[str, Any]], name: str) -> StoredFile | None:
    store = get_artifact_store()
    with tempfile.NamedTemporaryFile("wb", suffix=".jsonl", delete=False) as handle:
        path = Path(handle.name)
        count = 0
        for row in rows:
            handle.write(orjson.dumps(row) + b"\n")
            count += 1
    try:
        if count == 0:
            return None
        public_id = "file-" + secrets.token_hex(12)
        stored = store.put_file(source=path, key=f"files/{batch.organization_id}/{public_id}.jsonl")
        return StoredFile.objects.create(
            public_id=public_id, organization_id=batch.organization_id, api_key=None, purpose="batch_output",
            filename=f"{batch.public_id}_{name}.jsonl", bytes=stored.size, lines=count, sha256=stored.sha256,
            uri=stored.uri, expires_at=timezone.now() + timedelta(days=settings.FILES_OUTPUT_RETENTION_DAYS),
        )  # fmt: skip
    finally:
        path.unlink(missing_ok=True)


def finalize_ready() -> int:
    """Finish each batch with nothing left to run (or stopped, with nothing running) whose
    every answer is metered: output and error files in line order, counts, final status."""
    done = 0
    candidates = Batch.objects.filter(status__in=[Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING])
    for batch_id in candidates.values_list("pk", flat=True):
        try:
            if _finalize(batch_id):
                done += 1
        except DATABASE_DOWN:
            raise
        except Exception as exc:  # this batch's results cannot be written: it fails, the others go on
            logger.exception("batch %s could not be finalized", batch_id)
            _fail_by_id(batch_id, code="finalize_failed",
                        message=f"The batch's results could not be written: {bounded(str(exc), 500)}")  # fmt: skip
    return done


def _fail_by_id(batch_id: int, *, code: str, message: str) -> None:
    with transaction.atomic():
        batch = Batch.objects.select_for_update().filter(pk=batch_id).first()
        if batch is not None and batch.status in Batch.UNFINISHED:
            _fail(batch, code=code, message=message)


def _finalize(batch_id: int) -> bool:
    with transaction.atomic():
        batch = Batch.objects.select_for_update(skip_locked=True).filter(pk=batch_id).first()
        if batch is None or batch.status not in (Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING):
            return False
        lines = BatchLine.objects.filter(batch=batch)
        stopped = bool(batch.stop_reason) or batch.status == Batch.Status.CANCELLING
        busy = lines.filter(status=BatchLine.Status.RUNNING).exists()
        if busy or (not stopped and lines.filter(status=BatchLine.Status.PENDING).exists()):
            return False
        if lines.filter(metered=False, status__in=[BatchLine.Status.SUCCEEDED, BatchLine.Status.FAILED]).exists():
            return False  # an answer's usage event is still to be written (the next tick does)
        now = timezone.now()
        if batch.status == Batch.Status.IN_PROGRESS:
            check_transition(batch, Batch.Status.FINALIZING)
            batch.finalizing_at = now
        ordered = lines.order_by("index")
        succeeded = ordered.filter(status=BatchLine.Status.SUCCEEDED, status_code__lt=400)
        output = _write_file(batch, (_result_line(batch, line) for line in succeeded.iterator(2000)), "output")
        failed_rows = ordered.exclude(pk__in=succeeded.values("pk"))
        errors = _write_file(batch, (_result_line(batch, line) for line in failed_rows.iterator(2000)), "errors")
        batch.output_file, batch.error_file = output, errors
        batch.completed = output.lines if output else 0
        batch.failed = errors.lines if errors else 0
        final = {"expired": Batch.Status.EXPIRED, "cancelled": Batch.Status.CANCELLED}.get(
            batch.stop_reason, Batch.Status.COMPLETED
        )
        if batch.status == Batch.Status.CANCELLING:
            final = Batch.Status.CANCELLED
        check_transition(batch, final)
        setattr(batch, f"{final}_at", now)
        batch.save()
        transaction.on_commit(lambda: _announce(batch_id))
    return True


def _announce(batch_id: int) -> None:
    """Tell the batch's callback_url it ended (the seeds' webhook), when it has one."""
    batch = Batch.objects.filter(pk=batch_id).first()
    if batch is None or not batch.callback_url:
        return
    webhook_enqueue(
        organization_id=batch.organization_id, url=batch.callback_url, event=f"batch.{batch.status}",
        payload={"type": f"batch.{batch.status}", "created_at": int(time.time()), "data": batch_object(batch)},
        batch_id=batch.pk,
    )  # fmt: skip


# --- the worker (async) -------------------------------------------------------------------------


def _grant(api_key_id: int) -> KeyGrant | None:
    """The grant a batch's lines run under, None once its key is revoked or gone (an expired
    key's grant is returned: ``key_stop_reason`` judges it at each line, as time passes)."""
    api_key = ApiKey.objects.select_related("organization").filter(pk=api_key_id).first()
    if api_key is None or not api_key.is_active:
        return None
    return KeyGrant.of(api_key)


def key_stop_reason(grant: KeyGrant | None) -> str:
    """Why a batch's lines may no longer run under this grant ("" while they may): its key was
    revoked, or expired (a rotated key, past its grace period, too), as an interactive request
    with it would be refused."""
    if grant is None:
        return "key_revoked"
    if grant.expires_at is not None and grant.expires_at <= timezone.now():
        return "key_expired"
    return ""


async def _interactive_in_flight(model: str) -> int:
    """Interactive requests of the model in flight on every gateway (the ledger's model queue;
    batch lines never join it)."""
    try:
        return int(await async_redis().zcard(keys.model_queue(model)))
    except RedisError:
        return 0


async def batch_share(model: str) -> int:
    """How many lines of the model a worker may have in flight now: BATCH_SLOTS_PER_REPLICA
    for each routable replica not taken by an interactive request (each interactive request
    in flight on the model takes a replica's share back), and at least BATCH_MIN_SLOTS, so a
    batch under constant interactive load still moves, one line at a time."""
    try:
        route = await find_model(model)
        replicas = sum(len(router.routable(v)) for v in route.versions)
    except APIError:
        return settings.BATCH_MIN_SLOTS  # the lines fail on their own, each with its error
    interactive = _interactive_now[model] = await _interactive_in_flight(model)
    now = time.monotonic()
    if interactive:
        _interactive_seen[model] = now
    elif now - _interactive_seen.get(model, -math.inf) < settings.BATCH_YIELD_SECONDS:
        # Between one interactive request and the next: not a gap to fill with lines that
        # would still be running when the next arrives.
        return settings.BATCH_MIN_SLOTS
    idle = max(0, replicas - interactive)
    return max(settings.BATCH_MIN_SLOTS, settings.BATCH_SLOTS_PER_REPLICA * idle)


# When each model last had interactive requests in flight, and how many it had when last
# looked at, as this worker saw them.
_interactive_seen: dict[str, float] = {}
_interactive_now: dict[str, int] = {}


@dataclass
class Outcome:
    status: int
    response: Any = None
    error: APIError | None = None
    event: UsageEvent | None = None


async def _execute(line: Claimed, grant: KeyGrant) -> Outcome:
    """Run one line through the interactive request script, its settlement left to us."""
    body = {k: v for k, v in line.body.items() if k not in ("stream", "stream_options")}
    if line.endpoint == PREDICT_URL:
        call = PredictCall(grant, line.request_id, batch=True)
        try:
            answer = await predict_answer(call, body)
            return Outcome(200, answer, event=call.deferred_event)
        except BaseException as exc:
            await call.close(status_of(exc))
            if not isinstance(exc, APIError):
                raise
            return Outcome(exc.status, exc.body(), exc, call.deferred_event)
    inference = InferenceCall(ENDPOINTS[line.endpoint], grant, line.request_id, batch=True)
    try:
        data = await inference.run(orjson.dumps(body))
        assert data is not None  # never a stream
        return Outcome(200, data, event=inference.deferred_event)
    except BaseException as exc:
        await inference.close(status_of(exc))
        if not isinstance(exc, APIError):
            raise
        return Outcome(exc.status, exc.body(), exc, inference.deferred_event)


async def _settle(event: UsageEvent) -> None:
    await ledger.settle_or_defer(event)


async def run_line(line: Claimed, grant: KeyGrant | None, *, owner: str) -> None:
    """One attempt of one line, start to end (see the module for the order of writes)."""
    if line.previous_request_id is not None:  # its last attempt's admission, if never given back
        with contextlib.suppress(RedisError):
            await ledger.release(line.previous_request_id)
    if stop := key_stop_reason(grant):
        await run_db(stop_batch, line.batch_id, stop)
        await run_db(give_back, line, owner=owner, failure=False)
        return
    assert grant is not None
    try:
        outcome = await _execute(line, grant)
    except asyncio.CancelledError:  # it yields (interactive requests came) or the worker stops
        await asyncio.shield(_put_back(line, owner=owner))
        raise
    except Exception as exc:  # a defect here must not stop the batch: the line is given back
        logger.exception("batch line %s/%s failed unexpectedly", line.batch_public_id, line.index)
        outcome = Outcome(500, error=APIError(f"The platform failed running this request: {exc}"))
    if outcome.status == 429 and outcome.error is not None and outcome.error.code == "insufficient_quota":
        await run_db(stop_batch, line.batch_id, "insufficient_quota")
        await _put_back(line, owner=owner)
        return
    if outcome.status in RETRYABLE or outcome.status == 429:
        await _release(line)
        error = outcome.error.detail() if outcome.error is not None else None
        await run_db(give_back, line, owner=owner, exhausted_error=error, status_code=outcome.status)
        return
    event = outcome.event
    stored = await run_db(
        store_answer, line, owner=owner, succeeded=outcome.status < 400, status_code=outcome.status,
        response=outcome.response, error=outcome.error.detail() if outcome.error is not None else None, event=event,
    )  # fmt: skip
    if not stored:  # given back meanwhile (our lease ran out): another attempt answers it
        await _release(line)
        return
    if event is not None:
        await _settle(event)
        await run_db(mark_metered, line.line_id)


async def _put_back(line: Claimed, *, owner: str) -> None:
    """Give a line back unrun and uncounted: its attempt's admission released, pending again
    under the same attempt number (the request id of an attempt never admitted twice: the
    ledger's entry is gone, so the next admission is a new one)."""
    await _release(line)
    await run_db(give_back, line, owner=owner, failure=False)


async def _release(line: Claimed) -> None:
    try:
        await ledger.release(line.request_id)
    except RedisError:
        logger.warning("could not release %s; its next attempt will", line.request_id)


async def meter_leftovers() -> int:
    """Write the usage events of answers stored by a worker that died before writing them."""
    rows = await run_db(unmetered)
    for line_id, fields in rows:
        if fields:
            try:
                event = UsageEvent.from_fields(fields)
            except (KeyError, TypeError, ValueError, ArithmeticError):
                # Never written by this code; kept as it is would stop every line behind it.
                logger.error("batch line %s keeps an unreadable usage event %r; not metered", line_id, fields)
            else:
                await _settle(event)
        await run_db(mark_metered, line_id)
    return len(rows)


async def housekeeping() -> None:
    """What any worker does first: give back lost lines, meter leftovers, validate, expire,
    finalize, and delete files past their retention."""

    async def give_back_lost() -> None:
        for request_id in await run_db(reclaim_lost):
            with contextlib.suppress(RedisError):
                await ledger.release(request_id)

    async def validate_all() -> None:
        while await run_db(validate_one):
            pass

    # Each step on its own: one that fails (an outage, a defect) is logged and the others run,
    # and the lines of every batch still run; the next turn tries it again.
    steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        ("give back lost lines", give_back_lost),
        ("meter leftovers", meter_leftovers),
        ("validate", validate_all),
        ("expire", functools.partial(run_db, expire_due)),
        ("finalize", functools.partial(run_db, finalize_ready)),
        ("purge expired files", functools.partial(run_db, files_purge_expired)),
    ]
    for name, step in steps:
        try:
            await step()
        except Exception:
            logger.exception("batch housekeeping: %s failed; the next turn tries again", name)


def deliver_webhooks() -> int:
    """The webhooks due (the batch queue's worker is busy with ``work`` while there are
    batches, so it sends them alongside, in a thread of their own)."""
    try:
        return webhooks_deliver_due(limit=20, budget_seconds=20)
    except Exception:  # a defect or an outage must not stop batch work: the next tick retries
        logger.warning("could not deliver webhooks", exc_info=True)
        return 0


# A run with nothing to do for this long ends (the beat starts one every BATCH_TICK_SECONDS).
IDLE_EXIT_SECONDS = 5.0


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


async def work(*, seconds: float, owner: str | None = None) -> int:
    """Run batch lines for about ``seconds`` (then finish those in flight): the share each
    model gives batch work (``batch_share``), oldest batch first. Returns lines run."""
    owner = owner or worker_id()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    running: dict[str, dict[asyncio.Task[None], float]] = defaultdict(dict)  # by model: task → started
    grants: dict[int, tuple[float, KeyGrant | None]] = {}
    ran = 0
    next_housekeeping = next_renewal = 0.0
    webhooks: asyncio.Future[int] | None = None
    idle_since: float | None = None

    async def grant_of(api_key_id: int) -> KeyGrant | None:
        cached = grants.get(api_key_id)
        if cached is None or loop.time() - cached[0] > settings.API_KEY_CACHE_SECONDS:
            cached = grants[api_key_id] = (loop.time(), await run_db(_grant, api_key_id))
        return cached[1]

    async def watch() -> None:
        # Between the loop's turns (each reads the database): interactive requests arriving on
        # a model with lines in flight are seen within BATCH_YIELD_POLL_SECONDS.
        while True:
            await asyncio.sleep(settings.BATCH_YIELD_POLL_SECONDS)
            for model, tasks in list(running.items()):
                if tasks:
                    _yield_to_interactive(model, tasks, await batch_share(model))

    watcher = asyncio.ensure_future(watch())
    try:
        while loop.time() < deadline:
            now = loop.time()
            if now >= next_housekeeping:
                await housekeeping()
                next_housekeeping = now + 2.0
                if webhooks is None or webhooks.done():
                    webhooks = asyncio.ensure_future(run_db(deliver_webhooks))
            if now >= next_renewal:
                await run_db(renew_leases, owner=owner)
                next_renewal = now + settings.BATCH_LEASE_SECONDS / 3
            started = 0
            runnable = await run_db(runnable_models)
            for model in {*runnable, *(m for m, tasks in running.items() if tasks)}:
                share = await batch_share(model)
                tasks = running[model]
                _yield_to_interactive(model, tasks, share)
                free = share - len(tasks)
                if model not in runnable or free <= 0:
                    continue
                try:
                    lines = await run_db(claim, batches=runnable[model], owner=owner, limit=free)
                except Exception:  # an outage or a defect: the other models' lines go on
                    logger.exception("could not claim lines of %s; trying again next turn", model)
                    continue
                for line in lines:
                    task = asyncio.ensure_future(run_line(line, await grant_of(line.api_key_id), owner=owner))
                    tasks[task] = loop.time()
                    task.add_done_callback(functools.partial(_forget, tasks))
                    started += 1
            ran += started
            busy = [t for tasks in running.values() for t in tasks]
            if busy:
                idle_since = None
                await asyncio.wait(busy, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
            elif not started:
                if runnable:
                    idle_since = None  # lines waiting for their share (interactive load)
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since > IDLE_EXIT_SECONDS:
                    break  # nothing to run: the next tick (or a new batch) starts another run
                await asyncio.sleep(0.5)
        while busy := [t for tasks in running.values() for t in tasks]:
            await asyncio.wait(busy, timeout=settings.BATCH_LEASE_SECONDS / 3)
            await run_db(renew_leases, owner=owner)
        await housekeeping()
        if webhooks is not None:
            await webhooks
        await run_db(deliver_webhooks)
    finally:
        watcher.cancel()
        left = [task for tasks in running.values() for task in tasks]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)  # each puts its line back
    return ran


def _yield_to_interactive(model: str, tasks: dict[asyncio.Task[None], float], share: int) -> None:
    """Interactive requests came and the model's lines in flight exceed its share: the newest
    (the least work lost) stop at once, their engine requests cancelled, to run again later
    (``_put_back``: not counted as a failure)."""
    if not settings.BATCH_PREEMPT or not _interactive_now.get(model):
        return
    live = [task for task in tasks if not task.cancelling() and not task.done()]
    for task in sorted(live, key=tasks.__getitem__, reverse=True)[: max(0, len(live) - share)]:
        task.cancel()


def _forget(tasks: dict[asyncio.Task[None], float], done: asyncio.Task[None]) -> None:
    tasks.pop(done, None)
