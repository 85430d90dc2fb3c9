"""API-key authentication for the data plane: Bearer key → SHA-256 → the key's grants.

A looked-up key is cached in this process for at most API_KEY_CACHE_SECONDS, so a
revoked or expired key stops working everywhere within that time without a database
query on every request.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone

from billing.selectors import api_key_by_hash
from console.dbreads import read_now
from serving.errors import AuthenticationFailed, EngineUnavailable


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
    """Grants by key hash, never trusted longer than API_KEY_CACHE_SECONDS.

    An entry past half its life is still served while one background read refreshes it,
    so a busy key never waits for the database; concurrent misses share one read.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, KeyGrant | None]] = {}
        self._loading: dict[str, asyncio.Future[KeyGrant | None]] = {}

    async def grant(self, key_hash: str) -> KeyGrant | None:
        entry = self._entries.get(key_hash)
        if entry is not None:
            age = time.monotonic() - entry[0]
            if age < settings.API_KEY_CACHE_SECONDS:
                if age > settings.API_KEY_CACHE_SECONDS / 2:
                    self._load(key_hash)  # refresh ahead; this request uses the fresh-enough entry
                return entry[1]
        return await asyncio.shield(self._load(key_hash))

    def _load(self, key_hash: str) -> asyncio.Future[KeyGrant | None]:
        pending = self._loading.get(key_hash)
        if pending is not None:
            return pending
        started = time.monotonic()

        async def load() -> KeyGrant | None:
            try:
                grant = await read_now(_load_grant, key_hash)
                if len(self._entries) > 100_000:
                    self._entries.clear()
                self._entries[key_hash] = (started, grant)  # aged from before the read
                return grant
            finally:
                self._loading.pop(key_hash, None)

        future = asyncio.ensure_future(load())
        # A failed refresh-ahead nobody awaits must not warn; the next request retries.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._loading[key_hash] = future
        return future

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
    try:
        grant = await key_cache.grant(hashlib.sha256(secret.encode()).hexdigest())
    except DatabaseError as exc:
        # Fail closed: a key we cannot check is not accepted.
        raise EngineUnavailable(
            "API keys cannot be checked right now; try again shortly.", code="auth_unavailable"
        ) from exc
    if grant is None:
        raise AuthenticationFailed(f"Incorrect API key provided: {_redact(secret)}.")
    if grant.expires_at is not None and grant.expires_at <= timezone.now():
        raise AuthenticationFailed("The API key has expired.", code="expired_api_key")
    return grant


def _redact(secret: str) -> str:
    return f"{secret[:6]}***{secret[-4:]}" if len(secret) > 12 else "***"
