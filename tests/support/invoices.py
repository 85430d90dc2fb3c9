"""Usage records and prices for the invoice tests, made directly with the ORM."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal

from accounts.models import ApiKey
from billing.models import Price, UsageRecord
from billing.pricing import request_cost
from billing.services import price_set
from registry.models import Model


def at(text: str) -> datetime:
    """'2025-12-31 23:59:59.999999' as an aware UTC datetime."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def chat_model(name: str = "chat-model") -> Model:
    return Model.objects.create(name=name, task="chat")


def price(model: Model, since: str, input_: str, output: str, cached: str | None = None) -> Price:
    return price_set(
        model=model,
        input_per_million=input_,
        output_per_million=output,
        cached_input_per_million=cached,
        effective_from=at(since),
    )


def record(
    key: ApiKey,
    when: datetime | str,
    *,
    prompt: int = 0,
    completion: int = 0,
    cached: int = 0,
    price: Price | None = None,
    model: str = "chat-model",
    batch: bool = False,
) -> UsageRecord:
    """One request's usage, costed at ``price`` as the gateway would (exact, unrounded; a
    batch job's line at the price's batch percent)."""
    cost = Decimal(0)
    if price is not None:
        cost = request_cost(
            input_per_million=price.input_per_million,
            output_per_million=price.output_per_million,
            cached_input_per_million=price.cached_input_per_million,
            input_tokens=prompt - cached,
            output_tokens=completion,
            cached_tokens=cached,
        )
        if batch:
            cost = cost * price.batch_percent / 100
    return UsageRecord.objects.create(
        request_id=uuid.uuid4(),
        api_key=key,
        organization_id=key.organization_id,
        model=model,
        model_version="1",
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        total_tokens=prompt + completion,
        latency_ms=10,
        status_code=200,
        created_at=at(when) if isinstance(when, str) else when,
        price=price,
        cost=cost,
        batch=batch,
    )
