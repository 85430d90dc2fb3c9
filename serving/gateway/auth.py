"""API-key authentication for the data plane: Bearer key → SHA-256 → the key's grants.

A looked-up key is cached in this process for at most API_KEY_CACHE_SECONDS, so a
revoked or expired key stops working everywhere within that time without a database
query on every request.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone

from accounts.grants import KeyGrant
from accounts.selectors import api_key_by_hash
from accounts.services import api_keys_touch
from core import keys
from core.db import run_db
from core.lifecycle import Background, Worker, unobserved
from core.redis import async_redis
from serving.gateway.errors import AuthenticationFailed, EngineUnavailable
from serving.gateway.requests import ApiRequest
from serving.gateway.session_auth import session_grant

logger = logging.getLogger(__name__)

# last_used_at is written at most this often per key and process (not once per request).
LAST_USED_RESOLUTION = 60.0


_MISSING = AuthenticationFailed(
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
    code="missing_api_key",
)


def _load_grant(key_hash: str) -> KeyGrant | None:
    api_key = api_key_by_hash(key_hash=key_hash)
    # The index finds the row; the comparison that decides is constant-time all the same.
    if api_key is None or not hmac.compare_digest(api_key.key_hash, key_hash) or not api_key.is_active:
        return None
    return KeyGrant.of(api_key)


class KeyCache:
    """Grants by key hash, never trusted longer than API_KEY_CACHE_SECONDS.

    An entry past half its life is still served while one background read refreshes it,
    so a busy key never waits for the database; concurrent misses share one read. A key
    changed anywhere (revoked, rotated, new limits) is dropped at once when the change is
    published on Redis (``billing.services``); the age bound holds even if a message is lost.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, KeyGrant | None]] = {}
        self._loading: dict[str, asyncio.Future[KeyGrant | None]] = {}
        self._listener = Worker(self._listen_forever, name="key-invalidations")

    async def _listen_forever(self) -> None:
        while True:
            try:
                pubsub = async_redis().pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(keys.key_invalidation_channel())
                # Whatever changed while we were not listening is forgotten too.
                self._entries.clear()
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        self._entries.pop(message["data"].decode(), None)
            except Exception:
                logger.warning("key invalidation subscription lost; reconnecting", exc_info=True)
                await asyncio.sleep(1)

    async def grant(self, key_hash: str) -> KeyGrant | None:
        self._listener.ensure()
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
                grant = await run_db(_load_grant, key_hash)
                if len(self._entries) > 100_000:
                    self._entries.clear()
                self._entries[key_hash] = (started, grant)  # aged from before the read
                return grant
            finally:
                self._loading.pop(key_hash, None)

        # A failed refresh-ahead nobody awaits must not warn; the next request retries.
        future = unobserved(asyncio.ensure_future(load()))
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
    now = timezone.now()
    if grant.expires_at is not None and grant.expires_at <= now:
        raise AuthenticationFailed("The API key has expired.", code="expired_api_key")
    _note_use(grant.key_id, now)
    return grant


async def request_grant(request: ApiRequest, *, sessions: bool = False) -> KeyGrant:
    """Who sent ``request``, judged once and kept on it (``serving.gateway.asgi`` judges a request with
    a body from its headers, before reading the body): its API key (401 otherwise), or, where
    ``sessions`` allows and no key is sent, the signed-in member that ``X-Organization`` names
    (``serving.gateway.session_auth``: the portal's "try it", this site's own pages only)."""
    if request.grant is None:
        authorization, organization = request.header("authorization"), request.header("x-organization")
        if sessions and authorization is None and organization is not None:
            request.grant = await session_grant({"headers": request.raw_headers}, organization)
        else:
            request.grant = await authenticate(authorization)
    return request.grant


_last_written: dict[int, float] = {}
_touches = Background()


def _note_use(key_id: int, now: datetime) -> None:
    monotonic = time.monotonic()
    if monotonic - _last_written.get(key_id, -LAST_USED_RESOLUTION) < LAST_USED_RESOLUTION:
        return
    _last_written[key_id] = monotonic

    _touches.spawn(run_db(api_keys_touch, last_used={key_id: now}), what=f"record the last use of key {key_id}")


def _redact(secret: str) -> str:
    return f"{secret[:6]}***{secret[-4:]}" if len(secret) > 12 else "***"
