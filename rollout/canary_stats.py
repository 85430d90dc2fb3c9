"""The statistics that judge a canary against its base: pure functions over the requests each served.

The question at each interval boundary is one-sided: *is the canary worse than the base?*
Each judgement of a step's window ends in one of three verdicts: ``rollback`` (worse),
``hold`` (too few requests, or it looks worse but the evidence is not there yet: the
window keeps growing) and ``pass`` (the controller moves it a step on).

Signals, per arm (only requests an engine answered: cache hits say nothing about a version):

- **error rate**: server errors (status >= 500) over the requests the server decided. A 4xx
  is the client's (a prompt too long, a bad argument): it counts, as a request without a
  server error. A 499 is a client that left before the answer ended (``billing.outcomes``):
  it says nothing of how the version would have done, so it counts nowhere, in neither the
  numerator nor the denominator, nor towards ``min_samples``; the figures show it apart.
- **latency**, **TTFT**, **TPOT**: over the answered requests (2xx). TTFT exists for
  streamed answers only. TPOT (time per output token) = (latency - TTFT) / (completion
  tokens - 1), for streamed answers of two tokens or more; non-streamed answers are left
  out of TPOT, since latency / tokens would fold the prefill into it and make two arms
  with different mixes of streamed and non-streamed requests incomparable.
- **empty answers** (a 2xx with 0 completion tokens) and **truncated answers**
  (finish_reason ``length``: cut by ``max_tokens``), over the answered requests. They catch
  the LLM regressions that status codes and latency miss (a broken chat template answers
  at once, emptily, with a 200; a version that rambles hits ``max_tokens``).

Tests: proportions (errors, empty, truncated) by Fisher's exact test, one-sided, at every
size. The two-proportion z-test was the first choice for large counts, but its normal tail
is anti-conservative exactly where decisions are made (p ~ 1e-4 with a few dozen canary
requests: measured at 2.4 times the nominal rate for a 10 % share at 51 vs 1,150), and
Fisher's test costs under a millisecond even at 10^5 requests. Distributions (latency,
TTFT, TPOT) by the one-sided Mann-Whitney U test (canary stochastically greater), which
assumes nothing about their skewed, multi-modal shape. A metric with fewer than
``MIN_METRIC_SAMPLES`` values in either arm is skipped (and listed as such).

"Worse" needs both of, so that an A/A canary (the same version twice) is not rolled back:

1. **Significance with the family's false-alarm rate controlled**: the tests of one
   judgement are one family; Holm's step-down correction keeps the chance that any of them
   fires by chance at most ``ALPHA`` = 0.001 per judgement. A canary is judged a few times
   per step (holds judge the growing window again), so the rate per canary is a few tenths
   of a percent: in 1,000 simulated A/A canaries, 2 to 3 were rolled back
   (bench/canary_simulation.py, docs/performance.md).
2. **A minimum effect**, because with enough requests a trivial difference is significant:
   a proportion at least ``MIN_PROPORTION_INCREASE`` (2 points) above the base's and at
   least ``MIN_PROPORTION_RATIO`` (2x) the base's (a 10 % truncation share must reach 20 %);
   a median at least ``MIN_MEDIAN_RATIO`` (1.25x) the base's (a base median under 1 ms
   counts as 1 ms).

A test past its minimum effect whose own p-value is at most ``SUSPICIOUS_P`` (0.05) but
which is not significant after Holm makes the judgement ``hold``: without that rule a
canary failing 10 % of its requests that happened to show one or two failures in its first
50 requests was promoted (65 in 1,000 at 5 requests/s), then promoted again at steps
whose balanced arms had no more power. Holding costs a good canary an interval now and
then; it never promotes on thin evidence that the canary looks worse.

Absolute criteria from the canary's request apply to the canary's point estimates, as
Flagger's thresholds do: ``max_p99_latency_ms``, ``max_ttft_p99_ms`` and
``min_success_rate`` (success = not a server error, of the requests the server decided). No
verdict at all before each arm has ``min_samples`` requests that its clients did not cancel.
Percentiles are nearest-rank (as PostgreSQL's ``percentile_disc`` in the rollups).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
from scipy import stats

from billing import outcomes

ALPHA = 0.001
# A test past the minimum effect whose own (unadjusted) p-value is at most this, but that is not
# significant after Holm, is suspicious: the step holds and its window grows instead of promoting.
SUSPICIOUS_P = 0.05
MIN_PROPORTION_INCREASE = 0.02
MIN_PROPORTION_RATIO = 2.0
MIN_MEDIAN_RATIO = 1.25
MIN_METRIC_SAMPLES = 20
# Below this, a base median is treated as this (ms): ratios of near-zero times are noise.
MEDIAN_FLOOR_MS = 1.0

# The absolute criteria a canary may set, and what each bounds.
CRITERIA: dict[str, str] = {
    "max_p99_latency_ms": "the canary's p99 latency (ms) at most this",
    "max_ttft_p99_ms": "the canary's p99 time to first token (ms) at most this",
    "min_success_rate": "the canary's share of requests without a server error at least this (0 to 1)",
}

Verdict = Literal["pass", "hold", "rollback"]


@dataclass(frozen=True)
class RequestSample:
    """What one request tells about the version that served it (from its usage record)."""

    status_code: int
    latency_ms: int
    ttft_ms: int | None = None
    completion_tokens: int = 0
    finish_reason: str = ""

    @property
    def server_error(self) -> bool:
        return self.status_code >= 500

    @property
    def cancelled(self) -> bool:
        """Its client went away first: no evidence either way (``billing.outcomes``)."""
        return outcomes.cancelled_by_client(self.status_code)

    @property
    def answered(self) -> bool:
        return outcomes.answered(self.status_code)

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first, for a streamed answer of two tokens or more."""
        if self.ttft_ms is None or self.completion_tokens < 2 or not self.answered:
            return None
        return max(0, self.latency_ms - self.ttft_ms) / (self.completion_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0 to 1) of ``values``; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])


