"""OpenAI's Files API for batch input (``/v1/files``): upload, list, read, delete, per organisation.

An upload (``purpose=batch``) is a JSONL file of requests, each line
``{"custom_id", "method": "POST", "url", "body"}``; every line is checked when the file is
uploaded, and the first bad one refuses the whole file with a 400 that names it and says
why (the line number, 1-based). Limits: ``FILES_MAX_BYTES`` per file (the body is refused
before it is read when it says it is larger) and ``FILES_MAX_LINES`` requests. The bytes go
to the artifact store (``registry.artifacts``: ``files/<organisation>/<id>.jsonl``), the
index to ``StoredFile``. A file is its organisation's: any of its keys sees it, no other
organisation's key does (a 404, as for a file that does not exist).
"""

from __future__ import annotations

import logging
import secrets
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from django.conf import settings
from django.db import transaction
from django.db.models import Count, Exists, OuterRef, Q, Sum
from django.utils import timezone

from accounts.models import Organization
from core.validators import nul_path
from registry.artifacts import get_artifact_store
from serving.batches.models import Batch, StoredFile
from serving.gateway.errors import bounded

logger = logging.getLogger(__name__)

# The endpoints a batch line may name (OpenAI's, and the seeds' predict).
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/v1/predict")
# What the database holds of a line: ``BatchLine.custom_id`` and ``Batch.model`` are columns of
# this many characters, and PostgreSQL's JSON refuses NUL inside a string. A line the
# database would refuse is refused here, at upload, never by a bulk insert that fails the batch.
CUSTOM_ID_MAX_LENGTH = 512
MODEL_MAX_LENGTH = 255
BOM = b"\xef\xbb\xbf"


class BadFile(ValueError):
    """An upload the API refuses (``status`` 400, or 403 past the organisation's storage
    quota); ``param`` names the form field at fault."""

    def __init__(self, message: str, *, param: str = "file", status: int = 400, code: str = "invalid_file") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def _over_quota(message: str) -> BadFile:
    return BadFile(message, param="file", status=403, code="storage_quota_exceeded")


def file_quota_check(organization_id: int, *, incoming_bytes: int) -> None:
    """Refuse (``BadFile``, 403) an upload of ``incoming_bytes`` that the organisation's stored
    files leave no room for (FILES_ORG_MAX_FILES, FILES_ORG_MAX_BYTES). Cheap and unlocked:
    asked before an upload's body is read; ``file_create`` asks again, exactly."""
    held = StoredFile.objects.filter(organization_id=organization_id).aggregate(n=Count("pk"), size=Sum("bytes"))
    count, size = int(held["n"] or 0), int(held["size"] or 0)
    if count >= settings.FILES_ORG_MAX_FILES:
        raise _over_quota(
            f"Your organization stores {count} files, its limit of {settings.FILES_ORG_MAX_FILES}. "
            "Delete files you no longer need (DELETE /v1/files/{id}) and try again."
        )
    if size + incoming_bytes > settings.FILES_ORG_MAX_BYTES:
        raise _over_quota(
            f"Your organization stores {size} bytes of files; {incoming_bytes} more would pass its limit of "
            f"{settings.FILES_ORG_MAX_BYTES}. Delete files you no longer need and try again."
        )


