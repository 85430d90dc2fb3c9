"""Rate limits, concurrency, monthly budgets and backpressure: one atomic Redis call per request.

``admit`` checks and charges, for the key and for its organisation, requests per minute,
tokens per minute (the prompt plus ``max_tokens``, reserved up front), concurrent
requests, the month's token quota and spend cap, and the model's queue for the key's
tier; it also records the request in flight for metering. ``settle`` (when the request
ends, however it ends) returns the unused part of the reservation, releases the places,
and writes the usage event. Both are one Lua call (``limits.lua``) on Redis server time,
so limits hold exactly across every gateway process. Redis down means refused (503):
see docs/architecture.md, "The limiter".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson
from django.conf import settings
from redis.asyncio.client import Redis
from redis.commands.core import AsyncScript

from billing.pricing import cost_micros, to_micros
from core import keys
from core.redis import async_redis
from serving.auth import KeyGrant, ScopeLimits
from serving.errors import RateLimited


def spend_micros(tokens: int) -> int:
    return cost_micros(tokens=tokens)


@lru_cache(maxsize=1)
def lua_source() -> str:
    return (Path(__file__).with_name("limits.lua")).read_text()


_scripts: dict[int, AsyncScript] = {}


def _script(client: Redis) -> AsyncScript:
    script = _scripts.get(id(client))
    if script is None:
        script = client.register_script(lua_source())
        _scripts[id(client)] = script
    return script


def clock_key() -> str:
    """Tests move the limiter's clock through a Redis key; production always uses TIME."""
    return keys.limiter_test_clock() if settings.LIMITS_TEST_CLOCK else ""


def inflight_key() -> str:
    return keys.inflight_requests()


def usage_stream_key() -> str:
    return keys.usage_stream()


def alerts_stream_key() -> str:
    return keys.budget_alerts()


def scope_prefix(kind: str, ident: int) -> str:
    return keys.limit_scope(kind, ident)


def _scope_spec(name: str, ident: int, limits: ScopeLimits) -> dict[str, Any]:
    return {
        "name": name,
        "id": ident,
        "p": scope_prefix(name, ident),
        "rpm": limits.rpm or 0,
        "tpm": limits.tpm or 0,
        "conc": limits.concurrent or 0,
        "quota": limits.token_quota or 0,
        "spend": to_micros(limits.spend_cap),
        "alert": limits.alert_percent,
    }


def scopes_of(grant: KeyGrant) -> list[dict[str, Any]]:
    return [
        _scope_spec("key", grant.key_id, grant.key_limits),
        _scope_spec("org", grant.organization_id, grant.org_limits),
    ]


@dataclass(frozen=True)
class RateLimitHeaders:
    """OpenAI's x-ratelimit-* headers, from the tightest of the key's and the org's buckets."""

    values: dict[str, str]

    @classmethod
    def from_report(cls, report: list[dict[str, Any]]) -> RateLimitHeaders:
        values: dict[str, str] = {}
        for dimension, suffix in (("rpm", "requests"), ("tpm", "tokens")):
            tightest = min(
                (r for r in report if dimension in r),
                key=lambda r: r[f"{dimension}_left"],
                default=None,
            )
            if tightest is None:
                continue
            values[f"x-ratelimit-limit-{suffix}"] = str(int(tightest[dimension]))
            values[f"x-ratelimit-remaining-{suffix}"] = str(max(0, math.floor(tightest[f"{dimension}_left"])))
            values[f"x-ratelimit-reset-{suffix}"] = format_duration(tightest[f"{dimension}_reset"])
        return cls(values)


def format_duration(seconds: float) -> str:
    """OpenAI's style: ``0s``, ``250ms``, ``1.5s``, ``6m0s``."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"


_REFUSALS = {
    "request_too_large": "Request too large for the {scope}'s {limit} per minute limit: it needs {requested} "
    "(prompt + max_tokens) and the limit is {value}. Lower max_tokens or shorten the prompt.",
    "insufficient_quota": "You exceeded the {scope}'s {limit} budget ({value}) for this month. "
    "It resets at the start of next month (UTC).",
    "model_overloaded": "The model is at capacity; {tier}-tier requests are refused first while it is busy. "
    "Retry shortly.",
}


def refusal(result: dict[str, Any], grant: KeyGrant, headers: dict[str, str]) -> RateLimited:
    code = result["code"]
    retry = max(1, math.ceil(result.get("retry", 1)))
    if code == "rate_limit_exceeded":
        what = {"requests": "requests per minute", "tokens": "tokens per minute", "concurrency": "concurrent requests"}
        message = (
            f"Rate limit reached for the {result['scope']}'s {what[result['limit']]} (limit {result['value']})"
            + (f"; this request needs {result['requested']} tokens" if "requested" in result else "")
            + f". Retry in {retry} s."
        )
    else:
        message = _REFUSALS[code].format(tier=grant.tier, **result)
    return RateLimited(
        message,
        code=code,
        type="insufficient_quota" if code == "insufficient_quota" else "rate_limit_exceeded",
        headers={**headers, "Retry-After": str(retry)},
    )


async def admit(
    *,
    grant: KeyGrant,
    request_id: str,
    tokens: int,
    entry: dict[str, str],
    model_key: str,
    model_limit: int,
) -> RateLimitHeaders:
    """Check and charge everything for one request; raise RateLimited when refused."""
    spec = {
        "scopes": scopes_of(grant),
        "tokens": tokens,
        "spend": spend_micros(tokens),
        "ttl": int(settings.ENGINE_REQUEST_TIMEOUT) + 60,
        "org": grant.organization_id,
        "model_key": model_key,
        "model_limit": model_limit,
    }
    client = async_redis()
    raw = await _script(client)(
        keys=[inflight_key(), alerts_stream_key()],
        args=["admit", request_id, orjson.dumps(spec), orjson.dumps(entry), clock_key()],
    )
    result = orjson.loads(raw)
    if not result["ok"]:
        peeked = await peek(grant)
        raise refusal(result, grant, peeked.values)
    return RateLimitHeaders.from_report(result["scopes"])


async def peek(grant: KeyGrant) -> RateLimitHeaders:
    """The key's buckets as they stand, without charging anything."""
    client = async_redis()
    raw = await _script(client)(keys=[], args=["peek", orjson.dumps({"scopes": scopes_of(grant)}), clock_key()])
    return RateLimitHeaders.from_report(orjson.loads(raw)["scopes"])


async def settle(*, request_id: str, tokens_used: int, event: dict[str, str]) -> bool:
    """Refund, release and write the usage event; False if it was already settled."""
    argv: list[str | int] = ["settle", request_id, tokens_used, spend_micros(tokens_used), clock_key()]
    for name, value in event.items():
        argv += [name, value]
    client = async_redis()
    return bool(await _script(client)(keys=[inflight_key(), usage_stream_key()], args=argv))


def model_queue_key(model: str) -> str:
    return keys.model_queue(model)
