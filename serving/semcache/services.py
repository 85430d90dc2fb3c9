"""Writes of the semantic cache that operators start: purge entries, set a model's cache policy."""

from __future__ import annotations

import logging
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import transaction
from redis.exceptions import RedisError

from accounts.models import Organization
from core.errors import InvalidInput
from core.events import publish_routing_change
from core.validators import clean_percent
from registry.models import Model
from registry.services import Actor, audit_record
from serving.gateway.models import CachePolicy
from serving.semcache.store import TABLE, delete_in_batches, scope_sizes_refresh

logger = logging.getLogger(__name__)

# Bounds of the policy's fields (the model's validators, and what a gateway may sensibly hold).
MAX_CACHE_TEMPERATURE = Decimal(2)


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


def _cache_policy_snapshot(policy: CachePolicy | None) -> dict[str, Any] | None:
    if policy is None:
        return None
    return {
        "enabled": policy.enabled,
        "max_temperature": str(policy.max_temperature),
        "max_prompt_tokens": policy.max_prompt_tokens,
        "ttl_seconds": policy.ttl_seconds,
        "shared_scope": policy.shared_scope,
        "wrong_hit_budget": None if policy.wrong_hit_budget is None else str(policy.wrong_hit_budget),
        "paraphrases": policy.paraphrases,
    }


MAX_CACHE_TTL_SECONDS = 30 * 24 * 3600


def cache_policy_set(
    *,
    model: Model,
    enabled: bool,
    max_temperature: Decimal | float | str,
    max_prompt_tokens: int,
    ttl_seconds: int,
    shared_scope: bool,
    wrong_hit_budget: Decimal | float | str | None = None,
    paraphrases: bool | None = None,
    actor: Actor = None,
) -> CachePolicy:
    """Set ``model``'s semantic-cache rules (``serving.semcache.policy``), creating its policy
    if it had none; every gateway applies them at once (they are part of the routing
    snapshot). Entries already stored keep their expiry. ``paraphrases`` None: the platform's
    default (SEMANTIC_CACHE_PARAPHRASES). Audited."""
    try:
        temperature = Decimal(str(max_temperature))
    except InvalidOperation:
        raise InvalidInput("max_temperature", "Give a number from 0 to 2.") from None
    if not temperature.is_finite() or not 0 <= temperature <= MAX_CACHE_TEMPERATURE:
        raise InvalidInput("max_temperature", "Give a number from 0 to 2.")
    if temperature != temperature.quantize(Decimal("0.01")):
        raise InvalidInput("max_temperature", "At most two decimals.")
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
        raise InvalidInput("max_prompt_tokens", "Give a whole number of tokens, at least 1.")
    if (
        isinstance(ttl_seconds, bool)
        or not isinstance(ttl_seconds, int)
        or not 1 <= ttl_seconds <= MAX_CACHE_TTL_SECONDS
    ):
        raise InvalidInput("ttl_seconds", f"Give a whole number of seconds from 1 to {MAX_CACHE_TTL_SECONDS:,}.")
    budget = clean_percent("wrong_hit_budget", wrong_hit_budget)
    values = {
        "enabled": bool(enabled),
        "max_temperature": temperature.quantize(Decimal("0.01")),
        "max_prompt_tokens": max_prompt_tokens,
        "ttl_seconds": ttl_seconds,
        "shared_scope": bool(shared_scope),
        "wrong_hit_budget": budget,
        "paraphrases": None if paraphrases is None else bool(paraphrases),
    }
    with transaction.atomic():
        before = _cache_policy_snapshot(CachePolicy.objects.select_for_update().filter(model=model).first())
        policy, _ = CachePolicy.objects.update_or_create(model=model, defaults=values)
        after = _cache_policy_snapshot(policy)
        if after != before:
            audit_record(actor=actor, action="cache_policy.set", target_type="model", target=model.name,
                         before=before, after=after)  # fmt: skip
            publish_routing_change("cache policy")
    return policy
