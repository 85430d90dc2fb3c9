"""The console playground's way into the WebSocket API: a signed-in session, not a key.

A browser on this site's own pages sends ``{"type": "auth", "organization": <id>}`` on the
socket. The handshake's session cookie names the user (Django's session, checked as a page
request checks it: a logged-out or password-changed session is no longer valid), the
organisation must be one the user belongs to, and the socket's ``Origin`` must be this site
(a page elsewhere could otherwise ride the cookie: cross-site WebSocket hijacking; cookies
are sent on WebSocket handshakes whatever the page). Requests are then metered to the
member's playground key (``accounts.services.playground_key_get_or_create``), whose limits
and budgets apply as to any key. Everything is checked again on each request, so signing
out, leaving the organisation or a revoked playground key stops the next request.
"""

from __future__ import annotations

from importlib import import_module
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth import get_user
from django.db import DatabaseError
from django.http import parse_cookie
from django.utils import timezone

from accounts.grants import KeyGrant
from accounts.models import Organization
from accounts.selectors import role_in
from accounts.services import playground_key_get_or_create
from core.db import run_db
from serving.gateway.errors import AuthenticationFailed, EngineUnavailable, InvalidRequest, NotFound, PermissionDenied

_ORIGIN_REFUSED = PermissionDenied(
    "Signed-in sessions may open this socket only from this site's own pages.", code="origin_not_allowed"
)
_NOT_SIGNED_IN = AuthenticationFailed("Sign in to the console to use the playground.", code="not_signed_in")


def _header(scope: dict[str, Any], name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin1")
    return ""


def origin_allowed(scope: dict[str, Any]) -> bool:
    """The handshake's Origin is the site it was sent to (or one of CSRF_TRUSTED_ORIGINS)."""
    origin = _header(scope, b"origin").strip()
    if not origin or origin == "null":
        return False
    if origin in settings.CSRF_TRUSTED_ORIGINS:
        return True
    parts = urlsplit(origin)
    host = _header(scope, b"host").strip().lower()
    return parts.scheme in ("http", "https") and bool(host) and parts.netloc.lower() == host


def _grant(cookie_header: str, organization_id: int) -> KeyGrant:
    """Sync (runs in a worker thread): session → user → membership → the playground key's grant."""
    session_key = parse_cookie(cookie_header).get(settings.SESSION_COOKIE_NAME)
    if not session_key:
        raise _NOT_SIGNED_IN
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    # get_user reads only request.session: it verifies the session's auth hash (a changed
    # password signs it out) and that the user is still active.
    user = get_user(SimpleNamespace(session=store))  # type: ignore[arg-type]
    if not user.is_authenticated:
        raise _NOT_SIGNED_IN
    organization = Organization.objects.filter(pk=organization_id).first()
    # A stranger learns nothing about which organisations exist.
    if organization is None or role_in(user, organization) is None:
        raise NotFound("You are not a member of this organisation.", code="organization_not_found")
    api_key = playground_key_get_or_create(organization=organization, user=user)
    if not api_key.is_active:
        raise AuthenticationFailed("Your playground key was revoked by an organisation admin.", code="revoked_api_key")
    if api_key.expires_at is not None and api_key.expires_at <= timezone.now():
        raise AuthenticationFailed("Your playground key has expired.", code="expired_api_key")
    return KeyGrant.of(api_key)


async def session_grant(scope: dict[str, Any], organization_id: Any) -> KeyGrant:
    """The grant a signed-in member's playground requests run under; an APIError says why not."""
    if not origin_allowed(scope):
        raise _ORIGIN_REFUSED
    if isinstance(organization_id, bool) or not isinstance(organization_id, int | str):
        raise InvalidRequest("'organization' must be an organisation id.", param="organization")
    try:
        org_id = int(organization_id)
    except ValueError:
        raise InvalidRequest("'organization' must be an organisation id.", param="organization") from None
    if not 0 < org_id < 2**31:
        raise NotFound("You are not a member of this organisation.", code="organization_not_found")
    try:
        return await run_db(_grant, _header(scope, b"cookie"), org_id)
    except DatabaseError as exc:  # fail closed, as API keys do
        raise EngineUnavailable(
            "Sign-ins cannot be checked right now; try again shortly.", code="auth_unavailable"
        ) from exc
