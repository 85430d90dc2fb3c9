"""OpenAI's wire details that are not request schemas: the ``x-ratelimit-*`` headers and the
finish reasons an answer's choices carry. The ledger counts in neutral terms
(``billing.ledger.Headroom``); this module says it the way OpenAI's clients read it."""

from __future__ import annotations

from collections.abc import Mapping

from billing.ledger import FINISH_REASON_MAX_LENGTH, Headroom


def rate_limit_headers(headroom: Headroom) -> dict[str, str]:
    """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} headers (and, for small
    models' requests, the same for ``inferences``)."""
    values: dict[str, str] = {}
    for suffix, bucket in (("requests", headroom.requests), ("tokens", headroom.tokens),
                           ("inferences", headroom.inferences)):  # fmt: skip
        if bucket is not None:
            values[f"x-ratelimit-limit-{suffix}"] = str(bucket.limit)
            values[f"x-ratelimit-remaining-{suffix}"] = str(bucket.left)
            values[f"x-ratelimit-reset-{suffix}"] = format_duration(bucket.reset_seconds)
    return values


def format_duration(seconds: float) -> str:
    """OpenAI's style: ``0s``, ``250ms``, ``1.5s``, ``6m0s``."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"


def note_finish_reasons(reasons: dict[int, str], choices: object) -> None:
    """Add the finish reasons that an answer's (or a stream chunk's) ``choices`` carry to
    ``reasons``, by choice index: a stream ends its choices one chunk at a time."""
    if not isinstance(choices, list):
        return
    for position, choice in enumerate(choices):
        if isinstance(choice, dict) and choice.get("finish_reason"):
            index = choice.get("index")
            reasons[index if isinstance(index, int) else position] = str(choice["finish_reason"])


def finish_reason_of(reasons: Mapping[int, str]) -> str:
    """The one finish reason a usage event keeps for a request's choices (by index).

    "length" when any choice was cut by its token limit (a truncated answer was delivered,
    which is what a canary's truncation share counts), else the first choice's; "" when no
    choice finished (embeddings, a failed or interrupted request).
    """
    if not reasons:
        return ""
    reason = "length" if "length" in reasons.values() else reasons[min(reasons)]
    return reason[:FINISH_REASON_MAX_LENGTH]
