"""Simulated canaries judged by the controller's own rules: the targets of issue 8 as a
repeatable run (docs/performance.md, "Canary controller: simulation").

No database and no engines: requests arrive as a Poisson process, each goes to the canary
with the current step's probability, and its answer (status, latency, TTFT, tokens, finish
reason) is drawn from the arm's profile. At every interval boundary the current step's
window goes through ``rollout.canary_stats.judge`` and ``rollout.canary.plan_move``, the
functions ``rollout.canary.canary_decide`` applies to the usage records; a promoted step
starts a new window, as there. The database plumbing around them (locks, weights, audit)
is tested in tests/registry/test_canary.py.

    .venv/bin/python bench/canary_simulation.py                 # 20 seeded runs per scenario
    .venv/bin/python bench/canary_simulation.py --runs 200 --rps 2

Targets: an A/A canary (the same version twice) is never rolled back in 20 runs; a canary
failing 10 % of requests, or 3x slower, is rolled back within two intervals of the canary
arm reaching the minimum sample; a good one is promoted (``auto_promote``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

from rollout.canary import plan_move  # noqa: E402
from rollout.canary_stats import ALPHA, RequestSample, judge  # noqa: E402

MAX_TOKENS = 256


@dataclass(frozen=True)
class Profile:
    """How a version answers. Times in ms; tokens log-normal, cut at ``MAX_TOKENS`` (finish
    reason ``length``); 70 % of requests streamed (only those have a TTFT)."""

    fail: float = 0.005
    ttft_median: float = 150.0
    tpot_median: float = 25.0
    tokens_median: float = 120.0
    empty: float = 0.005

    def sample(self, rng: random.Random) -> RequestSample:
        if rng.random() < self.fail:
            return RequestSample(status_code=rng.choice([500, 502, 504]), latency_ms=rng.randint(5, 200))
        ttft = rng.lognormvariate(math.log(self.ttft_median), 0.5)
        streamed = rng.random() < 0.7
        if rng.random() < self.empty:
            return RequestSample(200, int(ttft), int(ttft) if streamed else None, 0, "stop")
        tokens = min(MAX_TOKENS, max(1, int(rng.lognormvariate(math.log(self.tokens_median), 0.6))))
        tpot = rng.lognormvariate(math.log(self.tpot_median), 0.3)
        latency = ttft + tpot * (tokens - 1)
        finish = "length" if tokens == MAX_TOKENS else "stop"
        return RequestSample(200, int(latency), int(ttft) if streamed else None, tokens, finish)


BASE = Profile()
# name: (the canary's profile, the outcome expected, whether it is one of issue 8's targets)
SCENARIOS: dict[str, tuple[Profile, str, bool]] = {
    "A/A (the same version twice)": (BASE, "promoted", True),
    "good (10 % faster)": (replace(BASE, ttft_median=135.0, tpot_median=22.5), "promoted", True),
    "fails 10 % of requests": (replace(BASE, fail=0.10), "rolled_back", True),
    "3x slower": (replace(BASE, ttft_median=450.0, tpot_median=75.0), "rolled_back", True),
    # Beyond the targets: regressions that only the LLM signals see.
    "TTFT 2x, the rest unchanged": (replace(BASE, ttft_median=300.0), "rolled_back", False),
    "10 % empty answers": (replace(BASE, empty=0.10), "rolled_back", False),
    "answers 2x longer (more cut)": (replace(BASE, tokens_median=240.0), "rolled_back", False),
}


@dataclass
class Outcome:
    status: str
    decisions: list[str]
    ended_after_s: float | None
    minimum_at_s: float | None  # when the canary arm's window (of the last step) first held min_samples
    rollback_delay_intervals: float | None
    fired: list[str]


def simulate(
    canary_profile: Profile,
    *,
    seed: int,
    rps: float,
    interval: float,
    steps: list[int],
    min_samples: int,
    horizon: int,
    alpha: float = ALPHA,
) -> Outcome:
    rng = random.Random(seed)
    step, status = 0, "running"
    step_start, boundary, now = 0.0, interval, 0.0
    base_window: list[RequestSample] = []
    canary_window: list[RequestSample] = []
    decisions: list[str] = []
    minimum_at: float | None = None
    while status == "running" and boundary <= horizon * interval:
        now += rng.expovariate(rps)
        while now >= boundary and status == "running":
            judgement = judge(base_window, canary_window, min_samples=min_samples, alpha=alpha)
            move = plan_move(steps=steps, current_step=step, auto_promote=True, judged=judgement.verdict)
            decisions.append(str(move.verdict))
            if move.status is not None:
                status = str(move.status)
            if move.next_step is not None:
                step, step_start = move.next_step, boundary
                base_window, canary_window, minimum_at = [], [], None
            fired = [name for name, test in judgement.figures["tests"].items() if test["worse"]]
            if status != "running":
                delay = (boundary - minimum_at) / interval if status == "rolled_back" and minimum_at else None
                return Outcome(status, decisions, boundary, minimum_at, delay, fired)
            boundary = step_start + (math.floor((boundary - step_start) / interval) + 1) * interval
        if steps[step] / 100 > rng.random():
            canary_window.append(canary_profile.sample(rng))
            if minimum_at is None and len(canary_window) >= min_samples:
                minimum_at = now
        else:
            base_window.append(BASE.sample(rng))
    return Outcome(status, decisions, None, minimum_at, None, [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="seeded runs per scenario")
    parser.add_argument("--rps", type=float, default=40.0, help="the model's requests per second, both arms")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds per judgement")
    parser.add_argument("--steps", default="5,25,50,100")
    parser.add_argument("--min-samples", type=int, default=50)
    parser.add_argument("--alpha", type=float, default=ALPHA, help="family-wise, per judgement (Holm)")
    parser.add_argument("--horizon", type=int, default=40, help="intervals before a run is called undecided")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    steps = [int(step) for step in args.steps.split(",")]
    started = time.perf_counter()
    print(
        f"{args.runs} runs per scenario, {args.rps:g} req/s, interval {args.interval:g} s, steps {steps}, "
        f"min {args.min_samples} per arm, alpha {args.alpha} (Holm)\n"
    )
    header = (
        "| scenario | expected | promoted | rolled back | undecided | rollback after min sample, "
        "max (intervals) | decided after, median | signals that fired |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|---|")
    report: dict[str, Any] = {
        "args": vars(args),
        "python": platform.python_version(),
        "scenarios": {},
    }
    all_met = True
    for name, (profile, expected, target) in SCENARIOS.items():
        outcomes = [
            simulate(
                profile,
                seed=1000 * index + len(name),
                rps=args.rps,
                interval=args.interval,
                steps=steps,
                min_samples=args.min_samples,
                horizon=args.horizon,
                alpha=args.alpha,
            )
            for index in range(args.runs)
        ]
        counts = Counter(outcome.status for outcome in outcomes)
        delays = [o.rollback_delay_intervals for o in outcomes if o.rollback_delay_intervals is not None]
        ended = [o.ended_after_s for o in outcomes if o.ended_after_s is not None]
        fired = Counter(signal for o in outcomes for signal in o.fired)
        met = counts[expected] == args.runs and (expected != "rolled_back" or max(delays, default=0) <= 2)
        all_met &= met or not target
        label = name if target else f"{name} (beyond the targets)"
        print(
            f"| {label} | {expected.replace('_', ' ')} | {counts['promoted']} | {counts['rolled_back']} | "
            f"{counts['running']} | {f'{max(delays):.2f}' if delays else '-'} | "
            f"{f'{statistics.median(ended) / args.interval:.1f} intervals' if ended else '-'} | "
            f"{', '.join(f'{s} {n}' for s, n in fired.most_common()) or '-'} |"
        )
        report["scenarios"][name] = {
            "profile": asdict(profile),
            "expected": expected,
            "target": target,
            "met": met,
            "outcomes": [asdict(o) for o in outcomes],
        }
    elapsed = time.perf_counter() - started
    print(f"\n{'every target met' if all_met else 'a target was missed'} ({elapsed:.1f} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"canary_simulation-{stamp}.json"
    path.write_text(json.dumps({**report, "all_met": all_met, "seconds": elapsed}, indent=1))
    print(f"written to {path}")
    if not all_met:
        sys.exit(1)


if __name__ == "__main__":
    main()
