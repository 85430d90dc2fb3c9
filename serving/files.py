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

import secrets
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from registry.artifacts import get_artifact_store
from serving.models import StoredFile

# The endpoints a batch line may name (OpenAI's, and the seeds' predict).
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/v1/predict")


class BadFile(ValueError):
    """An upload the API refuses; ``param`` names the form field at fault."""

    def __init__(self, message: str, *, param: str = "file") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _custom_id(raw: bytes) -> str:
    """A batch request line's custom_id; ``ValueError`` saying why the line is not one."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ValueError("is not JSON") from None
    if not isinstance(line, dict):
        raise ValueError("is not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("has no custom_id (a non-empty string that names the request in the results)")
    if line.get("method") != "POST":
        raise ValueError('has no method "POST"')
    if line.get("url") not in BATCH_URLS:
        raise ValueError(f"has url {line.get('url')!r}; a batch runs {', '.join(BATCH_URLS)}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise ValueError("has no body (the request's JSON object)")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("has no body.model")
    return custom_id


def check_batch_file(handle: BinaryIO) -> int:
    """The number of requests in a batch input file; ``BadFile`` naming its first bad line."""
    seen: set[str] = set()
    for number, raw in enumerate(handle, start=1):
        if not raw.strip():
            continue
        try:
            custom_id = _custom_id(raw)
        except ValueError as why:
            raise BadFile(f"Line {number} {why}.") from None
        if custom_id in seen:
            raise BadFile(f"Line {number} repeats custom_id {custom_id!r}: each request's must be unique.")
        seen.add(custom_id)
        if len(seen) > settings.FILES_MAX_LINES:
            raise BadFile(f"The file has more than {settings.FILES_MAX_LINES} requests.")
    if not seen:
        raise BadFile("The file has no request: one JSON object per line.")
    return len(seen)


def file_create(
    *, organization_id: int, api_key_id: int | None, upload: Path, filename: str, purpose: str
) -> StoredFile:
    """Check and store an upload (a file on local disk), and index it."""
    if purpose != "batch":
        raise BadFile(f"purpose must be 'batch' (the Files API here holds batch input), not {purpose!r}.",
                      param="purpose")  # fmt: skip
    size = upload.stat().st_size
    if size > settings.FILES_MAX_BYTES:
        raise BadFile(f"The file has {size} bytes; at most {settings.FILES_MAX_BYTES} are taken.")
    with upload.open("rb") as handle:
        lines = check_batch_file(handle)
    public_id = "file-" + secrets.token_hex(12)
    stored = get_artifact_store().put_file(source=upload, key=f"files/{organization_id}/{public_id}.jsonl")
    return StoredFile.objects.create(
        public_id=public_id, organization_id=organization_id, api_key_id=api_key_id, purpose=purpose,
        filename=(filename or "upload.jsonl")[:255], bytes=stored.size, lines=lines, sha256=stored.sha256,
        uri=stored.uri,
    )  # fmt: skip


def file_delete(*, file: StoredFile) -> None:
    """Remove the index row, then the bytes (a row never names bytes that are gone)."""
    file.delete()
    get_artifact_store().delete_file(file.uri)


def files_purge_expired(*, limit: int = 200) -> int:
    """Delete files past their ``expires_at`` (batch output and error files, after
    FILES_OUTPUT_RETENTION_DAYS); at most ``limit`` a run. How many went."""
    expired = list(StoredFile.objects.filter(expires_at__lte=timezone.now()).order_by("expires_at")[:limit])
    for file in expired:
        file_delete(file=file)
    return len(expired)


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
