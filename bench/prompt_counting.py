"""What counting a chat prompt costs the gateway (serving.llm.tokens), turn by turn.

The gateway counts every chat prompt with the model's own tokenizer and chat template before it
is dispatched (the context check, the tokens reserved, the prefix router's blocks). A
conversation sends its system prompt and every earlier turn again with each new turn; the
counter keeps the token ids of the pieces between special tokens (``_SegmentIds``), so only
what is new is tokenised. This measures, with the bundled SmolLM2's tokenizer and template:

- ``whole``: the rendered prompt tokenised whole, every time (the counter without the pieces);
- ``pieces``: ``PromptCounter.count_chat`` as the gateway runs it, its pieces kept from the
  conversations' earlier turns, each new question unseen;

for ``--conversations`` conversations sharing ``--system-prompts`` system prompts of
``--system-words`` words, grown ``--turns`` turns, the conversations interleaved (each round
adds one turn to every conversation, as concurrent users do). CPU µs per count (process time,
one thread), by turn, and the two agree on every count (else it stops).

    .venv/bin/python bench/prompt_counting.py
    .venv/bin/python bench/prompt_counting.py --system-words 400 --turns 6 --conversations 64

Writes bench/results/prompt_counting-<time>.json; docs/performance.md has a run's figures.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mock_suite import ROOT, report_start, write_report

WORDS = [
    "the", "platform", "serves", "models", "to", "customers", "through", "an", "API", "and", "a", "console",
    "where", "team", "deploys", "versions", "watches", "canaries", "reads", "invoices", "every", "request",
    "is", "metered", "once",
]  # fmt: skip


def artifact() -> Path:
    found = sorted((ROOT / "var" / "artifacts" / "smollm2-135m-instruct").glob("*/tokenizer.json"))
    if not found:
        raise SystemExit("no SmolLM2 artifact under var/artifacts: run `make bootstrap` (or `make run`) first")
    return found[-1].parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--question-words", type=int, default=30)
    parser.add_argument("--answer-words", type=int, default=60)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    report = report_start(args)
    sys.path.insert(0, str(ROOT))
    from serving.llm.tokens import PromptCounter

    folder = str(artifact())
    draw = random.Random(38)

    def text(words: int) -> str:
        return " ".join(draw.choice(WORDS) for _ in range(words)).capitalize() + "."

    systems = [text(args.system_words) for _ in range(args.system_prompts)]
    conversations: list[list[dict[str, str]]] = [
        [{"role": "system", "content": systems[i % len(systems)]}] for i in range(args.conversations)
    ]
    pieces = PromptCounter(folder)
    whole = PromptCounter(folder)
    whole.segments = None  # the rendered prompt tokenised whole
    assert pieces.segments is not None, "this tokenizer cannot be counted in pieces"
    by_turn: list[dict[str, Any]] = []
    for turn in range(args.turns):
        spent = {"whole": 0.0, "pieces": 0.0}
        tokens = []
        for conversation in conversations:
            conversation.append({"role": "user", "content": f"Question {turn}: {text(args.question_words)}"})
            counts = {}
            for name, counter in (("whole", whole), ("pieces", pieces)):
                started = time.process_time()
                counts[name] = counter.count_chat(conversation)
                spent[name] += time.process_time() - started
            if counts["whole"].ids != counts["pieces"].ids:
                raise SystemExit(f"turn {turn}: the counts differ")
            tokens.append(counts["pieces"].tokens)
            conversation.append({"role": "assistant", "content": text(args.answer_words)})
        n = len(conversations)
        by_turn.append({
            "turn": turn + 1, "prompt_tokens_median": statistics.median(tokens),
            "whole_us": round(spent["whole"] / n * 1e6, 1), "pieces_us": round(spent["pieces"] / n * 1e6, 1),
            "ratio": round(spent["whole"] / spent["pieces"], 2),
        })  # fmt: skip
    report["result"] = {"by_turn": by_turn, "pieces_kept_chars": pieces.segments._chars}
    out = write_report("prompt_counting", report)
    print("| turn | prompt tokens (median) | whole µs | pieces µs | whole / pieces |")
    print("|---|---|---|---|---|")
    for row in by_turn:
        print(f"| {row['turn']} | {row['prompt_tokens_median']:.0f} | {row['whole_us']} | {row['pieces_us']} | "
              f"{row['ratio']} |")  # fmt: skip
    print(f"written to {out}")


if __name__ == "__main__":
    main()
