"""The error budget: each model's cache serves a wording tier only while its measured
wrong-hit rate stays inside what the operator accepts.

The operator states the share of wrong semantic hits they accept (``CachePolicy.wrong_hit_budget``,
else ``SEMANTIC_CACHE_WRONG_HIT_BUDGET``). For each model and wording tier (``verify.TIERS``:
same, typo, reordered, and the paraphrase tier) the cache keeps four counters in Redis:

- ``served``: semantic hits served at that tier;
- ``audits``: would-be hits answered by the engine instead, their answers compared with the
  cached one (``audit``); ``disagreed``: audits whose answers differed;
- ``reported``: served answers a customer or an admin reported wrong (``feedback``).

The wrong-hit rate's estimate is (prior wrong + disagreed + reported) / (prior n + audits +
reported) with its Wilson 95 % interval, where the prior is the offline held-out measurement
(``SEMANTIC_CACHE_PRIOR_SERVED`` hits served of which ``SEMANTIC_CACHE_PRIOR_WRONG`` were
wrong: bench/semantic_cache_sources.py). A tier is served only while the interval's upper end
is within the budget (conservative: unsure is a miss); otherwise every would-be hit of the
tier is an audit, which costs nothing more (the engine answers it anyway) and is how a
closed tier earns its way back. While a tier is open, ``SEMANTIC_CACHE_AUDIT_RATE`` of its
would-be hits are audited too, so the estimate follows the model's real traffic (the
vCache idea, per tier rather than per entry; feedback tightens single entries).

Two answers agree when their text is the same once whitespace and case are ignored, or
when their embeddings' cosine reaches ``SEMANTIC_CACHE_AUDIT_AGREEMENT`` and they carry the
same numbers. An answer worded differently but right counts as a disagreement at worst: the
estimate errs on the side of serving less.
"""

from __future__ import annotations

import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from redis.exceptions import RedisError

from core import keys
from core.redis import async_redis, sync_redis
from core.stats import wilson

logger = logging.getLogger(__name__)

EXACT = "exact"  # the same text: always served, counted for the figures and feedback
PARAPHRASE = "paraphrase"  # worded otherwise, judged by the learned verifier (serving.semcache.paraphrase)
COUNTERS = ("served", "audits", "disagreed", "reported")
SERVE = "serve"
AUDIT = "audit"
# How long a gateway trusts the counters it read (the decision's input, not money).
RECORDS_TTL_SECONDS = 5.0
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


@dataclass(frozen=True)
class TierRecord:
    served: int = 0
    audits: int = 0
    disagreed: int = 0
    reported: int = 0


@dataclass(frozen=True)
class Prior:
    """The offline held-out measurement, as pseudo-counts."""

    n: float
    wrong: float

    @classmethod
    def from_settings(cls, tier: str = "") -> Prior:
        """The word tiers' prior, or the paraphrase tier's own (another verifier, measured apart)."""
        if tier == PARAPHRASE:
            return cls(n=float(settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_SERVED),
                       wrong=float(settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_WRONG))  # fmt: skip
        return cls(n=float(settings.SEMANTIC_CACHE_PRIOR_SERVED), wrong=float(settings.SEMANTIC_CACHE_PRIOR_WRONG))


@dataclass(frozen=True)
class Estimate:
    rate: float
    low: float
    high: float
    observed: int  # audits and reports behind it (the prior aside)


def estimate(record: TierRecord, prior: Prior) -> Estimate:
    wrong = prior.wrong + record.disagreed + record.reported
    n = prior.n + record.audits + record.reported
    low, high = wilson(wrong, n)
    return Estimate(rate=wrong / n if n else 0.0, low=low, high=high, observed=record.audits + record.reported)


def decide(record: TierRecord, *, budget: float, prior: Prior, audit_rate: float, draw: float | None = None) -> str:
    """SERVE or AUDIT one would-be hit of a tier (``draw``: a uniform number, for tests)."""
    if estimate(record, prior).high > budget:
        return AUDIT
    return AUDIT if (random.random() if draw is None else draw) < audit_rate else SERVE


# --- Counters in Redis -----------------------------------------------------------------------


def _key(model: str) -> str:
    return keys.namespaced("semcache", "quality", model)


def _records(raw: dict[Any, Any]) -> dict[str, TierRecord]:
    values: dict[str, dict[str, int]] = {}
    for field, value in raw.items():
        tier, _, counter = (field.decode() if isinstance(field, bytes) else str(field)).partition(":")
        if counter in COUNTERS:
            values.setdefault(tier, {})[counter] = int(value)
    return {tier: TierRecord(**counts) for tier, counts in values.items()}


_read: dict[str, tuple[float, dict[str, TierRecord]]] = {}


async def records_of(model: str) -> dict[str, TierRecord]:
    """The model's counters by tier, as this process last read them (at most a few seconds old)."""
    now = time.monotonic()
    held = _read.get(model)
    if held is not None and now - held[0] < RECORDS_TTL_SECONDS:
        return held[1]
    records = _records(await async_redis().hgetall(_key(model)))
    _read[model] = (now, records)
    return records


