"""External upstreams: versions served by an OpenAI-compatible server the platform does not run.

A version of the framework ``openai-upstream`` has no artifact to load; its ``registry.Upstream``
row says where it is served (a base URL), under which model name, and with which API key.
The key is sealed with Fernet under a key derived from SECRET_KEY (HKDF, its own purpose), so a
copy of the database alone never gives it away; rotating SECRET_KEY makes the stored keys
unreadable (``unseal`` raises ``SealBroken``) until they are set again.
"""

from __future__ import annotations

import base64
import functools
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

from core.errors import InvalidInput

UPSTREAM_FRAMEWORK = "openai-upstream"
MAX_API_KEY_LENGTH = 4096


def is_upstream_framework(framework: str) -> bool:
    return framework.strip().lower() == UPSTREAM_FRAMEWORK


@dataclass(frozen=True)
class UpstreamTarget:
    """An external version's upstream, its key unsealed: what supervisors probe and gateways call."""

    url: str
    served_model: str
    api_key: str  # empty: the upstream takes no key
    # What every call to it carries: built once, read by each engine call and probe.
    auth_headers: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "auth_headers", {"authorization": f"Bearer {self.api_key}"} if self.api_key else {})


class SealBroken(Exception):
    """A sealed key that this SECRET_KEY cannot open (the key was rotated, or the value altered)."""


@functools.lru_cache(maxsize=4)
def _fernet(secret_key: str) -> Fernet:
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"upstream-api-keys").derive(
        secret_key.encode()
    )
    return Fernet(base64.urlsafe_b64encode(derived))


def seal(api_key: str) -> str:
    """The key encrypted for storage; empty stays empty (an upstream that takes no key)."""
    return _fernet(settings.SECRET_KEY).encrypt(api_key.encode()).decode() if api_key else ""


def unseal(sealed: str) -> str:
    if not sealed:
        return ""
    try:
        return _fernet(settings.SECRET_KEY).decrypt(sealed.encode()).decode()
    except InvalidToken as exc:
        raise SealBroken("the upstream's API key cannot be decrypted with this SECRET_KEY; set it again") from exc


def clean_url(url: str) -> str:
    """An upstream's base URL, refused unless it is a plain http(s) URL: no credentials in it
    (they go in the API key), no query or fragment, no /v1 (the platform adds the paths)."""
    url = url.strip()
    if "\x00" in url or any(ch.isspace() for ch in url):
        raise InvalidInput("upstream.url", "A URL has no spaces or NUL characters.")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInput("upstream.url", "Must be an http:// or https:// URL with a host.")
    if parts.username or parts.password:
        raise InvalidInput("upstream.url", "Put the credentials in api_key, not in the URL.")
    if parts.query or parts.fragment:
        raise InvalidInput("upstream.url", "The base URL takes no query or fragment.")
    try:
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError as exc:
        raise InvalidInput("upstream.url", "The port is not a number from 1 to 65535.") from exc
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    if len(base) > 512:
        raise InvalidInput("upstream.url", "At most 512 characters.")
    return base


def clean_served_model(name: str) -> str:
    name = name.strip()
    if not name or len(name) > 255 or "\x00" in name:
        raise InvalidInput("upstream.model", "The upstream's model name: 1 to 255 characters, no NUL.")
    return name


def clean_api_key(api_key: str) -> str:
    """It travels in an HTTP header: printable ASCII only, and bounded."""
    if len(api_key) > MAX_API_KEY_LENGTH:
        raise InvalidInput("upstream.api_key", f"At most {MAX_API_KEY_LENGTH} characters.")
    if any(not (32 < ord(ch) < 127) for ch in api_key):
        raise InvalidInput("upstream.api_key", "Printable ASCII without spaces only (it is sent in a header).")
    return api_key
