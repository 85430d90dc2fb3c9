"""Batch jobs made straight in the database, for the pages that show them: a stored file (its
bytes in the artifact store), a batch in any status and its lines in any state."""

from __future__ import annotations

import secrets
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.utils import timezone


def stored_file(organization: Any, content: bytes, *, purpose: str = "batch", filename: str = "") -> Any:
    """A file of the organisation, as the Files API or a finished batch stores it."""
    from registry.artifacts import get_artifact_store
    from serving.models import StoredFile

    public_id = "file-" + secrets.token_hex(12)
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "upload.jsonl"
        source.write_bytes(content)
        stored = get_artifact_store().put_file(source=source, key=f"files/{organization.pk}/{public_id}.jsonl")
    return StoredFile.objects.create(
        public_id=public_id, organization=organization, purpose=purpose, filename=filename or f"{public_id}.jsonl",
        bytes=stored.size, lines=content.count(b"\n"), sha256=stored.sha256, uri=stored.uri,
    )  # fmt: skip


def batch(
    organization: Any,
    api_key: Any,
    *,
    status: str = "in_progress",
    model: str = "batch-page-model",
    lines: dict[str, int] | None = None,
    **fields: Any,
) -> Any:
    """A batch of ``model`` with ``lines`` ({"succeeded": 3, "pending": 2, ...}: its BatchLine
    rows, in that order, those finished answered at their first attempt); its total is their
    number unless ``fields`` say otherwise."""
    from serving.models import Batch, BatchLine

    lines = lines or {}
    now = timezone.now()
    made = Batch.objects.create(
        public_id="batch_" + secrets.token_hex(12),
        organization=organization,
        api_key=api_key,
        endpoint=fields.pop("endpoint", "/v1/chat/completions"),
        model=model,
        input_file_public_id=fields.pop("input_file_public_id", "file-none"),
        status=status,
        total=fields.pop("total", sum(lines.values())),
        expires_at=fields.pop("expires_at", now + timedelta(hours=24)),
        in_progress_at=fields.pop("in_progress_at", None if status == "validating" else now),
        **fields,
    )
    rows, index = [], 0
    for state, count in lines.items():
        for _ in range(count):
            finished = now if state in ("succeeded", "failed") else None
            rows.append(
                BatchLine(
                    batch=made,
                    index=index,
                    custom_id=f"line-{index}",
                    body={"model": model},
                    status=state,
                    attempts=1 if finished else 0,
                    finished_at=finished,
                )
            )
            index += 1
    BatchLine.objects.bulk_create(rows)
    return made
