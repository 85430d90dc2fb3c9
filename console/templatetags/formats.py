"""The house formats as template filters (core.formats), built into every template
(settings TEMPLATES ``builtins``): ``{{ amount|money:currency }}``, ``{{ price|unit_price:currency }}``,
``{{ count|quantity }}``, ``{{ moment|utc }}``, ``{{ moment|utc_seconds }}``, ``{{ moment|utc_date }}``,
``{{ moment|utc_month }}``."""

from __future__ import annotations

from datetime import date, datetime
from decimal import Decimal

from django import template
from django.conf import settings

from core import formats

register = template.Library()


def _currency(currency: str | None) -> str:
    return currency or str(settings.BILLING_CURRENCY)


@register.filter
def money(amount: Decimal | None, currency: str | None = None) -> str:
    """Without a currency: the platform's (BILLING_CURRENCY)."""
    return formats.money(amount, _currency(currency))


@register.filter
def unit_price(amount: Decimal | None, currency: str | None = None) -> str:
    return formats.unit_price(amount, _currency(currency))


@register.filter
def quantity(number: int | float | None) -> str:
    return formats.quantity(number)


@register.filter
def utc(moment: datetime | date | None) -> str:
    return formats.utc(moment)


@register.filter
def utc_seconds(moment: datetime | date | None) -> str:
    return formats.utc(moment, seconds=True)


@register.filter
def utc_date(moment: datetime | date | None) -> str:
    return formats.utc_date(moment)


@register.filter
def utc_month(moment: datetime | date | None) -> str:
    return formats.utc_month(moment)
