"""Signals between processes that every app may send: "the routing table changed"."""

from __future__ import annotations

import logging

from django.db import transaction

from core import keys
from core.redis import sync_redis

logger = logging.getLogger(__name__)


def publish_routing_change_now(reason: str) -> None:
    """Tell every gateway to reload its routing table now. Best effort: gateways also reload
    every ``ROUTING_REFRESH_SECONDS``, so a Redis that is away only delays the change."""
    try:
        sync_redis().publish(keys.routing_invalidation_channel(), reason)
    except Exception:
        logger.debug("could not announce a routing change (%s)", reason, exc_info=True)


def publish_routing_change(reason: str) -> None:
    """``publish_routing_change_now`` once the current transaction commits (at once outside one)."""
    transaction.on_commit(lambda: publish_routing_change_now(reason))
