"""Writes for accounts: organisations, memberships, API keys."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils.text import slugify

from billing.models import ApiKey, Membership, Organization, Role

KEY_PREFIX = "sk-"
# 32 random bytes: 256 bits of entropy, url-safe, 43 characters after the prefix.
_SECRET_BYTES = 32
DISPLAY_PREFIX_LENGTH = 10


def api_key_hash(secret: str) -> str:
    """Hex SHA-256 of a full key: the only form in which keys are stored or looked up."""
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class IssuedApiKey:
    """A freshly created key. ``secret`` exists only here; it is never stored."""

    api_key: ApiKey
    secret: str


def organization_create(*, name: str, slug: str | None = None) -> Organization:
    return Organization.objects.create(name=name, slug=slug or slugify(name))


def organization_get_or_create(*, name: str) -> Organization:
    org, _ = Organization.objects.get_or_create(name=name, defaults={"slug": slugify(name)})
    return org


def membership_set(*, user: AbstractBaseUser, organization: Organization, role: Role | str) -> Membership:
    membership, _ = Membership.objects.update_or_create(user=user, organization=organization, defaults={"role": role})
    return membership


def api_key_create(
    *,
    organization: Organization,
    name: str,
    rate_limit_rpm: int = 60,
    rate_limit_tpm: int = 100_000,
    allowed_models: Sequence[str] = (),
    expires_at: datetime | None = None,
) -> IssuedApiKey:
    if rate_limit_rpm <= 0 or rate_limit_tpm <= 0:
        raise ValueError("rate limits must be positive")
    if expires_at is not None and expires_at.tzinfo is None:
        raise ValueError("expires_at must be timezone-aware")
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
        )
    return IssuedApiKey(api_key=api_key, secret=secret)
