"""The secret each engine replica requires (vLLM ``--api-key``), known only to the platform.

Derived from SECRET_KEY and the replica's id, so the supervisor that starts a replica and
every gateway that calls it agree on it without storing it anywhere: a process that can
reach an engine's port but does not hold SECRET_KEY gets 401 from its API. (vLLM leaves
/health and /metrics open; the supervisor uses only those.)
"""

from __future__ import annotations

import functools
import hashlib
import hmac

from django.conf import settings


def replica_api_key(replica_id: int) -> str:
    return _replica_api_key(settings.SECRET_KEY, replica_id)


@functools.lru_cache(maxsize=4096)
def _replica_api_key(secret_key: str, replica_id: int) -> str:
    # Cached per (SECRET_KEY, replica): the gateway sends it on every engine call.
    digest = hmac.new(secret_key.encode(), f"engine-replica:{replica_id}".encode(), hashlib.sha256)
    return "rk-" + digest.hexdigest()
