"""A request's prompts against its model's context, before anything is charged: counted with the
model's own tokenizer and chat template (exactly where they allow; a large body in a thread, off
the event loop), and refused when they cannot fit, by a cheap lower bound first."""

from __future__ import annotations

from typing import Any, cast

import orjson
from asgiref.sync import sync_to_async
from django.conf import settings

from core.lifecycle import LazyThreadPool
from serving.gateway.errors import (
    InvalidRequest,
)
from serving.gateway.prefixes import BLOCKS_HASHED, TEXT_BYTES_PER_TOKEN, text_block_hashes, token_block_hashes
from serving.gateway.routing import VersionRoute
from serving.llm.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from serving.llm.tokens import PromptCount, PromptCounter, prompt_counter

_loaded_counters: set[str | None] = set()


async def counter_of(version: VersionRoute) -> PromptCounter:
    directory = version.tokenizer_dir
    if directory in _loaded_counters:
        return prompt_counter(directory)
    # First use in this process: loading a tokenizer takes ~100 ms, keep it off the loop.
    counter = await sync_to_async(prompt_counter, thread_sensitive=False)(directory)
    _loaded_counters.add(directory)
    return counter


# The threads that count large prompts (the tokenizer releases the GIL while it works).
counting_pool = LazyThreadPool("prompt-count", lambda: int(settings.PROMPT_COUNT_THREADS))


def count_prompts(counter: PromptCounter, body: Any, data: dict[str, Any]) -> list[PromptCount]:
    """Each prompt's tokens (a chat is one prompt): exact where the tokenizer and template allow."""
    if isinstance(body, ChatCompletionRequest):
        return [
            counter.count_chat(
                data["messages"],
                tools=data.get("tools"),
                documents=data.get("documents"),
                add_generation_prompt=body.add_generation_prompt is not False,
                continue_final_message=bool(body.continue_final_message),
                template_kwargs=body.chat_template_kwargs,
            )
        ]
    if isinstance(body, CompletionRequest) and body.prompt_count > 1:
        items = cast(list[str] | list[list[int]], body.prompt)
        return [PromptCount(counter.count_prompt(item), counter.exact) for item in items]
    prompt = body.prompt if isinstance(body, CompletionRequest) else body.input
    if isinstance(body, CompletionRequest) and isinstance(prompt, str) and counter.exact:
        ids = counter.encode(prompt)
        return [PromptCount(len(ids), True, ids)]
    return [PromptCount(counter.count_prompt(prompt), counter.exact)]


def prompt_blocks(body: Any, data: dict[str, Any], counts: list[PromptCount]) -> tuple[bytes, ...]:
    """The chained hashes of the prompt's leading blocks, for prefix-aware routing
    (``serving.gateway.prefixes``): of its token ids where the count made them (the model's own
    tokenizer and template, as the engine renders it), else of its text in fixed-size chunks: a
    chat's tools and messages serialised canonically (one JSON object a line, keys sorted: a
    conversation's next turn starts with the same bytes), a completion's prompt as it is.
    Empty for several prompts in one request, token-id prompts too large to be ids, embeddings.
    """
    block = settings.ROUTING_PREFIX_BLOCK_TOKENS
    if len(counts) != 1 or isinstance(body, EmbeddingRequest):
        return ()
    ids = counts[0].ids
    if ids is not None:
        return token_block_hashes(ids, block)
    if isinstance(body, ChatCompletionRequest):
        limit = block * TEXT_BYTES_PER_TOKEN * BLOCKS_HASHED
        text = bytearray(orjson.dumps(data["tools"], option=orjson.OPT_SORT_KEYS) + b"\n" if data.get("tools") else b"")
        for message in data["messages"]:
            if len(text) >= limit:
                break
            text += orjson.dumps(message, option=orjson.OPT_SORT_KEYS) + b"\n"
        return text_block_hashes(bytes(text), block)
    prompt = body.prompt
    if isinstance(prompt, str):
        return text_block_hashes(prompt.encode(), block)
    if prompt and all(isinstance(t, int) for t in prompt):
        return token_block_hashes(prompt, block)
    return ()


def _text_chars(body: Any, data: dict[str, Any]) -> list[int]:
    """Characters of text in each prompt (what the cheap bound needs; token ids are not text)."""
    if isinstance(body, ChatCompletionRequest):
        total = 0
        for message in data["messages"]:
            content = message.get("content")
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        return [total]
    prompt = body.prompt if isinstance(body, CompletionRequest) else body.input
    if isinstance(prompt, str):
        return [len(prompt)]
    return [len(item) for item in prompt if isinstance(item, str)]


def refuse_by_lower_bound(body: Any, data: dict[str, Any], counter: PromptCounter, max_len: int) -> None:
    """Refuse, without tokenising it, a prompt whose text alone needs more tokens than the
    context holds (``PromptCounter.at_least``): a 4 MB body is refused in microseconds."""
    if not counter.max_token_chars or getattr(body, "truncate_prompt_tokens", None) is not None:
        return
    least = max((counter.at_least(chars) for chars in _text_chars(body, data)), default=0)
    embeddings = isinstance(body, EmbeddingRequest)
    if least > max_len or (least >= max_len and not embeddings):
        where = "input" if embeddings else "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise InvalidRequest(
            f"This model's maximum context length is {max_len} tokens, but the {where} has at least {least} "
            "tokens. Please reduce the length of the prompt.",
            param=where,
            code="context_length_exceeded",
        )


def check_completion_limit(body: Any, max_len: int) -> None:
    limit = getattr(body, "completion_limit", None)
    if limit is not None and limit > max_len:
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise InvalidRequest(
            f"'{param}' is too large: {limit}. This model's maximum context length is {max_len} tokens.",
            param=param,
            code="context_length_exceeded",
        )


def check_context(body: Any, prompt_tokens: int, limit: int | None, max_len: int) -> None:
    """Call after check_completion_limit: the prompt and the completion together."""
    requested = prompt_tokens + (limit or 0)
    if prompt_tokens >= max_len or requested > max_len:
        where = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise InvalidRequest(
            f"This model's maximum context length is {max_len} tokens. However, you requested {requested} "
            f"tokens ({prompt_tokens} in the {where}, {limit or 0} in the completion). "
            "Please reduce the length of the prompt or the completion.",
            param=where,
            code="context_length_exceeded",
        )
