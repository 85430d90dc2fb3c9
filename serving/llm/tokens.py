"""Prompt token counts in the gateway, with the model's own tokenizer and chat template.

Used to refuse requests that cannot fit the context before anything is dispatched, and
to reserve tokens up front. Loaded once per version from the artifact (tokenizers, no
torch). Messages are normalised the way vLLM normalises them before rendering (text
parts joined with newlines, null content as empty text, tool-call arguments decoded), so
the count matches the engine's. When a count cannot be exact (no tokenizer, parts that
are not text, a template that refuses the conversation) it is an estimate marked
``exact=False``: the caller then reserves an upper bound and settles to the engine's
reported usage, and leaves the context check to the engine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

# Per message, what a chat template adds around the content, at most (role markers, separators).
_TEMPLATE_OVERHEAD_PER_MESSAGE = 16
# The rendered prompt's pieces between special tokens whose ids each counter keeps (a system
# prompt, the earlier turns of a conversation: sent again with every turn), by their total
# characters, each piece counted SEGMENT_CACHE_ENTRY_CHARS more for what keeping it costs (so
# many tiny pieces cannot grow it past its bound); a piece longer than SEGMENT_CACHE_LONGEST is
# always tokenised afresh.
SEGMENT_CACHE_CHARS = 1_000_000
SEGMENT_CACHE_ENTRY_CHARS = 64
SEGMENT_CACHE_LONGEST = 32_000


@dataclass(frozen=True)
class PromptCount:
    tokens: int
    exact: bool
    # The prompt's token ids as the engine will see them, where the count was exact and made them
    # (prefix-aware routing hashes their leading blocks: serving.gateway.prefixes).
    ids: list[int] | None = field(default=None, compare=False, repr=False)


class PromptCounter:
    def __init__(self, directory: str | None) -> None:
        self.tokenizer: Tokenizer | None = None
        self.template: Any = None
        self.special: dict[str, str] = {}
        self.knows_developer_role = False
        self.max_token_chars: int | None = None  # the most bytes a token spans (byte-level BPE only)
        self.segments: _SegmentIds | None = None  # rendered prompts tokenised piece by piece
        if directory is None:
            return
        root = Path(directory)
        if (root / "tokenizer.json").exists():
            self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
            # Some tokenizer files pad or truncate to a fixed length; we want true counts.
            self.tokenizer.no_padding()
            self.tokenizer.no_truncation()
            spec = json.loads(self.tokenizer.to_str())  # read by both: parsed once
            self.max_token_chars = _longest_byte_level_token(self.tokenizer, spec)
            self.segments = _SegmentIds.of(self.tokenizer, spec)
        template_text = None
        if (root / "chat_template.jinja").exists():
            template_text = (root / "chat_template.jinja").read_text()
        if (root / "tokenizer_config.json").exists():
            config = json.loads((root / "tokenizer_config.json").read_text())
            template_text = template_text or config.get("chat_template")
            self.special = {k: v for k, v in config.items() if k in ("bos_token", "eos_token") and isinstance(v, str)}
        if template_text:
            self.knows_developer_role = '"developer"' in template_text or "'developer'" in template_text
            # The same environment transformers renders chat templates in.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now(UTC).strftime(fmt)
            env.filters["tojson"] = _tojson
            self.template = env.from_string(template_text)

    @property
    def exact(self) -> bool:
        """Whether ``count_text``/``count_prompt`` are the engine's counts (else upper bounds)."""
        return self.tokenizer is not None

    def at_least(self, chars: int) -> int:
        """A cheap lower bound on the tokens of text of ``chars`` characters (0 when none is known).

        With a byte-level BPE tokenizer that normalises nothing, every byte of the text is in
        exactly one token and no token spans more than ``max_token_chars`` bytes, and a
        character is at least a byte: so at least chars / max_token_chars tokens. Lets a
        prompt that cannot fit the context be refused without tokenising it.
        """
        if not self.max_token_chars:
            return 0
        return -(-chars // self.max_token_chars)

    def count_text(self, text: str, *, special_tokens: bool = True) -> int:
        """Tokens in ``text``; ``special_tokens`` adds what the engine adds to a raw prompt.

        Without the model's tokenizer: its UTF-8 length plus a few special tokens, an upper
        bound for the byte-level tokenizers these engines use (a token is at least a byte).
        """
        if self.tokenizer is None:
            return len(text.encode()) + 4
        return len(self.encode(text, special_tokens=special_tokens))

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (call only with a tokenizer: ``exact``)."""
        assert self.tokenizer is not None
        # The batch "fast" form skips computing offsets we never read (~15-40 % less CPU).
        ids: list[int] = self.tokenizer.encode_batch_fast([text], add_special_tokens=special_tokens)[0].ids
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat prompt's ids (no special tokens added: the template wrote them), the
        same as ``encode(text, special_tokens=False)``. Where the tokenizer allows
        (``_SegmentIds.of``), the pieces between special tokens are looked up first: a
        conversation's system prompt and earlier turns come back with every turn, and only
        what is new is tokenised."""
        if self.segments is None:
            return self.encode(text, special_tokens=False)
        return self.segments.encode(text)

    def count_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, str]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> PromptCount:
        """The rendered conversation's tokens, exactly when possible, else an upper bound."""
        normalised, text_only = _normalise(messages)
        if not self.knows_developer_role and any(m.get("role") == "developer" for m in normalised):
            normalised = _developer_as_system(normalised)
        if self.template is not None and self.tokenizer is not None and text_only:
            try:
                rendered = self.template.render(
                    messages=normalised,
                    tools=list(tools) if tools else None,
                    documents=list(documents) if documents else None,
                    add_generation_prompt=add_generation_prompt and not continue_final_message,
                    **{**(template_kwargs or {}), **self.special},
                )
            except Exception as exc:  # noqa: BLE001 - any template failure: the engine will answer for it
                logger.debug("chat template refused the conversation (%s); estimating", exc)
            else:
                # The template already wrote the special tokens into the text.
                ids = self.encode_rendered(rendered)
                return PromptCount(len(ids), exact=True, ids=ids)
        return PromptCount(self._upper_bound(messages, tools, documents), exact=False)

    def _upper_bound(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        documents: Sequence[dict[str, str]] | None,
    ) -> int:
        # Everything the template could print (a superset of its text), plus its markers.
        parts: list[str] = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [json.dumps(p, ensure_ascii=False) for p in content]
            # The role is one of the markers; anything else (name, tool calls …) may be printed.
            rest = {k: v for k, v in message.items() if k not in ("role", "content") and v is not None}
            if rest:
                parts.append(json.dumps(rest, ensure_ascii=False))
        if tools:
            parts.append(json.dumps(list(tools), ensure_ascii=False))
        if documents:
            parts.append(json.dumps(list(documents), ensure_ascii=False))
        return self.count_text("\n".join(parts)) + _TEMPLATE_OVERHEAD_PER_MESSAGE * (len(messages) + 1)

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


