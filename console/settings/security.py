"""Who may reach the platform and how: the deployment environment, the secret key, allowed
hosts, HTTPS and its headers, passwords and sign-in."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

from core import embedded

from .env import envbool, envint, envlist


def development_secret_key(path: Path) -> str:
    """The development SECRET_KEY: made once and kept in ``path`` (mode 0600), so that
    `make run` needs no configuration and sessions survive restarts.

    Created atomically: written to a private temporary file, then linked into place, so
    processes starting at once agree on one key and none ever reads a half-written file.
    """
    with contextlib.suppress(FileNotFoundError):
        existing = path.read_text().strip()
        if existing:
            return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(64) + "\n")
        with contextlib.suppress(FileExistsError):  # another process made it first: use that one
            os.link(draft, path)
    finally:
        draft.unlink(missing_ok=True)
    key = path.read_text().strip()
    if not key:
        raise ImproperlyConfigured(f"{path} is empty: delete it and a new SECRET_KEY is made")
    return key


def public_base_url(value: str) -> str:
    """``PUBLIC_BASE_URL`` checked and without its trailing slash: an http(s) URL with a host
    and no query or fragment (a path is kept: a platform served under a prefix); "" when unset."""
    value = value.strip().rstrip("/")
    if not value:
        return ""
    parts = urlsplit(value)
    if parts.scheme not in {"http", "https"} or not parts.hostname or parts.query or parts.fragment:
        raise ImproperlyConfigured(
            f"PUBLIC_BASE_URL must be an http or https URL such as https://api.example.com, not {value!r}"
        )
    return value


# "development" (the default: `make run` with no configuration) or "production", which
# requires a SECRET_KEY and turns on HTTPS-only cookies, HSTS and the HTTPS redirect.
#: The deployment environment: "development" or "production" (env PLATFORM_ENV).
PLATFORM_ENV = os.environ.get("PLATFORM_ENV", "development").strip().lower()
if PLATFORM_ENV not in {"development", "production"}:
    raise ImproperlyConfigured(f"PLATFORM_ENV must be 'development' or 'production', not {PLATFORM_ENV!r}")
#: Whether PLATFORM_ENV is "production" (a bool).
PRODUCTION = PLATFORM_ENV == "production"

#: Django's debug mode (a bool; refused in production).
DEBUG = envbool("DEBUG", "false")
if PRODUCTION and DEBUG:
    raise ImproperlyConfigured("DEBUG must be off when PLATFORM_ENV=production")
#: Django's signing key (a string; required in production, else made once under PLATFORM_VAR_DIR).
SECRET_KEY = os.environ.get("SECRET_KEY", "").strip()
if not SECRET_KEY:
    if PRODUCTION:
        raise ImproperlyConfigured("SECRET_KEY must be set when PLATFORM_ENV=production")
    SECRET_KEY = development_secret_key(embedded.VAR_DIR / "secret_key")
#: Host names the platform answers to (a comma-separated list).
ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
#: Origins trusted for CSRF-checked requests besides the site's own (a comma-separated list of URLs).
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS", "")
# Behind a balancer the request's own host and scheme are right only if it passes the Host
# header and X-Forwarded-Proto is trusted (TRUST_PROXY_HEADERS); this names the address outright.
#: The address customers call the API at, as the portal's code snippets show it (a URL, e.g.
#: https://api.example.com; empty: each page's own scheme and host).
PUBLIC_BASE_URL = public_base_url(os.environ.get("PUBLIC_BASE_URL", ""))

# --- HTTP security ---------------------------------------------------------------------
#: Every response says X-Content-Type-Options: nosniff (a bool).
SECURE_CONTENT_TYPE_NOSNIFF = True
#: No page may be framed (the X-Frame-Options value).
X_FRAME_OPTIONS = "DENY"
#: The Referrer-Policy header's value.
SECURE_REFERRER_POLICY = "same-origin"
# Behind a TLS-terminating proxy that sets X-Forwarded-Proto (and strips it from clients).
#: Whether X-Forwarded-Proto from the proxy in front is trusted (a bool).
TRUST_PROXY_HEADERS = envbool("TRUST_PROXY_HEADERS", "false")
if TRUST_PROXY_HEADERS:
    #: The header and value that mark a request as HTTPS (set only when TRUST_PROXY_HEADERS).
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
if PRODUCTION:
    #: The session cookie is sent over HTTPS only (production only; a bool).
    SESSION_COOKIE_SECURE = True
    #: The CSRF cookie is sent over HTTPS only (production only; a bool).
    CSRF_COOKIE_SECURE = True
    #: Plain-HTTP requests are redirected to HTTPS (production only; a bool).
    SECURE_SSL_REDIRECT = envbool("SECURE_SSL_REDIRECT", "true")
    # Probes and the Prometheus scrape reach the process directly, over plain HTTP.
    #: Paths never redirected to HTTPS (production only; regular expressions).
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$", r"^metrics/platform$", r"^metrics/engines$"]
    #: The Strict-Transport-Security max-age (production only; seconds).
    SECURE_HSTS_SECONDS = envint("SECURE_HSTS_SECONDS", 31_536_000)
    #: HSTS covers subdomains too (production only; a bool).
    SECURE_HSTS_INCLUDE_SUBDOMAINS = envbool("SECURE_HSTS_INCLUDE_SUBDOMAINS", "true")
    #: HSTS asks to be preloaded by browsers (production only; a bool).
    SECURE_HSTS_PRELOAD = envbool("SECURE_HSTS_PRELOAD", "true")

# --- Passwords and sign-in ---------------------------------------------------------------
#: The checks a new password must pass (Django validator classes).
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
#: The login page (a URL path).
LOGIN_URL = "/accounts/login/"
# Five times as many per address; see console/auth.py.
#: Failed logins allowed per username within the lockout window (a count).
LOGIN_MAX_FAILURES = envint("LOGIN_MAX_FAILURES", 5)
#: The sign-in lockout window (seconds).
LOGIN_LOCKOUT_SECONDS = envint("LOGIN_LOCKOUT_SECONDS", 900)
#: Where a successful login goes (a URL path).
LOGIN_REDIRECT_URL = "/"
#: Where a logout goes (a URL path).
LOGOUT_REDIRECT_URL = "/accounts/login/"
