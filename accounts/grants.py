"""What a valid API key may do, as the data plane sees it: models, tier, and two levels of limits.

A grant is always within the organisation's *current* plan, whatever the key was created
with: its tier is at most the organisation's, and each of its limits at most the plan's
ceiling (``accounts.selectors.plan_key_ceilings``; an empty limit under a ceiling becomes the
ceiling). So a downgraded organisation's old keys, and keys rotated from them, are admitted
only within the plan it is on now.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from accounts.models import ApiKey, Limits, Tier
from accounts.selectors import KEY_CEILING_FIELDS, TIER_RANK, plan_key_ceilings


@dataclass(frozen=True)
class ScopeLimits:
    """One level's limits (a key's, or its organisation's); None means no limit."""

    rpm: int | None
    tpm: int | None
    concurrent: int | None
    token_quota: int | None
    spend_cap: Decimal | None
    alert_percent: int
    ipm: int | None = None  # inferences (small models' items) per minute

    @classmethod
    def of(cls, obj: Limits, *, ceilings: dict[str, int | Decimal | None] | None = None) -> ScopeLimits:
        """``obj``'s limits, each at most its ceiling where ``ceilings`` gives one."""
        values: dict[str, Any] = {field: getattr(obj, field) for field in KEY_CEILING_FIELDS}
        for field, ceiling in (ceilings or {}).items():
            if ceiling is not None:
                values[field] = ceiling if values[field] is None else min(values[field], ceiling)
        return cls(
            rpm=values["rate_limit_rpm"],
            tpm=values["rate_limit_tpm"],
            concurrent=values["max_concurrent"],
            token_quota=values["monthly_token_quota"],
            spend_cap=values["monthly_spend_cap"],
            alert_percent=obj.budget_alert_percent,
            ipm=values["rate_limit_ipm"],
        )


@dataclass(frozen=True)
class KeyGrant:
    """A key's grants, cached by gateways for at most API_KEY_CACHE_SECONDS."""

    key_id: int
    organization_id: int
    prefix: str
    allowed_models: frozenset[str]
    tier: str
    key_limits: ScopeLimits
    org_limits: ScopeLimits
    expires_at: datetime | None
    cache_wrong_hit_budget: float | None = None  # the organisation's, as a share (None: the model's)

    def may_use(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models

    @classmethod
    def of(cls, api_key: ApiKey) -> KeyGrant:
        """The key's grant within its organisation's current plan (reads the plan: sync ORM).

        Call with ``api_key.organization`` already loaded (select_related).
        """
        organization = api_key.organization
        tier = api_key.tier
        if TIER_RANK[Tier(tier)] > TIER_RANK[Tier(organization.tier)]:
            tier = organization.tier
        return cls(
            key_id=api_key.pk,
            organization_id=api_key.organization_id,
            prefix=api_key.prefix,
            allowed_models=frozenset(api_key.allowed_models),
            tier=tier,
            key_limits=ScopeLimits.of(api_key, ceilings=plan_key_ceilings(organization=organization)),
            org_limits=ScopeLimits.of(organization),
            expires_at=api_key.expires_at,
            cache_wrong_hit_budget=(
                None
                if organization.cache_wrong_hit_budget is None
                else float(organization.cache_wrong_hit_budget) / 100
            ),
        )
