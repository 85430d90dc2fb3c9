"""``/v1/batches`` (OpenAI's Batch API) and the seeds' ``/api/v1/batch``, over ``serving.batches``.

``POST /v1/batches`` ``{input_file_id, endpoint, completion_window, metadata}``, ``GET
/v1/batches`` (``limit`` 1 to 100, ``after``), ``GET /v1/batches/{id}``, ``POST
/v1/batches/{id}/cancel``. ``POST /api/v1/batch`` ``{"model", "inputs": [...], "callback_url",
"params"}`` makes the input file from ``inputs`` and answers ``{"batch_id", "status",
"estimated_time"}``; ``GET /api/v1/batch/{id}`` its progress. Errors in OpenAI's shape; another
organisation's batch is a 404.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import orjson
from django.http import HttpResponse

from accounts.grants import KeyGrant
from core.db import run_db
from serving.batches import files, services
from serving.batches.models import Batch
from serving.batches.selectors import batch_for_organization, batch_object, batch_progress, batches_page
from serving.batches.services import PREDICT_URL, BadBatch, batch_create, estimated_seconds
from serving.gateway.admission import take_request
from serving.gateway.auth import request_grant
from serving.gateway.errors import APIError, InvalidRequest, NotFound
from serving.gateway.model_access import find_model_for
from serving.gateway.requests import ApiRequest, json_object, reads_body, require_method
from serving.predict.call import is_predict_model

LIST_LIMIT_MAX = 100
# The seeds' batch: at most this many inputs in one call (a bigger job uploads a file).
SEED_MAX_INPUTS = 10_000


def _json(data: Any, *, status: int = 200) -> HttpResponse:
    return HttpResponse(orjson.dumps(data), status=status, content_type="application/json")


def _refused(exc: BadBatch) -> APIError:
    kind = "rate_limit_exceeded" if exc.status == 429 else "invalid_request_error"
    return APIError(exc.message, param=exc.param, status=exc.status, code=exc.code, type=kind)


def _create(grant: KeyGrant, **fields: Any) -> dict[str, Any]:
    try:
        batch = batch_create(organization_id=grant.organization_id, api_key_id=grant.key_id, **fields)
    except BadBatch as exc:
        raise _refused(exc) from None
    return batch_object(batch)


@reads_body()
async def batches_root(request: ApiRequest) -> HttpResponse:
    """``POST`` creates a batch, ``GET`` lists them (newest first)."""
    require_method(request, "GET", "POST")
    grant = await request_grant(request)
    if request.method == "POST":
        data = json_object(request.body)
        await take_request(grant)  # a batch's creation is a request, whatever its lines
        created = await run_db(
            _create, grant, input_file_id=data.get("input_file_id"), endpoint=data.get("endpoint"),
            completion_window=data.get("completion_window", "24h"), metadata=data.get("metadata"),
        )  # fmt: skip
        return _json(created)
    query = request.query()
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise InvalidRequest("limit must be a number.", param="limit") from None
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidRequest(f"limit must be between 1 and {LIST_LIMIT_MAX}.", param="limit")

    def page() -> dict[str, Any]:
        try:
            rows, more = batches_page(grant.organization_id, limit=limit, after=query.get("after") or None)
        except BadBatch as exc:
            raise _refused(exc) from None
        counts = batch_progress(rows)
        data = [batch_object(b, counts[b.pk]) for b in rows]
        return {
            "object": "list", "data": data, "has_more": more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
        }  # fmt: skip

    return _json(await run_db(page))


async def _owned(request: ApiRequest, batch_id: str) -> Batch:
    grant = await request_grant(request)
    found = await run_db(batch_for_organization, grant.organization_id, batch_id)
    if found is None:
        raise NotFound(f"No such batch: {batch_id}.", param="batch_id", code="batch_not_found")
    return found


async def batch_detail(request: ApiRequest, batch_id: str) -> HttpResponse:
    require_method(request, "GET")
    found = await _owned(request, batch_id)
    return _json(await run_db(batch_object, found))


async def batch_cancel(request: ApiRequest, batch_id: str) -> HttpResponse:
    require_method(request, "POST")
    found = await _owned(request, batch_id)

    def cancel() -> dict[str, Any]:
        try:
            batch = services.batch_cancel(batch=found)
        except BadBatch as exc:
            raise _refused(exc) from None
        return batch_object(batch_for_organization(batch.organization_id, batch.public_id) or batch)

    return _json(await run_db(cancel))


# --- the seeds' shape -------------------------------------------------------------------------


def _seed_line(index: int, url: str, model: str, item: object, params: dict[str, Any]) -> dict[str, Any]:
    """One input as a batch request line of ``url``."""
    if url == PREDICT_URL:
        body: dict[str, Any] = {"input": item}
    elif url == "/v1/embeddings":
        body = {"input": item}
    elif isinstance(item, str):
        body = {"messages": [{"role": "user", "content": item}]}
    elif isinstance(item, dict) and isinstance(item.get("messages"), list):
        body = dict(item)
    else:
        raise InvalidRequest(
            f"inputs[{index}] must be a prompt (a string) or an object with messages.", param=f"inputs[{index}]"
        )
    return {"custom_id": str(index), "method": "POST", "url": url, "body": {**params, **body, "model": model}}


def _seed_create(grant: KeyGrant, url: str, model: str, inputs: list[Any], params: dict[str, Any],
                 callback_url: str) -> dict[str, Any]:  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "inputs.jsonl"
        with path.open("wb") as handle:
            for index, item in enumerate(inputs):
                handle.write(orjson.dumps(_seed_line(index, url, model, item, params)) + b"\n")
        try:
            stored = files.file_create(organization_id=grant.organization_id, api_key_id=grant.key_id, upload=path,
                                       filename="inputs.jsonl", purpose="batch")  # fmt: skip
        except files.BadFile as exc:
            raise InvalidRequest(exc.message, param="inputs") from None
    try:
        batch = batch_create(
            organization_id=grant.organization_id, api_key_id=grant.key_id, input_file_id=stored.public_id,
            endpoint=url, callback_url=callback_url,
        )  # fmt: skip
    except BadBatch as exc:
        raise _refused(exc) from None
    return {
        "batch_id": batch.public_id,
        "status": batch.status,
        "estimated_time": estimated_seconds(model, len(inputs)),
        "input_file_id": stored.public_id,
    }


@reads_body()
async def seed_batch(request: ApiRequest) -> HttpResponse:
    """``POST /api/v1/batch`` ``{"model", "inputs": [...], "callback_url", "params"}``: one
    request per input (a prompt or messages for a chat model, a text for an embedding model,
    an instance for a small model), with a webhook to ``callback_url`` when it ends."""
    require_method(request, "POST")
    grant = await request_grant(request)
    data = json_object(request.body)
    model_name = data.get("model")
    if not isinstance(model_name, str) or not model_name:
        raise InvalidRequest("model is required.", param="model")
    inputs = data.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidRequest("inputs must be a non-empty list: one request each.", param="inputs")
    if len(inputs) > SEED_MAX_INPUTS:
        raise InvalidRequest(f"At most {SEED_MAX_INPUTS} inputs per call; upload a file to /v1/files for more.",
                             param="inputs")  # fmt: skip
    params = data.get("params") or {}
    if not isinstance(params, dict):
        raise InvalidRequest("params must be an object (fields every request gets, e.g. max_tokens).",
                             param="params")  # fmt: skip
    callback_url = data.get("callback_url") or ""
    if not isinstance(callback_url, str):
        raise InvalidRequest("callback_url must be a URL.", param="callback_url")
    if callback_url:
        from serving.batches.webhooks import BadCallback, check_callback_url

        try:
            callback_url = await asyncio.to_thread(check_callback_url, callback_url)
        except BadCallback as exc:
            raise InvalidRequest(exc.message, param="callback_url", code="invalid_callback_url") from None
    model = await find_model_for(grant, model_name)  # one outside the key's scope does not exist
    await take_request(grant)  # a batch's creation is a request, whatever its lines
    if is_predict_model(model):
        url = PREDICT_URL
    elif model.task == "embedding":
        url = "/v1/embeddings"
    else:
        url = "/v1/chat/completions"
    created = await run_db(_seed_create, grant, url, model.name, inputs, params, callback_url)
    return _json(created, status=202)


async def seed_batch_detail(request: ApiRequest, batch_id: str) -> HttpResponse:
    """``GET /api/v1/batch/{id}``: status, progress and result files in the seeds' words."""
    require_method(request, "GET")
    found = await _owned(request, batch_id)
    shown = await run_db(batch_object, found)
    counts = shown["request_counts"]
    return _json({
        "batch_id": found.public_id, "status": found.status, "model": found.model or None,
        "progress": {"total": counts["total"], "completed": counts["completed"], "failed": counts["failed"]},
        "output_file_id": shown["output_file_id"], "error_file_id": shown["error_file_id"],
        "created_at": shown["created_at"], "expires_at": shown["expires_at"],
    })  # fmt: skip
