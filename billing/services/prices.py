"""Writes for prices: a model's (or version's) price per million tokens, from a moment on."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing.models import PRICE_DECIMAL_PLACES, PRICE_MAX_DIGITS, Price
from core.errors import InvalidInput
from core.events import publish_routing_change
from registry.models import Model, ModelVersion
from registry.services import Actor, audit_record

_PRICE_LIMIT = Decimal(10) ** (PRICE_MAX_DIGITS - PRICE_DECIMAL_PLACES)
_PRICE_QUANTUM = Decimal(1).scaleb(-PRICE_DECIMAL_PLACES)


def _price_value(field: str, value: Any) -> Decimal:
    try:
        amount = value if isinstance(value, Decimal) else Decimal(str(value))
    except (InvalidOperation, ValueError):
        raise InvalidInput(field, "must be a decimal amount per million tokens") from None
    if not amount.is_finite() or amount < 0:
        raise InvalidInput(field, "must be zero or more")
    if amount >= _PRICE_LIMIT:
        raise InvalidInput(field, f"must be below {_PRICE_LIMIT}")
    if amount != amount.quantize(_PRICE_QUANTUM):
        raise InvalidInput(field, f"has at most {PRICE_DECIMAL_PLACES} decimal places")
    return amount


def _percent(field: str, value: Decimal | str) -> Decimal:
    try:
        amount = Decimal(value)
    except (InvalidOperation, TypeError, ValueError):
        raise InvalidInput(field, "must be a number") from None
    if not amount.is_finite() or not 0 <= amount <= 100:
        raise InvalidInput(field, "must be between 0 and 100")
    if amount != amount.quantize(Decimal("0.01")):
        raise InvalidInput(field, "has at most 2 decimal places")
    return amount


PRICE_FIELDS = (
    "input_per_million", "output_per_million", "cached_input_per_million", "per_thousand_inferences",
    "cached_per_thousand_inferences", "batch_percent",
)  # fmt: skip


def _snapshot(price: Price) -> dict[str, Any]:
    """A price as the audit log keeps it (amounts as exact strings, the same read or written)."""
    return {
        "version": price.version.version if price.version is not None else None,
        "effective_from": price.effective_from.isoformat(),
        **{field: format(Decimal(getattr(price, field)).normalize(), "f") for field in PRICE_FIELDS},
    }


def price_set(
    *,
    model: Model,
    input_per_million: Decimal | str,
    output_per_million: Decimal | str,
    cached_input_per_million: Decimal | str | None = None,
    per_thousand_inferences: Decimal | str = Decimal(0),
    cached_per_thousand_inferences: Decimal | str | None = None,
    batch_percent: Decimal | str = Decimal(50),
    version: ModelVersion | None = None,
    effective_from: datetime | None = None,
    currency: str | None = None,
    actor: Actor = None,
) -> Price:
    """Price ``model`` (or one ``version`` of it) from ``effective_from`` (default: now) on.

    The price in effect at that moment ends there, so periods never overlap; a price
    scheduled to start later must be changed first (refused). Requests admitted from then
    on are charged the new price on every gateway (each reloads its prices at once).
    Cached input tokens cost ``cached_input_per_million`` (default: the input price). A small
    model's requests cost ``per_thousand_inferences`` per thousand items, those answered from
    the result cache ``cached_per_thousand_inferences`` (default: the same). A batch job's
    requests pay ``batch_percent`` of each (default 50: half price). Audited (``price.set``, on
    the model: the price it replaces and the new one), in the write's transaction.
    """
    if version is not None and version.model_id != model.pk:
        raise InvalidInput("version", f"{version} is not a version of {model}")
    currency = (currency or settings.BILLING_CURRENCY).upper()
    if currency != settings.BILLING_CURRENCY:
        raise InvalidInput("currency", f"prices are in the billing currency, {settings.BILLING_CURRENCY}")
    start = effective_from or timezone.now()
    if timezone.is_naive(start):
        raise InvalidInput("effective_from", "must include a time zone")
    values = {
        "input_per_million": _price_value("input_per_million", input_per_million),
        "output_per_million": _price_value("output_per_million", output_per_million),
        "cached_input_per_million": _price_value(
            "cached_input_per_million",
            input_per_million if cached_input_per_million is None else cached_input_per_million,
        ),
        "per_thousand_inferences": _price_value("per_thousand_inferences", per_thousand_inferences),
        "cached_per_thousand_inferences": _price_value(
            "cached_per_thousand_inferences",
            per_thousand_inferences if cached_per_thousand_inferences is None else cached_per_thousand_inferences,
        ),
        "batch_percent": _percent("batch_percent", batch_percent),
    }
    with transaction.atomic():
        Model.objects.select_for_update().get(pk=model.pk)  # one price change of a model at a time
        same_scope = Price.objects.filter(model=model, version=version)
        if same_scope.filter(effective_from__gte=start).exists():
            raise InvalidInput("effective_from", "a price starting at or after this moment exists; change that one")
        current = same_scope.filter(effective_from__lt=start).exclude(effective_to__lte=start).first()
        if current is not None:
            current.effective_to = start
            current.save(update_fields=["effective_to"])
        price = Price.objects.create(model=model, version=version, currency=currency, effective_from=start, **values)
        audit_record(
            actor=actor, action="price.set", target_type="model", target=model.name,
            before=_snapshot(current) if current is not None else None, after=_snapshot(price),
        )  # fmt: skip
        publish_routing_change("prices")
    return price


def price_end(*, price: Price, actor: Actor = None) -> Price | None:
    """End a price now: one in effect stops at this moment (requests from then on are unpriced,
    free, unless another price covers them: the model's, for a version's own); one scheduled to
    start later is withdrawn (never charged, so deleted; None). Audited (``price.end``), in the
    write's transaction; gateways reload their prices at once."""
    now = timezone.now()
    with transaction.atomic():
        model = Model.objects.select_for_update().get(pk=price.model_id)
        locked = Price.objects.select_related("version").select_for_update(of=("self",)).get(pk=price.pk)
        if locked.effective_to is not None and locked.effective_to <= now:
            raise InvalidInput("price", "this price has ended already")
        before = _snapshot(locked)
        if locked.effective_from > now:
            locked.delete()
            ended = None
        else:
            locked.effective_to = now
            locked.save(update_fields=["effective_to"])
            ended = locked
        audit_record(
            actor=actor, action="price.end", target_type="model", target=model.name, before=before,
            after={"version": before["version"], "ended_at": now.isoformat(), "withdrawn": ended is None},
        )  # fmt: skip
        publish_routing_change("prices")
    return ended