def check_line(raw: bytes) -> dict[str, Any]:
    """A batch request line as the database will hold it; ``ValueError`` saying why the line
    is not one (the words follow "Line N"). The one contract of a line, for uploads and for
    validating files stored before a rule was added."""
    if raw.endswith(b"\r\n"):
        raise ValueError("ends with CR LF (Windows line ends); a batch file's lines end with LF (\\n) only")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"is not UTF-8 text (byte {exc.start + 1} of the line)") from None
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ValueError("is not JSON") from None
    if not isinstance(line, dict):
        raise ValueError("is not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("has no custom_id (a non-empty string that names the request in the results)")
    if len(custom_id) > CUSTOM_ID_MAX_LENGTH:
        raise ValueError(f"has a custom_id of {len(custom_id)} characters; at most {CUSTOM_ID_MAX_LENGTH} are taken")
    if line.get("method") != "POST":
        raise ValueError('has no method "POST"')
    if line.get("url") not in BATCH_URLS:
        raise ValueError(f"has url {bounded(repr(line.get('url')), 100)}; a batch runs {', '.join(BATCH_URLS)}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise ValueError("has no body (the request's JSON object)")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("has no body.model")
    if len(model) > MODEL_MAX_LENGTH:
        raise ValueError(f"names a model of {len(model)} characters; model names have at most {MODEL_MAX_LENGTH}")
    # The escape is the only way a NUL gets into JSON text (a raw one is not JSON): walk the
    # line only when it is there.
    if b"\\u0000" in raw and (where := nul_path(line)) is not None:
        raise ValueError(f"has a NUL character (\\u0000) in {where}, which cannot be stored")
    return line


def check_batch_file(handle: BinaryIO) -> int:
    """The number of requests in a batch input file; ``BadFile`` naming its first bad line."""
    seen: set[str] = set()
    for number, raw in enumerate(handle, start=1):
        if number == 1 and raw.startswith(BOM):
            raise BadFile("The file starts with a byte-order mark (BOM): save it as UTF-8 without one.")
        if not raw.strip():
            continue
        try:
            custom_id = check_line(raw)["custom_id"]
        except ValueError as why:
            raise BadFile(f"Line {number} {why}.") from None
        if custom_id in seen:
            raise BadFile(f"Line {number} repeats custom_id {bounded(repr(custom_id), 100)}: each request's must "
                          "be unique.")  # fmt: skip
        seen.add(custom_id)
        if len(seen) > settings.FILES_MAX_LINES:
            raise BadFile(f"The file has more than {settings.FILES_MAX_LINES} requests.")
    if not seen:
        raise BadFile("The file has no request: one JSON object per line.")
    return len(seen)


def file_create(
    *, organization_id: int, api_key_id: int | None, upload: Path, filename: str, purpose: str
) -> StoredFile:
    """Check and store an upload (a file on local disk), and index it: the file's lines
    (``check_batch_file``), its size, and the organisation's storage quota, counted with the
    organisation's row locked so that concurrent uploads cannot pass it together. The file
    expires after FILES_INPUT_RETENTION_DAYS (``files_purge_expired`` keeps it while an
    unfinished batch reads it)."""
    if purpose != "batch":
        raise BadFile(f"purpose must be 'batch' (the Files API here holds batch input), not "
                      f"{bounded(repr(purpose), 100)}.", param="purpose")  # fmt: skip
    size = upload.stat().st_size
    if size > settings.FILES_MAX_BYTES:
        raise BadFile(f"The file has {size} bytes; at most {settings.FILES_MAX_BYTES} are taken.")
    with upload.open("rb") as handle:
        lines = check_batch_file(handle)
    public_id = "file-" + secrets.token_hex(12)
    store = get_artifact_store()
    # Copied before the row is written (a row never names bytes that are not there), outside
    # the lock: a 100 MB copy must not hold the organisation's other uploads and batches.
    stored = store.put_file(source=upload, key=f"files/{organization_id}/{public_id}.jsonl")
    try:
        with transaction.atomic():
            Organization.objects.select_for_update().filter(pk=organization_id).first()
            file_quota_check(organization_id, incoming_bytes=stored.size)
            return StoredFile.objects.create(
                public_id=public_id, organization_id=organization_id, api_key_id=api_key_id, purpose=purpose,
                filename=clean_filename(filename), bytes=stored.size, lines=lines, sha256=stored.sha256,
                uri=stored.uri, expires_at=timezone.now() + timedelta(days=settings.FILES_INPUT_RETENTION_DAYS),
            )  # fmt: skip
    except BaseException:
        store.delete_file(stored.uri)
        raise


def clean_filename(filename: str) -> str:
    """The name a file is listed and downloaded under: the upload's, without a folder, control
    characters or quotes (it goes into a Content-Disposition header), at most 255 characters."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if c.isprintable() and c not in '"').strip()
    return name[:255] or "upload.jsonl"


def file_delete(*, file: StoredFile) -> None:
    """Remove the index row, then the bytes (a row never names bytes that are gone)."""
    file.delete()
    get_artifact_store().delete_file(file.uri)


def files_purge_expired(*, limit: int = 200) -> int:
    """Delete files past their ``expires_at`` (uploads after FILES_INPUT_RETENTION_DAYS, batch
    output and error files after FILES_OUTPUT_RETENTION_DAYS), except an input file that a
    batch not yet finished still reads; at most ``limit`` a run. Each file on its own: one
    that cannot be deleted is logged and left for the next run. How many went."""
    needed = Batch.objects.filter(input_file=OuterRef("pk"), status__in=Batch.UNFINISHED)
    expired = list(
        StoredFile.objects.filter(expires_at__lte=timezone.now()).exclude(Exists(needed)).order_by("expires_at")[:limit]
    )
    gone = 0
    for file in expired:
        try:
            file_delete(file=file)
        except Exception:
            logger.exception("could not delete expired file %s; the next run tries again", file.public_id)
        else:
            gone += 1
    return gone


# --- reads -----------------------------------------------------------------------------------


def file_for_organization(organization_id: int, public_id: str) -> StoredFile | None:
    return StoredFile.objects.filter(organization_id=organization_id, public_id=public_id).first()


def files_page(
    organization_id: int, *, purpose: str | None, limit: int, after: str | None, newest_first: bool
) -> tuple[list[StoredFile], bool]:
    """One page of the organisation's files, and whether more follow."""
    files = StoredFile.objects.filter(organization_id=organization_id)
    if purpose:
        files = files.filter(purpose=purpose)
    order = ("-created_at", "-pk") if newest_first else ("created_at", "pk")
    files = files.order_by(*order)
    if after:
        cursor = StoredFile.objects.filter(organization_id=organization_id, public_id=after).first()
        if cursor is None:
            raise BadFile(f"after names no file of yours: {after!r}.", param="after")
        at, pk = cursor.created_at, cursor.pk
        if newest_first:
            files = files.filter(Q(created_at__lt=at) | Q(created_at=at, pk__lt=pk))
        else:
            files = files.filter(Q(created_at__gt=at) | Q(created_at=at, pk__gt=pk))
    rows = list(files[: limit + 1])
    return rows[:limit], len(rows) > limit


def file_object(file: StoredFile) -> dict[str, Any]:
    """The file as OpenAI's API shows it."""
    return {
        "id": file.public_id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": int(file.created_at.timestamp()),
        "expires_at": int(file.expires_at.timestamp()) if file.expires_at else None,
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
    }