class _SegmentIds:
    """A tokenizer's ids for the pieces of a text between its added tokens, kept by recent use.

    Exact by construction: the tokenizer itself splits a text at its added tokens first
    (leftmost, longest) and tokenises each piece on its own, so the ids of a text are the
    pieces' ids with each added token's id between them. That holds as written only where no
    normaliser runs, every added token is matched in the raw text (not ``normalized``), and
    none takes the whitespace beside it (``lstrip``, ``rstrip``) or needs word boundaries
    (``single_word``): ``of`` gives None for any other tokenizer. Thread-safe: prompts are
    also counted in worker threads.
    """

    def __init__(self, tokenizer: Tokenizer, added: dict[str, int]) -> None:
        self.tokenizer = tokenizer
        self.added = added
        # Longest first: at one position the longest added token wins, as in the tokenizer.
        self.split = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
        self._ids: OrderedDict[str, array[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer: Tokenizer, spec: dict[str, Any]) -> _SegmentIds | None:
        """For ``tokenizer`` (``spec``: its JSON form), or None where pieces would not match."""
        added = spec.get("added_tokens") or []
        # encode_special_tokens: special tokens in the text are tokenised as text, not split at.
        if spec.get("normalizer") or not added or getattr(tokenizer, "encode_special_tokens", False):
            return None
        # A "normalized" added token is looked for in a second pass, inside the pieces the others
        # left: one pass over all of them could split differently.
        if any(
            t.get("lstrip") or t.get("rstrip") or t.get("single_word") or t.get("normalized") or not t.get("content")
            for t in added
        ):
            return None
        return cls(tokenizer, {t["content"]: int(t["id"]) for t in added})

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        for match in self.split.finditer(text):
            if match.start() > start:
                ids += self._piece(text[start : match.start()])
            ids.append(self.added[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._piece(text[start:])
        return ids

    def _piece(self, piece: str) -> array[int] | list[int]:
        with self._lock:
            known = self._ids.get(piece)
            if known is not None:
                self._ids.move_to_end(piece)
                return known
        ids: list[int] = self.tokenizer.encode_batch_fast([piece], add_special_tokens=False)[0].ids
        if len(piece) > SEGMENT_CACHE_LONGEST:
            return ids
        with self._lock:
            if piece not in self._ids:
                self._ids[piece] = array("i", ids)
                self._chars += len(piece) + SEGMENT_CACHE_ENTRY_CHARS
                while self._chars > SEGMENT_CACHE_CHARS:
                    self._chars -= len(self._ids.popitem(last=False)[0]) + SEGMENT_CACHE_ENTRY_CHARS
        return ids


def _longest_byte_level_token(tokenizer: Tokenizer, spec: dict[str, Any]) -> int | None:
    """The most bytes one token covers, for a byte-level BPE tokenizer without a normaliser
    (each byte is one character of its vocabulary); None for any other kind, whose tokens
    may swallow text (WordPiece's [UNK], a normaliser dropping whitespace). ``spec``: the
    tokenizer's JSON form."""
    pre = spec.get("pre_tokenizer") or {}
    kinds = {pre.get("type")} | {p.get("type") for p in pre.get("pretokenizers") or () if isinstance(p, dict)}
    if (spec.get("model") or {}).get("type") != "BPE" or "ByteLevel" not in kinds or spec.get("normalizer"):
        return None
    return max((len(token) for token in tokenizer.get_vocab(with_added_tokens=True)), default=None) or None


def _raise(message: str) -> None:
    raise ValueError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False)


def _normalise(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """Messages as vLLM hands them to the template; False when some content is not text."""
    out: list[dict[str, Any]] = []
    text_only = True
    for message in messages:
        item = dict(message)
        content = item.get("content")
        if content is None:
            item["content"] = ""
        elif isinstance(content, list):
            texts = [str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            text_only = text_only and len(texts) == len(content)
            item["content"] = "\n".join(texts)
        calls = []
        for call in item.get("tool_calls") or ():
            call = dict(call) if isinstance(call, dict) else call  # never touch the body we forward
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                function = call["function"] = dict(function)
                with contextlib.suppress(ValueError):  # vLLM keeps a malformed argument string as it is
                    function["arguments"] = json.loads(function["arguments"] or "{}")
            calls.append(call)
        if calls:
            item["tool_calls"] = calls
        out.append(item)
    return out, text_only


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM does for a template without a developer role: developer messages become
    system messages, and system messages not at the start are merged into one first."""
    converted = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    for message in converted:
        if message["role"] == "system":
            message.pop("tools", None)
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    merged = {
        "role": "system",
        "content": "\n\n".join(converted[i]["content"] for i in systems if converted[i]["content"]),
    }
    return [merged, *(m for m in converted if m["role"] != "system")]


@lru_cache(maxsize=32)
def prompt_counter(directory: str | None) -> PromptCounter:
    return PromptCounter(directory)
