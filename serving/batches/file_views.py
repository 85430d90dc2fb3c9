"""``/v1/files``: OpenAI's Files API over ``serving.batches.files``, authenticated by an API key.

``POST /v1/files`` (multipart: ``file``, ``purpose=batch``), ``GET /v1/files`` (``purpose``,
``limit`` 1 to 10,000, ``after``, ``order``), ``GET`` and ``DELETE /v1/files/{id}``, and
``GET /v1/files/{id}/content``. Errors in OpenAI's shape; another organisation's file is a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from django.core.files.uploadedfile import TemporaryUploadedFile
from django.core.files.uploadhandler import TemporaryFileUploadHandler
from django.http import HttpResponse, QueryDict
from django.http.multipartparser import MultiPartParser, MultiPartParserError
from django.utils.http import content_disposition_header

from accounts.grants import KeyGrant
from core.db import run_db
from serving.batches import files
from serving.batches.models import StoredFile
from serving.gateway.admission import take_request
from serving.gateway.auth import request_grant
from serving.gateway.errors import APIError, InvalidRequest, NotFound
from serving.gateway.requests import ApiRequest, reads_body, require_method

LIST_LIMIT_MAX = 10_000


def _json(data: Any, *, status: int = 200) -> HttpResponse:
    return HttpResponse(orjson.dumps(data), status=status, content_type="application/json")


def _refused(exc: files.BadFile) -> APIError:
    return APIError(exc.message, param=exc.param, code=exc.code, status=exc.status, type="invalid_request_error")


async def before_upload(grant: KeyGrant, declared_bytes: int | None) -> None:
    """What an upload must pass before its body is read (``serving.gateway.asgi``): a place in the
    key's per-minute request bucket (429), and room in the organisation's file storage for
    the size it declares (403)."""
    await take_request(grant)
    try:
        await run_db(files.file_quota_check, grant.organization_id, incoming_bytes=declared_bytes or 0)
    except files.BadFile as exc:
        raise _refused(exc) from None


def _parse_upload(body: BinaryIO, content_type: str) -> tuple[QueryDict, TemporaryUploadedFile | None]:
    """The form's fields and its ``file`` (spooled to a temporary file by Django's parser)."""
    size = body.seek(0, io.SEEK_END)
    body.seek(0)
    meta = {"CONTENT_TYPE": content_type, "CONTENT_LENGTH": str(size)}
    try:
        fields, uploads = MultiPartParser(meta, body, [TemporaryFileUploadHandler()], "utf-8").parse()
    except MultiPartParserError as exc:
        raise InvalidRequest(f"The body is not a multipart form: {exc}.", code="invalid_multipart") from None
    return fields, uploads.get("file")


def _create(body: BinaryIO, content_type: str, organization_id: int, api_key_id: int) -> dict[str, Any]:
    fields, upload = _parse_upload(body, content_type)
    if upload is None:
        raise InvalidRequest("file is required: the JSONL file, as a multipart form field.", param="file")
    try:
        stored = files.file_create(
            organization_id=organization_id, api_key_id=api_key_id, upload=Path(upload.temporary_file_path()),
            filename=upload.name or "upload.jsonl", purpose=fields.get("purpose", ""),
        )  # fmt: skip
    except files.BadFile as exc:
        raise _refused(exc) from None
    finally:
        upload.close()  # removes the temporary file
    return files.file_object(stored)


@reads_body(upload=before_upload)
async def files_root(request: ApiRequest) -> HttpResponse:
    """``GET`` lists, ``POST`` uploads (the body spooled to disk as it came, after the key and
    its request rate were checked: ``before_upload``)."""
    require_method(request, "GET", "POST")
    grant = await request_grant(request)
    if request.method == "POST":
        content_type = request.header("content-type") or ""
        if not content_type.startswith("multipart/form-data"):
            raise InvalidRequest("Upload the file as multipart/form-data (fields file and purpose).",
                                 code="invalid_multipart")  # fmt: skip
        assert request.upload is not None
        # Parsing and checking a file of up to FILES_MAX_BYTES is work for a thread, not the loop.
        created = await asyncio.to_thread(_create, request.upload, content_type, grant.organization_id,
                                          grant.key_id)  # fmt: skip
        return _json(created)
    query = request.query()
    try:
        limit = int(query.get("limit", "10000"))
    except ValueError:
        raise InvalidRequest("limit must be a number.", param="limit") from None
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidRequest(f"limit must be between 1 and {LIST_LIMIT_MAX}.", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc.", param="order")
    try:
        page, more = await run_db(
            files.files_page, grant.organization_id, purpose=query.get("purpose") or None, limit=limit,
            after=query.get("after") or None, newest_first=order == "desc",
        )  # fmt: skip
    except files.BadFile as exc:
        raise _refused(exc) from None
    data = [files.file_object(f) for f in page]
    return _json({
        "object": "list", "data": data, "has_more": more,
        "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
    })  # fmt: skip


async def _owned(request: ApiRequest, file_id: str) -> StoredFile:
    grant = await request_grant(request)
    found = await run_db(files.file_for_organization, grant.organization_id, file_id)
    if found is None:
        raise NotFound(f"No such file: {file_id}.", param="file_id", code="file_not_found")
    return found


async def file_detail(request: ApiRequest, file_id: str) -> HttpResponse:
    """``GET`` the file object, ``DELETE`` the file."""
    require_method(request, "GET", "DELETE")
    found = await _owned(request, file_id)
    if request.method == "DELETE":
        await run_db(files.file_delete, file=found)
        return _json({"id": found.public_id, "object": "file", "deleted": True})
    return _json(files.file_object(found))


async def file_content(request: ApiRequest, file_id: str) -> HttpResponse:
    """``GET`` the file's bytes, as uploaded."""
    require_method(request, "GET")
    found = await _owned(request, file_id)

    def read() -> bytes:
        from registry.artifacts import get_artifact_store

        with contextlib.closing(get_artifact_store().open_file(found.uri)) as handle:
            return handle.read()

    content = await asyncio.to_thread(read)
    response = HttpResponse(content, content_type="application/jsonl")
    # RFC 6266: an ASCII name for old clients and the exact one, UTF-8, for the rest.
    response["Content-Disposition"] = content_disposition_header(True, found.filename) or "attachment"
    return response