def _finite(value: float | None) -> float | None:
    """JSON (and PostgreSQL's jsonb) has no NaN or infinity."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


@dataclass(frozen=True)
class Comparison:
    """One test: canary worse than base? ``p_adjusted`` and ``worse`` are set by the family."""

    name: str
    test: str
    statistic: float | None
    p_value: float
    effect: float | None
    min_effect: float
    n_base: int
    n_canary: int
    base_value: float | None = None
    canary_value: float | None = None
    p_adjusted: float | None = None
    significant: bool = False
    worse: bool = False
    suspicious: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "test": self.test,
            "statistic": _finite(self.statistic),
            "p_value": _finite(self.p_value),
            "p_adjusted": _finite(self.p_adjusted),
            "effect": _finite(self.effect),
            "min_effect": self.min_effect,
            "base": _finite(self.base_value),
            "canary": _finite(self.canary_value),
            "n_base": self.n_base,
            "n_canary": self.n_canary,
            "significant": self.significant,
            "worse": self.worse,
            "suspicious": self.suspicious,
        }


def proportion_test(
    name: str, *, base_hits: int, base_n: int, canary_hits: int, canary_n: int, min_increase: float
) -> Comparison:
    """One-sided: is the canary's proportion greater than the base's? Effect: the difference."""
    if base_n == 0 or canary_n == 0:
        raise ValueError("both arms need at least one observation")
    base_rate, canary_rate = base_hits / base_n, canary_hits / canary_n
    table = np.array([[canary_hits, canary_n - canary_hits], [base_hits, base_n - base_hits]])
    odds, p_value = stats.fisher_exact(table, alternative="greater")
    statistic, test = float(odds), "fisher_exact"
    return Comparison(
        name=name,
        test=test,
        statistic=statistic,
        p_value=min(1.0, max(0.0, float(p_value))),
        effect=canary_rate - base_rate,
        min_effect=max(min_increase, base_rate * (MIN_PROPORTION_RATIO - 1)),
        n_base=base_n,
        n_canary=canary_n,
        base_value=base_rate,
        canary_value=canary_rate,
    )


def distribution_test(name: str, *, base: Sequence[float], canary: Sequence[float], min_ratio: float) -> Comparison:
    """One-sided Mann-Whitney U: are the canary's values stochastically greater than the base's?
    Effect: the ratio of the medians (the base's floored at ``MEDIAN_FLOOR_MS``)."""
    if not base or not canary:
        raise ValueError("both arms need at least one observation")
    result = stats.mannwhitneyu(canary, base, alternative="greater")
    base_median = percentile(base, 0.5) or 0.0
    canary_median = percentile(canary, 0.5) or 0.0
    return Comparison(
        name=name,
        test="mann_whitney_u",
        statistic=float(result.statistic),
        p_value=float(result.pvalue) if math.isfinite(result.pvalue) else 1.0,
        effect=canary_median / max(base_median, MEDIAN_FLOOR_MS),
        min_effect=min_ratio,
        n_base=len(base),
        n_canary=len(canary),
        base_value=base_median,
        canary_value=canary_median,
    )


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order (reject where ≤ alpha)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(p_values[index])))
        adjusted[index] = running
    return adjusted


