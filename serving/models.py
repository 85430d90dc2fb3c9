"""The data plane's tables, each defined in the part of ``serving`` that owns it.

Django finds an app's models through this module; code inside ``serving`` imports a model from its
own part (``serving.gateway.models``: the per-model rules the routing snapshot carries;
``serving.semcache.models``: cache entries and feedback; ``serving.shadow.models``: shadow records;
``serving.batches.models``: files, batches, their lines and webhook deliveries).
"""

from serving.batches.models import Batch, BatchLine, StoredFile, WebhookDelivery
from serving.gateway.models import CachePolicy, ShadowPolicy
from serving.semcache.models import EMBEDDING_DIMENSIONS, SCOPE_BUCKETS, CacheEntry, CacheFeedback
from serving.shadow.models import ShadowRecord

__all__ = [
    "EMBEDDING_DIMENSIONS",
    "SCOPE_BUCKETS",
    "Batch",
    "BatchLine",
    "CacheEntry",
    "CacheFeedback",
    "CachePolicy",
    "ShadowPolicy",
    "ShadowRecord",
    "StoredFile",
    "WebhookDelivery",
]
