"""Feedback on served cache answers: "this answer was wrong for my question".

Every answer served from the cache is noted for ``SEMANTIC_CACHE_FEEDBACK_WINDOW_SECONDS``
under its request id (the ``x-request-id`` header, or the body's ``id``): which entry, at
which wording tier, in which scope and organisation. A report (``POST /v1/cache/feedback``
with the organisation's own key, or a platform admin in the console) then, at once:

- tightens the entry and its neighbours (entries of the same scope at least
  ``SEMANTIC_CACHE_FEEDBACK_NEIGHBOUR_SIMILARITY`` similar to it): served at a typo,
  reordered or paraphrase tier, they serve only the same words from now on (strictness 1:
  no paraphrase either), and a paraphrase hit's score is recorded as a disagreement in the
  entry's evidence (``bound``); served for the
  same words, only the same text (strictness 2); served for the same text, the entry is
  withdrawn (its answer is wrong for its own question) and its neighbours keep to the same
  text;
- counts the report against the tier in the model's error budget (``budget``), which closes
  the tier when the wrong-hit estimate's upper end leaves the budget;
- is recorded (``CacheFeedback``), once per request: a second report of the same request
  changes nothing and returns the first.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass

import orjson
from django.conf import settings
from django.db import connection, transaction

from core import keys
from core.redis import async_redis, sync_redis
from serving.semcache import budget, store
from serving.semcache.models import CacheEntry, CacheFeedback
from serving.semcache.verify import SAME

logger = logging.getLogger(__name__)

# CacheEntry.strictness: what an entry (and its neighbours) still serves after a report.
SAME_WORDS_ONLY = 1
SAME_TEXT_ONLY = 2
_ID = re.compile(r"(?:[a-z]+-)?([0-9a-f]{32})|([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")
TABLE = CacheEntry._meta.db_table


class NotServedFromCache(Exception):
    """No answer from the cache is on record for this request (in this organisation)."""


@dataclass(frozen=True)
class Served:
    organization_id: int
    model: str
    model_version: str
    entry_id: int | None
    wording: str
    scope: str
    score: float | None = None  # a paraphrase hit's verifier score (becomes the entry's evidence)


def parse_request_id(text: str) -> uuid.UUID | None:
    """A request id as the platform shows it: the x-request-id UUID or a body id
    (``chatcmpl-<32 hex digits>``); None when it is neither."""
    match = _ID.fullmatch(text.strip().lower())
    if match is None:
        return None
    return uuid.UUID(match[1] or match[2])


def _key(request_id: uuid.UUID) -> str:
    return keys.namespaced("semcache", "served", request_id.hex)


async def note_served(request_id: uuid.UUID, served: Served) -> None:
    """Remember what a request was served, and count it in the model's budget."""
    record = orjson.dumps(served.__dict__)
    await async_redis().set(_key(request_id), record, ex=settings.SEMANTIC_CACHE_FEEDBACK_WINDOW_SECONDS)
    await budget.count(served.model, served.wording, "served")


def served_to(request_id: uuid.UUID) -> Served | None:
    raw = sync_redis().get(_key(request_id))
    return Served(**orjson.loads(raw)) if raw else None


def report(request_id: uuid.UUID, *, organization_id: int | None, reported_by: str, reason: str = "") -> CacheFeedback:
    """Record that the answer served to ``request_id`` was wrong; ``organization_id`` None is
    a platform admin (any organisation). Raises NotServedFromCache."""
    served = served_to(request_id)
    if served is None or (organization_id is not None and served.organization_id != organization_id):
        raise NotServedFromCache(request_id.hex)
    existing = CacheFeedback.objects.filter(request_id=request_id.hex).first()
    if existing is not None:
        return existing
    with transaction.atomic():
        tightened = _tighten(served) if served.entry_id is not None else 0
        if served.entry_id is not None and served.score is not None:
            # A disagreement at the score it was served at: the entry's own threshold rises above it.
            store.observe_sync(entry_id=served.entry_id, score=served.score, agreed=False)
        feedback = CacheFeedback.objects.create(
            request_id=request_id.hex,
            organization_id=served.organization_id,
            model=served.model,
            model_version=served.model_version,
            entry_id=served.entry_id,  # kept after the entry is purged (no constraint)
            wording=served.wording,
            reason=reason[:500],
            reported_by=reported_by[:255],
            tightened=tightened,
        )
    budget.count_sync(served.model, served.wording, "reported")
    logger.info("cache answer of %s (entry %s, %s) reported wrong by %s; %d entries tightened",
                served.model, served.entry_id, served.wording, reported_by, tightened)  # fmt: skip
    return feedback


def _tighten(served: Served) -> int:
    """Raise the strictness of the served entry and its neighbours; the count of entries."""
    level = SAME_WORDS_ONLY if served.wording not in (budget.EXACT, SAME) else SAME_TEXT_ONLY
    params = {
        "id": served.entry_id,
        "scope": served.scope,
        "level": level,
        "similarity": settings.SEMANTIC_CACHE_FEEDBACK_NEIGHBOUR_SIMILARITY,
    }
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {TABLE} SET strictness = GREATEST(strictness, %(level)s)"
            f" WHERE scope = %(scope)s AND expires_at > now() AND (id = %(id)s OR 1 - (embedding <=>"
            f" (SELECT embedding FROM {TABLE} WHERE id = %(id)s)) >= %(similarity)s)",
            params,
        )
        tightened = int(cursor.rowcount)
        if served.wording == budget.EXACT:
            # Wrong for its own question: withdrawn (expired now, purged with the others).
            cursor.execute(f"UPDATE {TABLE} SET expires_at = now() WHERE id = %(id)s", params)
    return max(tightened, 0)
