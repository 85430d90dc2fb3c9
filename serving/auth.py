"""API-key authentication for the data plane: Bearer key → SHA-256 → the key's grants.

A looked-up key is cached in this process for at most API_KEY_CACHE_SECONDS, so a
revoked or expired key stops working everywhere within that time without a database
query on every request.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from datetime import datetime

from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from billing.selectors import api_key_by_hash
from serving.errors import AuthenticationFailed


@dataclass(frozen=True)
class KeyGrant:
    """What a valid key may do, as seen by the gateway."""

    key_id: int
    organization_id: int
    prefix: str
    allowed_models: frozenset[str]
    rate_limit_rpm: int
    rate_limit_tpm: int
    expires_at: datetime | None

    def may_use(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models


_MISSING = AuthenticationFailed(
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
    code="missing_api_key",
)


def _load_grant(key_hash: str) -> KeyGrant | None:
    api_key = api_key_by_hash(key_hash=key_hash)
    if api_key is None or not api_key.is_active:
        return None
    return KeyGrant(
        key_id=api_key.pk,
        organization_id=api_key.organization_id,
        prefix=api_key.prefix,
        allowed_models=frozenset(api_key.allowed_models),
        rate_limit_rpm=api_key.rate_limit_rpm,
        rate_limit_tpm=api_key.rate_limit_tpm,
        expires_at=api_key.expires_at,
    )


class KeyCache:
    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, KeyGrant | None]] = {}

    async def grant(self, key_hash: str) -> KeyGrant | None:
        now = time.monotonic()
        entry = self._entries.get(key_hash)
        if entry is not None and now - entry[0] < settings.API_KEY_CACHE_SECONDS:
            return entry[1]
        grant = await sync_to_async(_load_grant)(key_hash)
        if len(self._entries) > 100_000:
            self._entries.clear()
        self._entries[key_hash] = (now, grant)
        return grant

    def clear(self) -> None:
        self._entries.clear()


key_cache = KeyCache()


def bearer_secret(authorization: str | None) -> str:
    if not authorization:
        raise _MISSING
    scheme, _, secret = authorization.partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise _MISSING
    return secret


async def authenticate(authorization: str | None) -> KeyGrant:
    secret = bearer_secret(authorization)
    grant = await key_cache.grant(hashlib.sha256(secret.encode()).hexdigest())
    if grant is None:
        raise AuthenticationFailed(f"Incorrect API key provided: {_redact(secret)}.")
    if grant.expires_at is not None and grant.expires_at <= timezone.now():
        raise AuthenticationFailed("The API key has expired.", code="expired_api_key")
    return grant


def _redact(secret: str) -> str:
    return f"{secret[:6]}***{secret[-4:]}" if len(secret) > 12 else "***"
