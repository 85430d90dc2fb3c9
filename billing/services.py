"""Writes for accounts: organisations, memberships, API keys and their limits."""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone
from django.utils.text import slugify

from billing.models import ApiKey, Membership, Organization, Role, Tier
from core import keys
from core.redis import sync_redis

KEY_PREFIX = "sk-"
# 32 random bytes: 256 bits of entropy, url-safe, 43 characters after the prefix.
_SECRET_BYTES = 32
DISPLAY_PREFIX_LENGTH = 10
# Fields of Limits that callers may set on an organisation or a key.
LIMIT_FIELDS = (
    "rate_limit_rpm",
    "rate_limit_tpm",
    "max_concurrent",
    "monthly_token_quota",
    "monthly_spend_cap",
    "budget_alert_percent",
)


def api_key_hash(secret: str) -> str:
    """Hex SHA-256 of a full key: the only form in which keys are stored or looked up."""
    return hashlib.sha256(secret.encode()).hexdigest()


def key_invalidation_channel() -> str:
    return keys.key_invalidation_channel()


def _publish_key_change(key_hash: str) -> None:
    """Tell every gateway to drop its cached copy of this key, after the change commits.

    Gateways never trust a cached key for more than a second anyway; this makes it at once.
    """

    def publish() -> None:
        # Best effort: the 1 s cache bound still holds without the message.
        with contextlib.suppress(Exception):
            sync_redis().publish(key_invalidation_channel(), key_hash)

    transaction.on_commit(publish)


@dataclass(frozen=True)
class IssuedApiKey:
    """A freshly created key. ``secret`` exists only here; it is never stored."""

    api_key: ApiKey
    secret: str


