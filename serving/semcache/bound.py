"""Each entry's own bound on paraphrase hits (the idea of vCache, ICLR 2026, with the
verifier's score in place of the raw similarity).

The paraphrase tier serves an entry's answer to a prompt worded otherwise when the learned
verifier (``serving.semcache.paraphrase``) scores the pair at least the entry's threshold.
No single threshold suits every entry: one answer ("the capital of France is Paris")
serves every rewording of its question, another ("how long to boil an egg": soft or hard?)
is wrong for a rewording the verifier scores just as high. So each entry carries evidence,
``(score, agreed)`` observations of what happened when its answer was compared with the
engine's own answer to a prompt that scored ``score`` against it:

- a would-be hit explored (``SEMANTIC_CACHE_PARAPHRASE_EXPLORE_RATE`` of them, or every one
  while the model's tier is outside its budget): the engine answers instead, and the two
  answers are compared;
- a near miss (a score below the entry's threshold, within ``NEAR_MISS_BAND`` of it): the
  engine answers anyway, so the comparison costs nothing and is how a threshold comes down;
- a served answer reported wrong (``feedback``): a disagreement at the score it was served at.

The entry's estimated wrong-hit rate were it served at threshold ``t`` pools the offline
calibration with its own evidence, as a Beta posterior mean whose prior is the calibration
curve weighted like ``prior_weight`` observations:

    wrong(t) = (prior_weight · curve(t) + disagreed at scores ≥ t) / (prior_weight + observed at scores ≥ t)

and its threshold is the lowest ``t`` of the grid whose ``wrong(t)`` is within the model's
bound δ (a threshold serves every score above it, which is what ``wrong(t)`` estimates; the
calibration curve falls as ``t`` rises, being a share of traps scored at least ``t``), and
never below the entry's lowest agreement. One disagreement at a score ``s`` moves the threshold
above ``s`` at once (20 pseudo-observations at δ ≤ 2 % cannot absorb it); agreements below
the calibrated threshold lower it only after enough of them. The statistical guarantee is
the model's, not each entry's (a handful of observations bounds nothing): the tier's
wrong-hit estimate from every audit, with its interval, gates the whole tier
(``budget``), and the entry's threshold spends that budget where the evidence says it is safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# What a stored entry keeps: its last observations (the oldest dropped first).
MAX_EVIDENCE = 16
# Thresholds tried, in score units (the verifier's probability).
GRID = tuple(round(0.30 + 0.01 * i, 2) for i in range(70))  # 0.30 … 0.99
# Above every score: the entry serves no paraphrase.
CLOSED = 1.01
# A near miss is compared (for free: the engine answers it anyway) when its score is at most
# this far below the entry's threshold.
NEAR_MISS_BAND = 0.25


@dataclass(frozen=True)
class Observation:
    score: float
    agreed: bool


def evidence_of(raw: object) -> tuple[Observation, ...]:
    """The stored JSON (``[[score, agreed], …]``) as observations; anything malformed is skipped."""
    found: list[Observation] = []
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, list | tuple) and len(item) == 2:
                try:
                    found.append(Observation(float(item[0]), bool(int(item[1]))))
                except (TypeError, ValueError):
                    continue
    return tuple(found[-MAX_EVIDENCE:])


def wrong_rate(
    t: float, evidence: Sequence[Observation], *, curve: Callable[[float], float], prior_weight: float
) -> float:
    """The entry's estimated share of wrong hits were it served from threshold ``t``."""
    seen = [o for o in evidence if o.score >= t]
    disagreed = sum(1 for o in seen if not o.agreed)
    return (prior_weight * curve(t) + disagreed) / (prior_weight + len(seen))


def threshold(
    evidence: Sequence[Observation], *, curve: Callable[[float], float], delta: float, prior_weight: float
) -> float:
    """The lowest score from which the entry serves paraphrases within ``delta`` (``CLOSED``
    when no threshold of the grid does). It goes below the calibrated threshold only as far
    as the entry's own agreements reach: evidence at 0.7 says nothing of scores under 0.7."""
    calibrated = next((t for t in GRID if wrong_rate(t, (), curve=curve, prior_weight=prior_weight) <= delta), CLOSED)
    agreed = [o.score for o in evidence if o.agreed]
    floor = min(calibrated, min(agreed, default=calibrated))
    for t in GRID:
        if t >= floor - 1e-9 and wrong_rate(t, evidence, curve=curve, prior_weight=prior_weight) <= delta:
            return t
    return CLOSED


def curve_from(points: Sequence[tuple[float, float]]) -> Callable[[float], float]:
    """A step curve through calibration points ``(threshold, wrong share)``: the value at the
    highest calibrated threshold not above ``t`` (conservative between points); 1 below the
    lowest one."""
    ordered = sorted(points)

    def at(t: float) -> float:
        value = 1.0
        for point, wrong in ordered:
            if point <= t + 1e-9:
                value = wrong
            else:
                break
        return value

    return at
