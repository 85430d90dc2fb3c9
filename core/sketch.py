"""Mergeable latency distributions: log-bucketed histograms with a stated relative error.

Percentiles do not add up: the p99 over several keys, models or hours is not any mean of
their p99s (a mean of per-key p99s once showed 146 ms where the only LLM's p99 was 1,812 ms).
A histogram does add up: counts per bucket, summed. The buckets are DDSketch's (Masson et
al., VLDB 2019): bucket ``i`` holds the values in (gamma^(i-1), gamma^i] with
gamma = (1 + a) / (1 - a), and a quantile read from a bucket is its representative
2 gamma^i / (gamma + 1), within a relative error ``a`` of every value in it. So any
grouping's percentile is the rank-exact bucket's value within ``RELATIVE_ERROR`` (1 %);
values of 0 (and below) get bucket 0 (``ZERO``).

A histogram is a ``{bucket: count}`` dict (JSON objects in the rollups: string keys), sparse:
latencies from 1 ms to 10 min span ~670 buckets, a bucket of traffic uses a few dozen. The
SQL that builds them (``bucket_sql``) and the Python that reads them (``bucket_of``,
``quantile``) share the constants here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

RELATIVE_ERROR = 0.01
GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
_LN_GAMMA = math.log(GAMMA)
ZERO = 0  # the bucket of values ≤ 0 (a bucket index from ``bucket_of`` is ≥ 1 for values ≥ 1)
# Values below 1 (ms) would get indexes ≤ 0: latencies are whole milliseconds, so the smallest
# positive value is 1 and its bucket is 0 + 1 = 1 after the offset below.
_OFFSET = 1

Histogram = dict[int, int]


def bucket_of(value: float) -> int:
    """The bucket of a value (ms)."""
    if value <= 0:
        return ZERO
    return max(math.ceil(math.log(value) / _LN_GAMMA), 0) + _OFFSET


def bucket_sql(column: str) -> str:
    """``bucket_of`` in SQL, for a column of whole milliseconds (the same buckets)."""
    return (
        f"CASE WHEN {column} <= 0 THEN {ZERO} "
        f"ELSE greatest(ceil(ln({column}::float8) / {_LN_GAMMA!r})::int, 0) + {_OFFSET} END"
    )


def value_of(bucket: int) -> float:
    """A bucket's representative value: within ``RELATIVE_ERROR`` of every value in it."""
    if bucket == ZERO:
        return 0.0
    upper = GAMMA ** (bucket - _OFFSET)
    return 2 * upper / (GAMMA + 1)


def parse(raw: Mapping[str, int] | Mapping[int, int] | None) -> Histogram:
    """A histogram from its JSON form (string keys), or an empty one."""
    return {int(k): int(v) for k, v in (raw or {}).items() if int(v)}


def merge(histograms: Iterable[Mapping[int, int]], into: Histogram | None = None) -> Histogram:
    """The sum of several histograms (bucket by bucket)."""
    out: Histogram = {} if into is None else into
    for histogram in histograms:
        for bucket, count in histogram.items():
            out[bucket] = out.get(bucket, 0) + count
    return out


def count(histogram: Mapping[int, int]) -> int:
    return sum(histogram.values())


def quantile(histogram: Mapping[int, int], q: float) -> float | None:
    """The ``q`` quantile (0..1) as ``percentile_disc`` would pick it (the smallest value with
    at least q of the values at or below it), within ``RELATIVE_ERROR``; None when empty."""
    if not 0 <= q <= 1:
        raise ValueError("a quantile is between 0 and 1")
    total = count(histogram)
    if total == 0:
        return None
    rank = max(math.ceil(q * total), 1)
    seen = 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= rank:
            return value_of(bucket)
    return value_of(max(histogram))  # unreachable: the counts add up to total
