"""Which requests may use the semantic cache, and the exact scope an answer is found in.

A chat request is eligible when its model's rules allow it (``CachePolicy`` or the
``SEMANTIC_CACHE_*`` defaults): the cache is on, one choice is asked for, the sampling is
cool enough (the effective temperature, the model's default when the request sets none,
at most ``max_temperature``), the prompt count is exact and within ``max_prompt_tokens``,
the last message is the user's and plain text, nothing asks for what a replay cannot give
(logprobs, token ids, echo), and neither ``Cache-Control`` nor the body's ``cache`` field
opts out (``no-cache``: do not serve from the cache; ``no-store``: do not store the answer;
``"cache": false``: neither).

The scope is a SHA-256 over everything but the last user turn that can change the answer:
the model version, every earlier message (system prompt and conversation so far), every
parameter sent to the engine (sampling, limits, stops, tools, formats …) and the tenant
(the organisation, or the model's shared scope when an admin enabled it). Entries are
only ever searched inside one scope, so none of those can differ between a request and
the answer it is served.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from django.conf import settings

from serving.gateway.routing import CacheRules


class CacheableRequest(Protocol):
    """What the cache reads of a chat request (``serving.llm.schemas.ChatCompletionRequest``)."""

    @property
    def cache(self) -> bool | None: ...

    @property
    def n(self) -> int: ...

    @property
    def temperature(self) -> float | None: ...


# Request fields that never change what an answer says: who asked, the public model name, and
# when the engine schedules it (``priority``: a batch line's is lower than an interactive
# request's, and both share the caches). Left out of every cache's key.
ANSWER_NEUTRAL = frozenset({"model", "user", "priority"})
# Engine parameters that never change the answer's content: left out of the scope.
_NOT_IN_SCOPE = ANSWER_NEUTRAL | {"messages", "stream", "stream_options", "cache", "n"}
# What a replayed answer cannot reproduce: such requests always go to an engine.
_NEEDS_ENGINE = ("logprobs", "top_logprobs", "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids",
                 "echo")  # fmt: skip


@dataclass(frozen=True)
class CacheIntent:
    """What this request may do with the cache (both False: it does not touch it)."""

    read: bool
    write: bool
    reason: str = ""  # why not, for the debug log


NO_CACHE = CacheIntent(read=False, write=False)


def intent_of(
    *,
    body: CacheableRequest,
    payload: dict[str, Any],
    rules: CacheRules,
    default_temperature: float,
    prompt_tokens: int,
    prompt_exact: bool,
    cache_control: str | None,
) -> CacheIntent:
    """May this request be answered from the cache, and may its answer be stored?"""
    if not settings.SEMANTIC_CACHE_ENABLED or not rules.enabled:
        return CacheIntent(False, False, "the cache is off for this model")
    if body.cache is False:
        return CacheIntent(False, False, "the request opted out")
    if body.n != 1:
        return CacheIntent(False, False, "more than one choice")
    temperature = body.temperature if body.temperature is not None else default_temperature
    if temperature > rules.max_temperature:
        return CacheIntent(False, False, f"temperature {temperature:g} > {rules.max_temperature:g}")
    if not prompt_exact or prompt_tokens > rules.max_prompt_tokens:
        return CacheIntent(False, False, "prompt too long or not counted exactly")
    if any(payload.get(name) for name in _NEEDS_ENGINE):
        return CacheIntent(False, False, "asks for what a replay cannot give")
    if last_user_text(payload["messages"]) is None:
        return CacheIntent(False, False, "the last message is not the user's text")
    directives = {d.strip().lower() for d in (cache_control or "").split(",")}
    return CacheIntent(read="no-cache" not in directives and "no-store" not in directives,
                       write="no-store" not in directives)  # fmt: skip


def last_user_text(messages: list[dict[str, Any]]) -> str | None:
    """The last message's text when it is the user's (parts joined as vLLM joins them)."""
    if not messages or messages[-1].get("role") != "user":
        return None
    content = messages[-1].get("content")
    if isinstance(content, str):
        return content if content.strip() else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        text = "\n".join(str(p.get("text") or "") for p in content)
        return text if text.strip() else None
    return None


def scope_of(
    *,
    payload: dict[str, Any],
    version_id: int,
    organization_id: int,
    rules: CacheRules,
    default_temperature: float,
) -> str:
    """The hex SHA-256 naming the only place this request's answer may be found."""
    params = {k: v for k, v in payload.items() if k not in _NOT_IN_SCOPE}
    params.setdefault("temperature", default_temperature)  # unset and explicit default are the same
    material = {
        "version": version_id,
        "before": payload["messages"][:-1],  # system prompt and the conversation so far
        "params": params,
        "tenant": "shared" if rules.shared_scope else f"org:{organization_id}",
    }
    return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()