@dataclass(frozen=True)
class ArmSummary:
    """The figures of one arm: counts, rates and percentiles. Its clients' cancels are set
    apart (``judged`` leaves them out): they count in no rate, test or minimum sample."""

    samples: Sequence[RequestSample]
    judged: list[RequestSample] = field(init=False)
    answered: list[RequestSample] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "judged", [s for s in self.samples if not s.cancelled])
        object.__setattr__(self, "answered", [s for s in self.judged if s.answered])

    @property
    def n(self) -> int:
        """The requests the server decided: every sample but its clients' cancels."""
        return len(self.judged)

    @property
    def cancelled(self) -> int:
        return len(self.samples) - len(self.judged)

    @property
    def errors(self) -> int:
        return sum(1 for s in self.judged if s.server_error)

    def latencies(self) -> list[float]:
        return [float(s.latency_ms) for s in self.answered]

    def ttfts(self) -> list[float]:
        return [float(s.ttft_ms) for s in self.answered if s.ttft_ms is not None]

    def tpots(self) -> list[float]:
        return [t for s in self.answered if (t := s.tpot_ms) is not None]

    def empty(self) -> int:
        return sum(1 for s in self.answered if s.completion_tokens == 0)

    def truncated(self) -> int:
        return sum(1 for s in self.answered if s.finish_reason == "length")

    def as_json(self) -> dict[str, Any]:
        def spread(values: list[float]) -> dict[str, Any]:
            return {"n": len(values), "p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}

        answered = len(self.answered)
        return {
            "n": self.n,
            "cancelled": self.cancelled,  # by their clients: not in n
            "errors": self.errors,
            "error_rate": self.errors / self.n if self.n else None,
            "answered": answered,
            "latency_ms": spread(self.latencies()),
            "ttft_ms": spread(self.ttfts()),
            "tpot_ms": spread(self.tpots()),
            "empty": self.empty(),
            "empty_share": self.empty() / answered if answered else None,
            "truncated": self.truncated(),
            "truncated_share": self.truncated() / answered if answered else None,
        }


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reasons: list[str]
    figures: dict[str, Any]


def compare(base: ArmSummary, canary: ArmSummary, *, alpha: float = ALPHA) -> tuple[list[Comparison], list[str]]:
    """Every test that the data allow, Holm-adjusted as one family; and the tests skipped, with why."""
    tests: list[Comparison] = []
    skipped: list[str] = []
    if base.n and canary.n:
        tests.append(
            proportion_test(
                "error_rate",
                base_hits=base.errors,
                base_n=base.n,
                canary_hits=canary.errors,
                canary_n=canary.n,
                min_increase=MIN_PROPORTION_INCREASE,
            )
        )
    series: list[tuple[str, Callable[[ArmSummary], list[float]]]] = [
        ("latency_ms", ArmSummary.latencies),
        ("ttft_ms", ArmSummary.ttfts),
        ("tpot_ms", ArmSummary.tpots),
    ]
    for name, values in series:
        base_values, canary_values = values(base), values(canary)
        if min(len(base_values), len(canary_values)) < MIN_METRIC_SAMPLES:
            skipped.append(name)
            continue
        tests.append(distribution_test(name, base=base_values, canary=canary_values, min_ratio=MIN_MEDIAN_RATIO))
    base_answered, canary_answered = len(base.answered), len(canary.answered)
    for name, count in (("empty_share", ArmSummary.empty), ("truncated_share", ArmSummary.truncated)):
        if min(base_answered, canary_answered) < MIN_METRIC_SAMPLES:
            skipped.append(name)
            continue
        tests.append(
            proportion_test(
                name,
                base_hits=count(base),
                base_n=base_answered,
                canary_hits=count(canary),
                canary_n=canary_answered,
                min_increase=MIN_PROPORTION_INCREASE,
            )
        )
    adjusted = holm([t.p_value for t in tests])
    judged = []
    for test, p_adjusted in zip(tests, adjusted, strict=True):
        significant = bool(p_adjusted <= alpha)
        large = bool(test.effect is not None and test.effect >= test.min_effect)
        worse = significant and large
        suspicious = not worse and large and bool(test.p_value <= SUSPICIOUS_P)
        judged.append(replace(test, p_adjusted=p_adjusted, significant=significant, worse=worse, suspicious=suspicious))
    return judged, skipped


def _absolute_failures(canary: ArmSummary, criteria: Mapping[str, float]) -> list[str]:
    failures = []
    max_p99 = criteria.get("max_p99_latency_ms")
    p99 = percentile(canary.latencies(), 0.99)
    if max_p99 is not None and p99 is not None and p99 > max_p99:
        failures.append(f"canary p99 latency {p99:.0f} ms > max_p99_latency_ms {max_p99:g}")
    max_ttft = criteria.get("max_ttft_p99_ms")
    ttft_p99 = percentile(canary.ttfts(), 0.99)
    if max_ttft is not None and ttft_p99 is not None and ttft_p99 > max_ttft:
        failures.append(f"canary p99 TTFT {ttft_p99:.0f} ms > max_ttft_p99_ms {max_ttft:g}")
    min_success = criteria.get("min_success_rate")
    if min_success is not None and canary.n:
        success = 1 - canary.errors / canary.n
        if success < min_success:
            failures.append(f"canary success rate {success:.3f} < min_success_rate {min_success:g}")
    return failures


def _describe(test: Comparison) -> str:
    if test.test == "mann_whitney_u":
        effect = f"median {test.canary_value:.1f} vs {test.base_value:.1f} ms (x{test.effect:.2f})"
    else:
        effect = f"{(test.canary_value or 0) * 100:.1f} % vs {(test.base_value or 0) * 100:.1f} %"
    verdict = "worse" if test.worse else "looks worse"
    return f"canary {test.name} {verdict}: {effect}, {test.test} p={test.p_value:.2g} (Holm {test.p_adjusted:.2g})"


def judge(
    base: Sequence[RequestSample],
    canary: Sequence[RequestSample],
    *,
    min_samples: int,
    criteria: Mapping[str, float] | None = None,
    alpha: float = ALPHA,
) -> Judgement:
    """Judge one window: ``hold`` until each arm has ``min_samples`` requests, then ``rollback``
    when a test finds the canary worse (significant after Holm and past the minimum effect)
    or an absolute criterion fails, else ``pass``. The figures say why, in JSON."""
    base_arm, canary_arm = ArmSummary(base), ArmSummary(canary)
    figures: dict[str, Any] = {
        "arms": {"base": base_arm.as_json(), "canary": canary_arm.as_json()},
        "min_samples": min_samples,
        "alpha": alpha,
        "correction": "holm",
        "tests": {},
        "skipped": [],
    }
    short = [
        f"{name} has {arm.n} of {min_samples} requests"
        for name, arm in (("base", base_arm), ("canary", canary_arm))
        if arm.n < min_samples
    ]
    if short:
        return Judgement("hold", [f"waiting for the minimum sample: {', '.join(short)}"], figures)
    tests, skipped = compare(base_arm, canary_arm, alpha=alpha)
    figures["tests"] = {test.name: test.as_json() for test in tests}
    figures["skipped"] = skipped
    reasons = [_describe(test) for test in tests if test.worse]
    reasons += _absolute_failures(canary_arm, criteria or {})
    if reasons:
        return Judgement("rollback", reasons, figures)
    doubts = [_describe(test) for test in tests if test.suspicious]
    if doubts:
        return Judgement("hold", [f"not yet significant, holding for more requests: {d}" for d in doubts], figures)
    return Judgement(
        "pass", [f"no test finds the canary worse ({len(tests)} tests, n={canary_arm.n}/{base_arm.n})"], figures
    )
