"""The semantic cache's error budget under noise (issue 22): a simulation.

Would-be hits of three wording tiers whose verifier is wrong at different, drifting rates
("same" 0.1 %; "typo" 0.3 % for the first third, then 6 %; "reordered" 4 %) go through
``serving.semcache.budget.decide`` with a 1 % budget and the settings' prior (585 hits, 1
wrong). Audits are judged by a noisy judge (misses 10 % of wrong answers, flags 0.2 % of right
ones as wrong); 5 % of the wrong answers served are reported. Without the budget the same
stream is all served. tests/serving/test_semcache_budget.py runs this and fails when the
budget does not hold.

    .venv/bin/python bench/semantic_cache_budget.py [--n 60000] [--seeds 22 1 2 3]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

from serving.semcache.budget import SERVE, Prior, TierRecord, decide  # noqa: E402 - after the path

PRIOR = Prior(n=585, wrong=1)
BUDGET = 0.01


def simulate(*, use_budget: bool, seed: int = 22, n: int = 60_000) -> dict[str, tuple[int, int, int]]:
    """Per tier: (would-be hits, served, served wrongly)."""
    rng = random.Random(seed)
    truth = {"same": lambda i: 0.001, "typo": lambda i: 0.003 if i < n // 3 else 0.06, "reordered": lambda i: 0.04}
    records = {tier: TierRecord() for tier in truth}
    out = {tier: [0, 0, 0] for tier in truth}
    for i in range(n):
        tier = rng.choice(list(truth))
        wrong = rng.random() < truth[tier](i)
        out[tier][0] += 1
        record = records[tier]
        draw = rng.random()
        verdict = decide(record, budget=BUDGET, prior=PRIOR, audit_rate=0.02, draw=draw) if use_budget else SERVE
        if verdict == SERVE:
            out[tier][1] += 1
            out[tier][2] += wrong
            if wrong and rng.random() < 0.05:
                record = replace(record, reported=record.reported + 1)
        else:
            flagged = rng.random() < (0.9 if wrong else 0.002)
            record = replace(record, audits=record.audits + 1, disagreed=record.disagreed + flagged)
        records[tier] = record
    return {tier: (a, b, c) for tier, (a, b, c) in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=60_000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[22, 1, 2, 3])
    args = parser.parse_args()
    import django

    django.setup()
    print("| seed | budget | served | served wrongly | same served | typo served | reordered served |")
    print("|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        for use in (False, True):
            result = simulate(use_budget=use, seed=seed, n=args.n)
            served, wrong = sum(r[1] for r in result.values()), sum(r[2] for r in result.values())
            shares = [f"{result[t][1] / result[t][0]:.1%}" for t in ("same", "typo", "reordered")]
            print(
                f"| {seed} | {'1 %' if use else 'none'} | {served:,} | {wrong / served:.2%} | "
                + " | ".join(shares)
                + " |"
            )


if __name__ == "__main__":
    main()
