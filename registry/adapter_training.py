"""Training the bundled LoRA adapter at import: a few deterministic steps of peft on CPU.

The data ships in the repository (``registry/data/adapters/*.jsonl``: question/answer pairs);
the base is the bundled chat model's stored artifact. The pairs are laid out with the base's
own chat template (its default system prompt included, as the engine will send it), and the
loss is taken on the answers only, so the adapter learns how to answer, not the questions.

Kept small enough for the test session's import on 2 cores: the 24 pairs go through in
mini-batches of 8 for 12 steps (4 passes over the data); a full batch of 24 cost about three
times as much per step here, for no better adapter. Heavy imports stay inside the functions:
the web tier never needs torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data" / "adapters"
SEED = 0
RANK = 8
ALPHA = 16
TARGET_MODULES = ("q_proj", "v_proj")
LEARNING_RATE = 1e-2
STEPS = 12
BATCH = 8
THREADS = 2


def read_pairs(path: Path) -> list[dict[str, str]]:
    pairs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not pairs or not all(isinstance(p.get("question"), str) and isinstance(p.get("answer"), str) for p in pairs):
        raise ValueError(f"{path}: every line is an object with a question and an answer")
    return pairs


def train_lora(*, base_dir: Path, data: Path, out_dir: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    """Train a LoRA adapter of the causal LM in ``base_dir`` on ``data``; save it to ``out_dir``
    (``adapter_config.json`` and ``adapter_model.safetensors``); return what the version's config
    records: the final training loss (the trained adapter's, over every pair) and the run."""
    import time

    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        torch.manual_seed(SEED)
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        pairs = read_pairs(data)
        rows: list[tuple[list[int], int]] = []  # (prompt + answer tokens, answer length)
        for pair in pairs:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": pair["question"]}], tokenize=False, add_generation_prompt=True
            )
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            answer_ids = tokenizer(pair["answer"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
            rows.append((prompt_ids + answer_ids, len(answer_ids)))
        model = get_peft_model(
            model,
            LoraConfig(
                r=RANK, lora_alpha=ALPHA, target_modules=list(TARGET_MODULES), lora_dropout=0.0, task_type="CAUSAL_LM"
            ),
        )
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
        model.train()
        order = torch.randperm(len(rows)).tolist()
        for step in range(STEPS):
            start = (step * BATCH) % len(rows)
            if start == 0 and step:
                order = torch.randperm(len(rows)).tolist()
            batch = [rows[i] for i in order[start : start + BATCH]]
            loss = _answer_loss(model, batch, tokenizer.pad_token_id, torch, F)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            progress(f"  step {step + 1}/{STEPS}: loss {loss.item():.3f}")
        model.eval()
        with torch.no_grad():  # the trained adapter's loss on every pair (forward only: cheap)
            losses = [
                (
                    _answer_loss(model, rows[i : i + BATCH], tokenizer.pad_token_id, torch, F).item(),
                    len(rows[i : i + BATCH]),
                )
                for i in range(0, len(rows), BATCH)
            ]
        final_loss = sum(loss * count for loss, count in losses) / len(rows)
        model.save_pretrained(str(out_dir), safe_serialization=True)
        (out_dir / "README.md").unlink(missing_ok=True)
    finally:
        torch.set_num_threads(threads)
    return {
        "train_loss": round(final_loss, 4),
        "train_steps": STEPS,
        "train_pairs": len(rows),
        "train_batch": BATCH,
        "learning_rate": LEARNING_RATE,
        "train_seconds": round(time.monotonic() - started, 1),
    }


def _answer_loss(model: Any, batch: list[tuple[list[int], int]], pad_id: int, torch: Any, F: Any) -> Any:
    """Cross-entropy on the answers' tokens only. Padded on the left with positions counted from
    each row's first real token, so the answers sit at the end and only their logits are made
    (the vocabulary's projection is a fifth of the model's work)."""
    width = max(len(ids) for ids, _ in batch)
    keep = max(answer for _, answer in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in batch])
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    targets = torch.full((len(batch), keep), -100)
    for row, (ids, answer) in enumerate(batch):
        targets[row, keep - answer :] = torch.tensor(ids[-answer:])
    # The logit at position i predicts token i + 1: the last keep + 1 positions predict the last keep tokens.
    logits = model(
        input_ids=input_ids, attention_mask=attention, position_ids=positions, logits_to_keep=keep + 1
    ).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