async def decide_for(model: str, tier: str, *, budget: float) -> str:
    """The decision for a would-be hit of ``model`` at ``tier``; Redis unreachable: an audit
    (the cannot-say answer is a miss)."""
    try:
        records = await records_of(model)
    except RedisError:
        logger.warning("cache quality counters unreadable: a would-be hit of %s goes to the engine", model)
        return AUDIT
    return decide(
        records.get(tier, TierRecord()),
        budget=budget,
        prior=Prior.from_settings(tier),
        audit_rate=settings.SEMANTIC_CACHE_AUDIT_RATE,
    )


async def count(model: str, tier: str, counter: str, n: int = 1) -> None:
    assert counter in COUNTERS
    await async_redis().hincrby(_key(model), f"{tier}:{counter}", n)
    _read.pop(model, None)


def count_sync(model: str, tier: str, counter: str, n: int = 1) -> None:
    assert counter in COUNTERS
    sync_redis().hincrby(_key(model), f"{tier}:{counter}", n)


def records_sync(model: str) -> dict[str, TierRecord]:
    return _records(sync_redis().hgetall(_key(model)))


def reset(model: str) -> None:
    """Forget a model's counters (a new version behaves anew: console, after a swap)."""
    sync_redis().delete(_key(model))
    _read.pop(model, None)


# --- Audits ---------------------------------------------------------------------------------


def _plain(text: str) -> str:
    return " ".join(text.lower().split())


def numbers_in(text: str) -> list[str]:
    return sorted(n.replace(",", "") for n in _NUMBER.findall(text))


def agree_by_text(cached: str, live: str) -> bool | None:
    """True when the texts are the same (whitespace, case aside); False when their numbers
    differ; None when only their meaning can tell."""
    if _plain(cached) == _plain(live):
        return True
    if numbers_in(cached) != numbers_in(live):
        return False
    return None


async def agree(cached: str, live: str) -> bool:
    """Whether a cached answer says what the engine's own answer says: the same text, else the
    same numbers and embeddings at least SEMANTIC_CACHE_AUDIT_AGREEMENT alike."""
    from serving.semcache.embed import cosine, embed_texts

    agreed = agree_by_text(cached, live)
    if agreed is None:
        first, second = await embed_texts([cached, live])
        agreed = cosine(first, second) >= settings.SEMANTIC_CACHE_AUDIT_AGREEMENT
    return agreed


async def audit(*, model: str, tier: str, cached: str, live: str) -> bool:
    """Compare a would-be hit's cached answer with the engine's own; count it. True: agreed."""
    agreed = await agree(cached, live)
    await count(model, tier, "audits")
    if not agreed:
        await count(model, tier, "disagreed")
    logger.info("cache audit of %s at tier %s: %s", model, tier, "agreed" if agreed else "disagreed")
    return agreed


# --- What the console and the portal show ------------------------------------------------------


@dataclass(frozen=True)
class TierQuality:
    tier: str
    record: TierRecord
    estimate: Estimate
    serving: bool  # inside the budget: would-be hits are served (audited at the audit rate)


@dataclass(frozen=True)
class ModelQuality:
    """One model's semantic hits and its wrong-hit estimate, against its budget."""

    model: str
    budget: float
    exact_served: int
    tiers: tuple[TierQuality, ...]
    estimate: Estimate  # over every tier together
    feedback: int = 0  # reports recorded (CacheFeedback), set by the selector
    paraphrases: bool = True  # the model's rules let the paraphrase tier serve, set by the selector

    @property
    def semantic_served(self) -> int:
        return sum(t.record.served for t in self.tiers)

    @property
    def audits(self) -> int:
        return sum(t.record.audits for t in self.tiers)

    @property
    def disagreed(self) -> int:
        return sum(t.record.disagreed for t in self.tiers)

    @property
    def closed_tiers(self) -> list[str]:
        return [t.tier for t in self.tiers if not t.serving]


def quality_of(model: str, *, wrong_hit_budget: float, records: dict[str, TierRecord] | None = None) -> ModelQuality:
    from serving.semcache.verify import TIERS

    records = records_sync(model) if records is None else records
    prior = Prior.from_settings()
    tiers = []
    for tier in (*TIERS, PARAPHRASE):
        record = records.get(tier, TierRecord())
        found = estimate(record, Prior.from_settings(tier))
        tiers.append(TierQuality(tier=tier, record=record, estimate=found, serving=found.high <= wrong_hit_budget))
    together = TierRecord(
        served=sum(t.record.served for t in tiers), audits=sum(t.record.audits for t in tiers),
        disagreed=sum(t.record.disagreed for t in tiers), reported=sum(t.record.reported for t in tiers),
    )  # fmt: skip
    return ModelQuality(
        model=model,
        budget=wrong_hit_budget,
        exact_served=records.get(EXACT, TierRecord()).served,
        tiers=tuple(tiers),
        estimate=estimate(together, prior),
    )