def _validate_limits(values: dict[str, Any]) -> None:
    for name in ("rate_limit_rpm", "rate_limit_tpm", "max_concurrent", "monthly_token_quota"):
        value = values.get(name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive (or empty for no limit)")
    cap = values.get("monthly_spend_cap")
    if cap is not None and Decimal(cap) <= 0:
        raise ValueError("monthly_spend_cap must be positive (or empty for no limit)")
    alert = values.get("budget_alert_percent")
    if alert is not None and not 1 <= alert <= 100:
        raise ValueError("budget_alert_percent must be between 1 and 100")


def organization_create(*, name: str, slug: str | None = None, tier: str = Tier.PAID, **limits: Any) -> Organization:
    _validate_limits(limits)
    return Organization.objects.create(name=name, slug=slug or slugify(name), tier=tier, **limits)


def organization_get_or_create(*, name: str) -> Organization:
    org, _ = Organization.objects.get_or_create(name=name, defaults={"slug": slugify(name)})
    return org


def organization_update(*, organization: Organization, **changes: Any) -> Organization:
    """Change an organisation's name, tier or limits; gateways see new limits within a second."""
    allowed = {"name", "tier", *LIMIT_FIELDS}
    unknown = set(changes) - allowed
    if unknown:
        raise ValueError(f"cannot change {', '.join(sorted(unknown))}")
    _validate_limits(changes)
    with transaction.atomic():
        for name, value in changes.items():
            setattr(organization, name, value)
        organization.save(update_fields=list(changes))
        for key_hash in organization.api_keys.values_list("key_hash", flat=True):
            _publish_key_change(key_hash)
    return organization


def membership_set(*, user: AbstractBaseUser, organization: Organization, role: Role | str) -> Membership:
    membership, _ = Membership.objects.update_or_create(user=user, organization=organization, defaults={"role": role})
    return membership


def membership_remove(*, membership: Membership) -> None:
    membership.delete()


def api_key_create(
    *,
    organization: Organization,
    name: str,
    rate_limit_rpm: int = 60,
    rate_limit_tpm: int = 100_000,
    allowed_models: Sequence[str] = (),
    expires_at: datetime | None = None,
    tier: str | None = None,
    max_concurrent: int | None = None,
    monthly_token_quota: int | None = None,
    monthly_spend_cap: Decimal | None = None,
    budget_alert_percent: int = 80,
) -> IssuedApiKey:
    _validate_limits(
        {
            "rate_limit_rpm": rate_limit_rpm,
            "rate_limit_tpm": rate_limit_tpm,
            "max_concurrent": max_concurrent,
            "monthly_token_quota": monthly_token_quota,
            "monthly_spend_cap": monthly_spend_cap,
            "budget_alert_percent": budget_alert_percent,
        }
    )
    if rate_limit_rpm is None or rate_limit_tpm is None:
        raise ValueError("rate limits must be positive")
    if expires_at is not None and expires_at.tzinfo is None:
        raise ValueError("expires_at must be timezone-aware")
    if tier is not None and tier not in Tier.values:
        raise ValueError(f"tier must be one of {', '.join(Tier.values)}")
    secret = KEY_PREFIX + secrets.token_urlsafe(_SECRET_BYTES)
    with transaction.atomic():
        api_key = ApiKey.objects.create(
            key_hash=api_key_hash(secret),
            prefix=secret[:DISPLAY_PREFIX_LENGTH],
            organization=organization,
            name=name,
            rate_limit_rpm=rate_limit_rpm,
            rate_limit_tpm=rate_limit_tpm,
            allowed_models=list(allowed_models),
            expires_at=expires_at,
            tier=tier or organization.tier,
            max_concurrent=max_concurrent,
            monthly_token_quota=monthly_token_quota,
            monthly_spend_cap=monthly_spend_cap,
            budget_alert_percent=budget_alert_percent,
        )
    return IssuedApiKey(api_key=api_key, secret=secret)


def api_key_update(*, api_key: ApiKey, **changes: Any) -> ApiKey:
    """Rename a key, change its models, expiry, tier or limits; applied by gateways within 1 s."""
    allowed = {"name", "allowed_models", "expires_at", "tier", *LIMIT_FIELDS}
    unknown = set(changes) - allowed
    if unknown:
        raise ValueError(f"cannot change {', '.join(sorted(unknown))}")
    _validate_limits(changes)
    if changes.get("rate_limit_rpm", 1) is None or changes.get("rate_limit_tpm", 1) is None:
        raise ValueError("a key always has requests and tokens per minute limits")
    with transaction.atomic():
        for name, value in changes.items():
            setattr(api_key, name, value)
        api_key.save(update_fields=list(changes))
        _publish_key_change(api_key.key_hash)
    return api_key


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Refused by every gateway process within a second (at once where pub/sub reaches it)."""
    with transaction.atomic():
        ApiKey.objects.filter(pk=api_key.pk).update(is_active=False, revoked_at=timezone.now())
        api_key.refresh_from_db(fields=["is_active", "revoked_at"])
        _publish_key_change(api_key.key_hash)
    return api_key


def api_key_rotate(*, api_key: ApiKey, grace: timedelta) -> IssuedApiKey:
    """A new key with the same grants; the old one keeps working for ``grace``, then expires."""
    if not api_key.is_active:
        raise ValueError("a revoked key cannot be rotated")
    if grace < timedelta(0):
        raise ValueError("the grace period cannot be negative")
    with transaction.atomic():
        locked = ApiKey.objects.select_for_update().get(pk=api_key.pk)
        if locked.rotated_to_id is not None:
            raise ValueError("this key was already rotated")
        issued = api_key_create(
            organization=locked.organization,
            name=locked.name,
            allowed_models=locked.allowed_models,
            expires_at=locked.expires_at,
            tier=locked.tier,
            **{field: getattr(locked, field) for field in LIMIT_FIELDS},
        )
        ends = timezone.now() + grace
        locked.expires_at = min(ends, locked.expires_at) if locked.expires_at else ends
        locked.rotated_to = issued.api_key
        locked.save(update_fields=["expires_at", "rotated_to"])
        _publish_key_change(locked.key_hash)
    api_key.refresh_from_db()
    return issued


def api_keys_touch(*, last_used: dict[int, datetime]) -> None:
    """Record when keys were last used (batched by the gateways, at most once a minute a key)."""
    for key_id, when in last_used.items():
        ApiKey.objects.filter(pk=key_id).exclude(last_used_at__gte=when).update(last_used_at=when)
