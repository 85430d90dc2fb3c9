"""The data plane in the OpenAPI schema: OpenAI's paths, the request bodies of ``serving.llm.schemas``,
the Open Inference Protocol's paths (small models) and the seed design's shapes.

The data plane is no DRF view (``serving.gateway.asgi`` serves it), so drf-spectacular cannot see
it; ``add_data_plane``, one of its postprocessing hooks, adds it to the schema at
``/api/schema/``. Request bodies come from the pydantic models that validate them, so the
schema cannot drift from what the gateway accepts. Every operation documents the errors
the gateway answers, each an OpenAI error body. The WebSocket API
(``/ws/v1/chat/completions``, ``serving.llm.consumers``) has no OpenAPI form.
"""

from __future__ import annotations

from typing import Any

from serving.batches.openapi import BATCH_SCHEMAS, FILE_SCHEMAS, batch_paths, file_paths
from serving.gateway.openapi import BEARER, ERROR_SCHEMAS, TAG
from serving.llm.openapi import RESPONSE_SCHEMAS, data_plane_paths, request_schemas
from serving.predict.openapi import SMALL_SCHEMAS, small_model_paths
from serving.semcache.openapi import CACHE_SCHEMAS, cache_paths


def add_data_plane(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: the data plane's paths, schemas and bearer auth."""
    components = result.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    added = {
        **ERROR_SCHEMAS, **RESPONSE_SCHEMAS, **SMALL_SCHEMAS, **FILE_SCHEMAS, **BATCH_SCHEMAS, **CACHE_SCHEMAS,
        **request_schemas(),
    }  # fmt: skip
    clash = sorted(set(added) & set(schemas))
    if clash:
        raise ValueError(f"data-plane schema names taken by the management API: {', '.join(clash)}")
    schemas.update(added)
    components.setdefault("securitySchemes", {})[BEARER] = {
        "type": "http",
        "scheme": "bearer",
        "description": "an API key: `Authorization: Bearer sk-…`",
    }
    paths = result.setdefault("paths", {})
    paths.update(data_plane_paths())
    paths.update(small_model_paths())
    paths.update(file_paths())
    paths.update(batch_paths())
    paths.update(cache_paths())
    result.setdefault("tags", [])
    if not any(tag.get("name") == TAG for tag in result["tags"]):
        result["tags"].append(
            {"name": TAG, "description": "OpenAI-compatible inference: authenticated by an API key (Bearer)"}
        )
    return result
