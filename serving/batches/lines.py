"""A batch's lines in the database, each step a short transaction: the file validated into lines,
lines claimed fairly with leases, answers stored, leases renewed or lost, batches expired and
finalized into their output and error files."""

from __future__ import annotations

import functools
import heapq
import logging
import secrets
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
from django.conf import settings
from django.db import InterfaceError, OperationalError, transaction
from django.db.models import Count, Exists, F, OuterRef
from django.utils import timezone

from billing.ledger import UsageEvent
from core.transitions import check_transition
from core.validators import without_nul
from registry.artifacts import get_artifact_store
from serving.batches.files import check_line
from serving.batches.models import Batch, BatchLine, StoredFile
from serving.batches.selectors import batch_object, not_run_error
from serving.batches.services import line_request_id
from serving.batches.webhooks import webhook_enqueue
from serving.gateway.errors import bounded

logger = logging.getLogger(__name__)

# The database is away (not a batch's fault): the step is tried again on the next turn.
DATABASE_DOWN = (OperationalError, InterfaceError)


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
        code, message = not_run_error(batch.stop_reason)
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
