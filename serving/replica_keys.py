"""The secret each engine replica requires (vLLM ``--api-key``), known only to the platform.

Derived from SECRET_KEY and the replica's id, so the supervisor that starts a replica and
every gateway that calls it agree on it without storing it anywhere: a process that can
reach an engine's port but does not hold SECRET_KEY gets 401 from its API. (vLLM leaves
/health and /metrics open; the supervisor uses only those.)
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings


def replica_api_key(replica_id: int) -> str:
    digest = hmac.new(settings.SECRET_KEY.encode(), f"engine-replica:{replica_id}".encode(), hashlib.sha256)
    return "rk-" + digest.hexdigest()
