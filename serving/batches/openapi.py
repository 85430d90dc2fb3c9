"""OpenAI's Files and Batch APIs in the OpenAPI schema."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from serving.gateway.openapi import COMPONENT, READ_ERRORS, json_ok, operation, page_of

FILE_SCHEMAS: dict[str, Any] = {
    "OpenAIFile": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "example": "file-3f0c…"},
            "object": {"type": "string", "enum": ["file"]},
            "bytes": {"type": "integer"},
            "created_at": {"type": "integer"},
            "expires_at": {"type": "integer", "nullable": True},
            "filename": {"type": "string"},
            "purpose": {"type": "string"},
            "status": {"type": "string", "enum": ["processed"]},
            "status_details": {"type": "string", "nullable": True},
        },
        "required": ["id", "object", "bytes", "created_at", "filename", "purpose", "status"],
    },
    "OpenAIFileList": page_of("OpenAIFile"),
    "OpenAIFileDeleted": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["file"]},
            "deleted": {"type": "boolean"},
        },
        "required": ["id", "object", "deleted"],
    },
    "OpenAIFileUpload": {
        "type": "object",
        "properties": {
            "file": {"type": "string", "format": "binary", "description": "JSONL: one batch request per line"},
            "purpose": {"type": "string", "enum": ["batch"]},
        },
        "required": ["file", "purpose"],
    },
}


_FILE_ID = {"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}}
_BATCH_ID = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}
_STAMP = {"type": "integer", "nullable": True}
BATCH_SCHEMAS: dict[str, Any] = {
    "OpenAIBatchCreate": {
        "type": "object",
        "properties": {
            "input_file_id": {"type": "string", "description": "a file uploaded with purpose `batch`"},
            "endpoint": {
                "type": "string",
                "enum": ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/v1/predict"],
            },
            "completion_window": {"type": "string", "enum": ["24h"]},
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}, "nullable": True},
        },
        "required": ["input_file_id", "endpoint", "completion_window"],
    },
    "OpenAIBatch": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "example": "batch_6c1a…"},
            "object": {"type": "string", "enum": ["batch"]},
            "endpoint": {"type": "string"},
            "model": {"type": "string", "nullable": True},
            "errors": {"type": "object", "nullable": True},
            "input_file_id": {"type": "string"},
            "completion_window": {"type": "string"},
            "status": {
                "type": "string",
                "enum": [
                    "validating",
                    "failed",
                    "in_progress",
                    "finalizing",
                    "completed",
                    "expired",
                    "cancelling",
                    "cancelled",
                ],
            },
            "output_file_id": {"type": "string", "nullable": True},
            "error_file_id": {"type": "string", "nullable": True},
            "created_at": {"type": "integer"},
            **{
                name: _STAMP
                for name in (
                    "in_progress_at",
                    "expires_at",
                    "finalizing_at",
                    "completed_at",
                    "failed_at",
                    "expired_at",
                    "cancelling_at",
                    "cancelled_at",
                )
            },
            "request_counts": {
                "type": "object",
                "properties": {n: {"type": "integer"} for n in ("total", "completed", "failed")},
                "required": ["total", "completed", "failed"],
            },
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}, "nullable": True},
        },
        "required": [
            "id",
            "object",
            "endpoint",
            "input_file_id",
            "completion_window",
            "status",
            "created_at",
            "request_counts",
        ],
    },
    "OpenAIBatchList": page_of("OpenAIBatch"),
    "SeedBatchCreate": {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "inputs": {
                "type": "array",
                "minItems": 1,
                "items": {},
                "description": "one request each: a prompt or {messages} (chat), a text (embeddings), an instance "
                "(small models)",
            },
            "params": {"type": "object", "description": "fields every request gets, e.g. max_tokens"},
            "callback_url": {"type": "string", "description": "a signed webhook goes here when the batch ends"},
        },
        "required": ["model", "inputs"],
    },
    "SeedBatchCreated": {
        "type": "object",
        "properties": {
            "batch_id": {"type": "string"},
            "status": {"type": "string"},
            "estimated_time": {"type": "integer", "description": "seconds, from the model's measured throughput"},
            "input_file_id": {"type": "string"},
        },
        "required": ["batch_id", "status", "estimated_time"],
    },
    "SeedBatch": {
        "type": "object",
        "properties": {
            "batch_id": {"type": "string"},
            "status": {"type": "string"},
            "model": {"type": "string", "nullable": True},
            "progress": {
                "type": "object",
                "properties": {n: {"type": "integer"} for n in ("total", "completed", "failed")},
            },
            "output_file_id": {"type": "string", "nullable": True},
            "error_file_id": {"type": "string", "nullable": True},
            "created_at": {"type": "integer"},
            "expires_at": {"type": "integer", "nullable": True},
        },
        "required": ["batch_id", "status", "progress"],
    },
}


def batch_paths() -> dict[str, dict[str, Any]]:
    """OpenAI's Batch API and the seeds' batch (``serving.batches.views``)."""
    create = operation(
        "openai_batches_create", "Create a batch", ok=json_ok("OpenAIBatch", "the batch, validating"),
        errors=(400, 429, *READ_ERRORS), body="OpenAIBatchCreate",
    )  # fmt: skip
    create["description"] = (
        "Runs every request of the input file offline, each exactly once, at the batch price; the output "
        "and error files list the answers by custom_id when it ends."
    )
    listing = operation(
        "openai_batches_list", "This organisation's batches, newest first", ok=json_ok("OpenAIBatchList", "one page"),
        errors=(400, *READ_ERRORS), parameters=[
            {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
            {"name": "after", "in": "query", "schema": {"type": "string"}, "description": "a batch id"},
        ],
    )  # fmt: skip
    seed = operation(
        "seed_batch_create", "Run many inputs as one batch (the seeds' shape)", ok=json_ok("SeedBatchCreated", ""),
        errors=(400, 403, 429, *READ_ERRORS), body="SeedBatchCreate",
    )  # fmt: skip
    seed["responses"]["202"] = {**seed["responses"].pop("200"), "description": "queued"}
    return {
        "/v1/batches": {"get": listing, "post": create},
        "/v1/batches/{batch_id}": {
            "get": operation(
                "openai_batches_retrieve",
                "One batch",
                ok=json_ok("OpenAIBatch", "the batch"),
                errors=READ_ERRORS,
                parameters=[_BATCH_ID],
            ),
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": operation(
                "openai_batches_cancel",
                "Cancel a batch",
                ok=json_ok("OpenAIBatch", "cancelling"),
                errors=(409, *READ_ERRORS),
                parameters=[_BATCH_ID],
            ),
        },
        "/api/v1/batch": {"post": seed},
        "/api/v1/batch/{batch_id}": {
            "get": operation(
                "seed_batch_retrieve",
                "A batch's progress (the seeds' shape)",
                ok=json_ok("SeedBatch", "its progress"),
                errors=READ_ERRORS,
                parameters=[_BATCH_ID],
            ),
        },
    }


def file_paths() -> dict[str, dict[str, Any]]:
    """OpenAI's Files API (``serving.batches.file_views``)."""
    upload = operation(
        "openai_files_create", "Upload a batch input file", ok=json_ok("OpenAIFile", "the file"),
        errors=(400, *READ_ERRORS),
    )  # fmt: skip
    upload["requestBody"] = {
        "required": True,
        "content": {"multipart/form-data": {"schema": {"$ref": COMPONENT.format(model="OpenAIFileUpload")}}},
    }
    upload["description"] = (
        f"Every line is checked (`{{custom_id, method: POST, url, body: {{model, …}}}}`); the first bad one "
        f"refuses the file (400 naming the line). At most {settings.FILES_MAX_BYTES} bytes and "
        f"{settings.FILES_MAX_LINES} requests."
    )
    list_parameters = [
        {"name": "purpose", "in": "query", "schema": {"type": "string"}},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
        {"name": "after", "in": "query", "schema": {"type": "string"}, "description": "a file id: the page after it"},
        {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
    ]
    listing = operation(
        "openai_files_list", "This organisation's files", ok=json_ok("OpenAIFileList", "one page"),
        errors=(400, *READ_ERRORS), parameters=list_parameters,
    )  # fmt: skip
    content_ok = {
        "description": "the file's bytes, as uploaded",
        "content": {"application/jsonl": {"schema": {"type": "string", "format": "binary"}}},
    }
    return {
        "/v1/files": {"get": listing, "post": upload},
        "/v1/files/{file_id}": {
            "get": operation(
                "openai_files_retrieve",
                "One file",
                ok=json_ok("OpenAIFile", "the file"),
                errors=READ_ERRORS,
                parameters=[_FILE_ID],
            ),
            "delete": operation(
                "openai_files_delete",
                "Delete a file",
                ok=json_ok("OpenAIFileDeleted", "deleted"),
                errors=READ_ERRORS,
                parameters=[_FILE_ID],
            ),
        },
        "/v1/files/{file_id}/content": {
            "get": operation(
                "openai_files_content", "A file's content", ok=content_ok, errors=READ_ERRORS, parameters=[_FILE_ID]
            ),
        },
    }
