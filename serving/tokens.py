"""Prompt token counts in the gateway, with the model's own tokenizer and chat template.

Used to refuse requests that cannot fit the context before anything is dispatched, and
to reserve tokens up front. Loaded once per version from the artifact (tokenizers, no
torch); when an artifact has no tokenizer.json the count falls back to a safe estimate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class PromptCounter:
    def __init__(self, directory: str | None) -> None:
        self.tokenizer: Tokenizer | None = None
        self.template: Any = None
        self.special: dict[str, str] = {}
        if directory is None:
            return
        root = Path(directory)
        if (root / "tokenizer.json").exists():
            self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
            # Some tokenizer files pad or truncate to a fixed length; we want true counts.
            self.tokenizer.no_padding()
            self.tokenizer.no_truncation()
        template_text = None
        if (root / "chat_template.jinja").exists():
            template_text = (root / "chat_template.jinja").read_text()
        if (root / "tokenizer_config.json").exists():
            config = json.loads((root / "tokenizer_config.json").read_text())
            template_text = template_text or config.get("chat_template")
            self.special = {k: v for k, v in config.items() if k in ("bos_token", "eos_token") and isinstance(v, str)}
        if template_text:
            # The same environment transformers renders chat templates in.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now(UTC).strftime(fmt)
            self.template = env.from_string(template_text)

    def count_text(self, text: str, *, special_tokens: bool = True) -> int:
        """Tokens in ``text``; ``special_tokens`` adds what the engine adds to a raw prompt."""
        if self.tokenizer is None:
            # ~4 bytes a token for English; round up so a reservation is never short.
            return len(text.encode()) // 3 + 1
        return len(self.tokenizer.encode(text, add_special_tokens=special_tokens).ids)

    def count_chat(self, messages: Sequence[dict[str, Any]]) -> int:
        if self.template is None:
            return sum(self.count_text(_content_text(m.get("content"))) + 4 for m in messages) + 2
        rendered = self.template.render(messages=list(messages), add_generation_prompt=True, **self.special)
        # The template already wrote the special tokens into the text.
        return self.count_text(rendered, special_tokens=False)

    def count_prompt(self, prompt: str | list[str] | list[int] | list[list[int]]) -> int:
        """Tokens in any of OpenAI's prompt forms: text, texts, token ids, lists of token ids."""
        if isinstance(prompt, str):
            return self.count_text(prompt)
        total = 0
        for item in prompt:
            if isinstance(item, str):
                total += self.count_text(item)
            elif isinstance(item, list):
                total += len(item)
            else:
                total += 1  # a single token id
        return total


def _raise(message: str) -> None:
    raise ValueError(message)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


@lru_cache(maxsize=32)
def prompt_counter(directory: str | None) -> PromptCounter:
    return PromptCounter(directory)
