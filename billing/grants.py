"""What a valid API key may do, as the data plane sees it: models, tier, and two levels of limits."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from billing.models import ApiKey, Limits


@dataclass(frozen=True)
class ScopeLimits:
    """One level's limits (a key's, or its organisation's); None means no limit."""

    rpm: int | None
    tpm: int | None
    concurrent: int | None
    token_quota: int | None
    spend_cap: Decimal | None
    alert_percent: int

    @classmethod
    def of(cls, obj: Limits) -> ScopeLimits:
        return cls(
            rpm=obj.rate_limit_rpm,
            tpm=obj.rate_limit_tpm,
            concurrent=obj.max_concurrent,
            token_quota=obj.monthly_token_quota,
            spend_cap=obj.monthly_spend_cap,
            alert_percent=obj.budget_alert_percent,
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

    def may_use(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models

    @classmethod
    def of(cls, api_key: ApiKey) -> KeyGrant:
        """Call with ``api_key.organization`` already loaded (select_related)."""
        return cls(
            key_id=api_key.pk,
            organization_id=api_key.organization_id,
            prefix=api_key.prefix,
            allowed_models=frozenset(api_key.allowed_models),
            tier=api_key.tier,
            key_limits=ScopeLimits.of(api_key),
            org_limits=ScopeLimits.of(api_key.organization),
            expires_at=api_key.expires_at,
        )
