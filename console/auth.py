"""Signing in to the console and the portal: Django's login, rate-limited per account and per address.

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


class RateLimitedLoginView(LoginView):
    def _counters(self) -> list[tuple[str, int]]:
        limit = settings.LOGIN_MAX_FAILURES
        counters = [(_counter("address", _client_address(self.request)), limit * ADDRESS_FACTOR)]
        username = str(self.request.POST.get("username", ""))
        if username:
            counters.append((_counter("user", username), limit))
        return counters

    def _locked_for(self) -> int:
        """Seconds until a refused caller may try again; 0 when not refused."""
        try:
            client = sync_redis()
            with client.pipeline(transaction=False) as pipe:
                for key, _ in self._counters():
                    pipe.get(key)
                    pipe.ttl(key)
                replies = pipe.execute()
        except RedisError:
            logger.warning("login rate limit not checked: Redis unavailable")
            return 0
        waits = [
            max(int(replies[2 * i + 1]), 1)
            for i, (_, limit) in enumerate(self._counters())
            if replies[2 * i] is not None and int(replies[2 * i]) >= limit
        ]
        return max(waits, default=0)

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        wait = self._locked_for()
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
        try:
            with sync_redis().pipeline(transaction=False) as pipe:
                for key, _ in self._counters():
                    pipe.incr(key)
                    pipe.expire(key, settings.LOGIN_LOCKOUT_SECONDS, nx=True)
                pipe.execute()
        except RedisError:
            logger.warning("failed login not counted: Redis unavailable")
        return super().form_invalid(form)

    def form_valid(self, form: AuthenticationForm) -> HttpResponse:
        username = str(self.request.POST.get("username", ""))
        with contextlib.suppress(RedisError):
            sync_redis().delete(_counter("user", username))
        return super().form_valid(form)
