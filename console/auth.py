"""Signing in: Django's login for the console and the portal, and HTTP Basic on the management
API, rate-limited per account and per address with the same counts.

After LOGIN_MAX_FAILURES failed attempts within LOGIN_LOCKOUT_SECONDS for one username, or
five times as many from one address, further attempts are refused (429) until the window
passes, whether or not the password is right, so guessing costs time and an attacker
cannot learn when a guess was right. A good login clears the account's count. The counts
live in Redis (shared by every gateway process); without Redis, logins are not limited
rather than refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from typing import Any

from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.http import HttpRequest, HttpResponse
from redis.exceptions import RedisError
from rest_framework.authentication import BasicAuthentication
from rest_framework.exceptions import AuthenticationFailed, Throttled
from rest_framework.request import Request

from core import keys
from core.redis import sync_redis

logger = logging.getLogger(__name__)

# Per address, this many times the per-account budget: an office behind one NAT can still log in.
ADDRESS_FACTOR = 5


def _counter(kind: str, value: str) -> str:
    digest = hashlib.sha256(value.strip().lower().encode()).hexdigest()[:32]
    return keys.namespaced("login", "failures", kind, digest)


def _client_address(request: HttpRequest) -> str:
    return str(request.META.get("REMOTE_ADDR") or "unknown")


class LoginLimiter:
    """Failed password checks, counted per account and per address in Redis; every way in that
    checks a password (the login page, HTTP Basic on the management API) shares the counts."""

    def __init__(self, username: str, address: str) -> None:
        limit = settings.LOGIN_MAX_FAILURES
        self.username = username
        self.counters = [(_counter("address", address), limit * ADDRESS_FACTOR)]
        if username:
            self.counters.append((_counter("user", username), limit))

    def locked_for(self) -> int:
        """Seconds until a refused caller may try again; 0 when not refused."""
        try:
            with sync_redis().pipeline(transaction=False) as pipe:
                for key, _ in self.counters:
                    pipe.get(key)
                    pipe.ttl(key)
                replies = pipe.execute()
        except RedisError:
            logger.warning("login rate limit not checked: Redis unavailable")
            return 0
        waits = [
            max(int(replies[2 * i + 1]), 1)
            for i, (_, limit) in enumerate(self.counters)
            if replies[2 * i] is not None and int(replies[2 * i]) >= limit
        ]
        return max(waits, default=0)

    def failed(self) -> None:
        try:
            with sync_redis().pipeline(transaction=False) as pipe:
                for key, _ in self.counters:
                    pipe.incr(key)
                    pipe.expire(key, settings.LOGIN_LOCKOUT_SECONDS, nx=True)
                pipe.execute()
        except RedisError:
            logger.warning("failed login not counted: Redis unavailable")

    def succeeded(self) -> None:
        with contextlib.suppress(RedisError):
            sync_redis().delete(_counter("user", self.username))


class RateLimitedLoginView(LoginView):
    def _limiter(self) -> LoginLimiter:
        return LoginLimiter(str(self.request.POST.get("username", "")), _client_address(self.request))

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        wait = self._limiter().locked_for()
        if wait:
            form = self.get_form()
            minutes = max(1, round(wait / 60))
            form.add_error(None, f"Too many failed logins. Try again in {minutes} minute{'s' if minutes > 1 else ''}.")
            response = self.render_to_response(self.get_context_data(form=form, locked=True))
            response.status_code = 429
            response["Retry-After"] = str(wait)
            return response
        return super().post(request, *args, **kwargs)

    def form_invalid(self, form: AuthenticationForm) -> HttpResponse:
        self._limiter().failed()
        return super().form_invalid(form)

    def form_valid(self, form: AuthenticationForm) -> HttpResponse:
        self._limiter().succeeded()
        return super().form_valid(form)


class RateLimitedBasicAuthentication(BasicAuthentication):
    """HTTP Basic on the management API, under the login page's limits: a locked account or
    address is refused (429) before its password is hashed, and every failure counts."""

    def authenticate_credentials(self, userid: str, password: str, request: Request | None = None) -> tuple[Any, None]:
        limiter = LoginLimiter(userid, _client_address(request._request) if request is not None else "unknown")
        wait = limiter.locked_for()
        if wait:
            raise Throttled(wait=wait, detail="Too many failed logins for this account or address.")
        try:
            result = super().authenticate_credentials(userid, password, request)
        except AuthenticationFailed:
            limiter.failed()
            raise
        limiter.succeeded()
        return result
