"""Every Redis key, stream and pub/sub channel that more than one module uses, named once.

Names live under ``settings.REDIS_NAMESPACE`` (pub/sub channels are not scoped by Redis
database number, and a test run must never touch a running platform). Who writes and
who reads each one is said beside it; docs/architecture.md has the whole ledger.
"""

from __future__ import annotations

from django.conf import settings


def namespaced(*parts: str) -> str:
    """A key or channel name inside this deployment's namespace."""
    return ":".join((settings.REDIS_NAMESPACE, *parts))


# --- The ledger (billing/ledger.py + ledger.lua) ---------------------------------------


def inflight_requests() -> str:
    """Hash: request id → the in-flight entry (usage so far, gateway, what settling undoes)."""
    return namespaced("usage", "inflight")


def usage_stream() -> str:
    """Stream of usage events, one per admitted request; read by billing.usage."""
    return namespaced("usage")


def usage_dead_letters() -> str:
    """Stream of usage events the persister could not store, with the reason."""
    return namespaced("usage", "dead")


def usage_counts(hour: str) -> str:
    """Hash of what the ledger wrote for requests admitted in one UTC hour (``YYYYMMDDHH``):
    ``events``; read by billing's reconciliation. Kept 40 days."""
    return namespaced("usage", "count", hour)


def swept_request(request_id: str) -> str:
    """What the sweeper charged a request it settled from its admission draft (kept 7 days), so
    that the gateway's own later settlement corrects it instead of being dropped."""
    return namespaced("usage", "swept", request_id)


def failed_attempts() -> str:
    """Stream of engine attempts that failed before a request's first byte and were retried
    elsewhere (a usage event each, never billed); read by billing.usage for the canaries."""
    return namespaced("usage", "attempts")


def failed_attempt_dead_letters() -> str:
    """Stream of failed attempts the persister could not store, with the reason."""
    return namespaced("usage", "attempts", "dead")


def budget_alerts() -> str:
    """Stream of soft budget alerts raised at admission; read by billing.usage."""
    return namespaced("budget", "alerts")


def budget_alert_dead_letters() -> str:
    """Stream of budget alerts that failed too often to be stored, with the reason."""
    return namespaced("budget", "alerts", "dead")


def limit_scope(kind: str, ident: int) -> str:
    """Prefix of one scope's limiter keys (``kind`` is ``key`` or ``org``): :rpm, :tpm, :conc, :b:<month>."""
    return namespaced("lim", kind, str(ident))


def model_queue(model: str) -> str:
    """Sorted set of a model's requests in flight across every gateway (backpressure)."""
    return namespaced("model", model, "inflight")


def limiter_test_clock() -> str:
    """Tests only (LIMITS_TEST_CLOCK): overrides the limiter's clock."""
    return namespaced("testclock")


def gateway_heartbeat(gateway_id: str) -> str:
    """A gateway process is alive while this key exists (expires after GATEWAY_LOST_AFTER)."""
    return namespaced("gateway", gateway_id)


def gateway_suspects() -> str:
    """Hash: gateway id → Redis time the sweeper first found its heartbeat missing."""
    return namespaced("gateway", "suspects")


# --- Keys and caches --------------------------------------------------------------------


def predict_result(organization_id: int, digest: str) -> str:
    """A small model's answer, by its organisation and the hash of its version and inputs (TTL'd)."""
    return namespaced("predcache", str(organization_id), digest)


def embeddings_cache(digest: str) -> str:
    """An embeddings answer, by the SHA-256 of its model version, tenant and request (TTL'd)."""
    return namespaced("embcache", digest)


def prefix_blocks(kv_cache: str) -> str:
    """Sorted set of the prompt block hashes a replica's engine process (``<replica id>.<pid>``)
    was sent, scored by when (unix seconds): what its KV cache most likely holds. Written and read
    by serving.gateway.prefixes; capped at ROUTING_PREFIX_BLOCKS_PER_REPLICA, expires
    ROUTING_PREFIX_TTL_SECONDS after its last write."""
    return namespaced("prefix", kv_cache)


def routing_invalidation_channel() -> str:
    """Pub/sub: deployments, weights or prices changed; every gateway reloads its routing table."""
    return namespaced("routing", "invalidate")


def model_arrivals_channel() -> str:
    """Pub/sub: the name of a model whose interactive requests in flight went from none to one
    (published by the ledger's admission); batch workers stop that model's lines at once."""
    return namespaced("model", "arrivals")


def key_invalidation_channel() -> str:
    """Pub/sub: the SHA-256 of an API key whose grants changed; every gateway drops it."""
    return namespaced("keys", "invalidate")
