"""Writes of the data plane's own tables that operators start: purging the semantic cache."""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from billing.models import Organization
from billing.services import InvalidInput
from serving.semcache.store import TABLE, delete_in_batches, scope_sizes_refresh

logger = logging.getLogger(__name__)


def cache_purge(
    *,
    model: str | None = None,
    version: str | None = None,
    organization: Organization | int | None = None,
    batch_size: int = 5000,
) -> int:
    """Delete the semantic-cache entries that match every filter given (a model's name, a
    version string — of that model, or of every model when alone — and the organisation
    whose requests stored them); returns how many. At least one filter is required.

    Not one transaction: batches of ``batch_size`` commit one by one (short locks, WAL in
    small pieces), so a purge cut short leaves the rest for running it again. Rows a hit is
    updating are waited for, never skipped: a purged entry is not served again. Answers
    still being generated when it runs may be stored afterwards.
    """
    conditions: list[str] = []
    params: dict[str, object] = {}
    if model is not None:
        if not model.strip():
            raise InvalidInput("model", "Give a model name.")
        conditions.append("model = %(model)s")
        params["model"] = model
    if version is not None:
        if not version.strip():
            raise InvalidInput("version", "Give a version.")
        conditions.append("model_version = %(version)s")
        params["version"] = version
    if organization is not None:
        conditions.append("organization_id = %(organization)s")
        params["organization"] = organization.pk if isinstance(organization, Organization) else int(organization)
    if not conditions:
        raise InvalidInput("model", "Give at least one of model, version or organization.")
    where = " AND ".join(conditions)
    sql = f"DELETE FROM {TABLE} WHERE id IN (SELECT id FROM {TABLE} WHERE {where} LIMIT %(batch)s FOR UPDATE)"
    purged = delete_in_batches(sql, params, batch_size=batch_size, max_batches=2**31)
    if purged:
        try:
            scope_sizes_refresh()  # emptied scopes go back to exact search at once
        except RedisError:
            logger.warning("cache scope sizes not recounted after a purge (the beat task will)")
    logger.info("purged %d semantic-cache entries (%s)", purged, ", ".join(f"{k}={v}" for k, v in params.items()))
    return purged
