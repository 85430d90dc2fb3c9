"""Mergeable latency histograms (core.sketch): any grouping's percentile within the stated
relative error of the exact one, in Python and with the buckets PostgreSQL computes."""

from __future__ import annotations

import math
import random

import pytest
from django.db import connection

from core import sketch


def disc(values: list[float], q: float) -> float:
    """PostgreSQL's percentile_disc: the value at rank ceil(q * n)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)), 1) - 1]


def histogram(values: list[float]) -> sketch.Histogram:
    out: sketch.Histogram = {}
    for value in values:
        bucket = sketch.bucket_of(value)
        out[bucket] = out.get(bucket, 0) + 1
    return out


QUANTILES = (0.0, 0.25, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)


@pytest.mark.parametrize("seed", range(5))
def test_merged_groups_give_the_exact_percentile_within_the_error(seed):
    rng = random.Random(seed)
    # Groups as different as an LLM's answers and a classifier's: merged, their p99 is the
    # slow group's tail, nothing like a mean of the groups' p99s.
    groups = [
        [max(1, int(rng.lognormvariate(mu, sigma))) for _ in range(rng.randint(50, 3000))]
        for mu, sigma in ((7.5, 0.6), (4.0, 0.3), (2.0, 1.0), (5.5, 0.2))
    ]
    merged = sketch.merge(histogram(g) for g in groups)
    everything = [v for g in groups for v in g]
    assert sketch.count(merged) == len(everything)
    for q in QUANTILES:
        exact = disc(everything, q)
        assert sketch.quantile(merged, q) == pytest.approx(exact, rel=sketch.RELATIVE_ERROR), q


def test_every_value_is_within_the_error_of_its_bucket():
    for value in [1, 2, 3, 7, 10, 99, 100, 101, 999, 1_000, 1_812, 65_535, 600_000, 3_600_000]:
        assert sketch.value_of(sketch.bucket_of(value)) == pytest.approx(value, rel=sketch.RELATIVE_ERROR)


def test_zero_empty_and_bad_quantiles():
    assert sketch.quantile({}, 0.5) is None
    assert sketch.bucket_of(0) == sketch.ZERO
    assert sketch.quantile(histogram([0, 0, 0, 5]), 0.5) == 0.0
    assert sketch.parse({"3": 2, "7": 0}) == {3: 2}
    with pytest.raises(ValueError, match="between 0 and 1"):
        sketch.quantile({1: 1}, 1.5)


def test_postgresql_computes_the_same_buckets(db):
    values = [0, 1, 2, 3, 10, 57, 100, 1_812, 12_345, 600_000, *range(4, 2_000, 37)]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT v, {sketch.bucket_sql('v')} FROM unnest(%s::int[]) AS t(v)",
            [values],
        )
        from_sql = dict(cursor.fetchall())
    assert from_sql == {v: sketch.bucket_of(v) for v in values}
