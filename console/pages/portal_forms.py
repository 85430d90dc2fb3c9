"""The portal's forms: the usage window, keys (create, rotate) and list filters.

Forms only parse and bound input; the rules (plan ceilings, who may do what) live in
``billing.services`` and come back as field errors.
"""

from __future__ import annotations

from datetime import date, timedelta
from decimal import Decimal
from typing import Any

from django import forms

from accounts.models import CAP_FIELDS, LIMIT_MAX, SPEND_CAP_DECIMAL_PLACES, SPEND_CAP_MAX_DIGITS, SPEND_CAP_MIN
from accounts.services import NAME_MAX_LENGTH
from billing.models import Invoice

RANGE_CHOICES = [("7", "Last 7 days"), ("30", "Last 30 days"), ("90", "Last 90 days")]
DEFAULT_DAYS = 30
MAX_WINDOW_DAYS = 366


class UsageWindowForm(forms.Form):
    """Last 7, 30 or 90 days (UTC, today included), or ``start`` to ``end``."""

    days = forms.ChoiceField(label="Range", choices=RANGE_CHOICES, required=False, initial=str(DEFAULT_DAYS))
    start = forms.DateField(label="From", required=False, widget=forms.DateInput(attrs={"type": "date"}))
    end = forms.DateField(label="To", required=False, widget=forms.DateInput(attrs={"type": "date"}))
    api_key = forms.TypedChoiceField(label="API key", required=False, coerce=int, empty_value=None)

    def __init__(self, *args: Any, keys: list[tuple[int, str]], today: date, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.today = today
        api_key = self.fields["api_key"]
        assert isinstance(api_key, forms.TypedChoiceField)
        api_key.choices = [("", "All keys"), *keys]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        start, end = data.get("start"), data.get("end")
        if start is None and end is None:
            days = int(data.get("days") or DEFAULT_DAYS)
            data["start"], data["end"] = self.today - timedelta(days=days - 1), self.today
            return data
        end = end or self.today
        start = start or end - timedelta(days=DEFAULT_DAYS - 1)
        if start > end:
            self.add_error("start", "The first day is after the last one.")
        elif (end - start).days + 1 > MAX_WINDOW_DAYS:
            self.add_error("start", f"Choose at most {MAX_WINDOW_DAYS} days.")
        data["start"], data["end"] = start, end
        return data


def _count(label: str, help_text: str) -> forms.IntegerField:
    return forms.IntegerField(label=label, required=False, min_value=1, max_value=LIMIT_MAX, help_text=help_text)


class KeyForm(forms.Form):
    """A form that creates a key: the console's (any limits) or the portal's (within the plan)."""

    def values(self) -> dict[str, Any]:
        """The key's fields for ``accounts.services.api_key_create``."""
        raise NotImplementedError


class ApiKeyCreateForm(KeyForm):
    """A new key; a limit left empty gets the default, within the organisation's plan."""

    name = forms.CharField(label="Name", max_length=NAME_MAX_LENGTH)
    rate_limit_rpm = _count("Requests per minute", "")
    rate_limit_tpm = _count("Tokens per minute", "")
    rate_limit_ipm = _count("Inferences per minute", "")
    max_concurrent = _count("Requests at once", "")
    monthly_token_quota = _count("Tokens per month", "")
    monthly_spend_cap = forms.DecimalField(
        label="Spend per month",
        required=False,
        max_digits=SPEND_CAP_MAX_DIGITS,
        decimal_places=SPEND_CAP_DECIMAL_PLACES,
        min_value=SPEND_CAP_MIN,
    )

    LIMITS = CAP_FIELDS

    def __init__(self, *args: Any, ceilings: dict[str, int | Decimal | None], currency: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["monthly_spend_cap"].label = f"Spend per month ({currency})"
        for name in self.LIMITS:
            ceiling = ceilings.get(name)
            limit = f"your plan allows at most {ceiling}" if ceiling is not None else "no plan limit"
            self.fields[name].help_text = f"Optional: empty for the default; {limit}."

    def values(self) -> dict[str, Any]:
        """The key's name and the limits given (left-out ones are not passed, so the service
        applies its defaults)."""
        given = {name: self.cleaned_data[name] for name in self.LIMITS if self.cleaned_data.get(name) is not None}
        return {"name": self.cleaned_data["name"], **given}


GRACE_CHOICES = [
    ("0", "Immediately"),
    ("3600", "After 1 hour"),
    ("86400", "After 24 hours"),
    ("604800", "After 7 days"),
]


class ApiKeyRotateForm(forms.Form):
    grace_seconds = forms.TypedChoiceField(
        label="The old key stops working", choices=GRACE_CHOICES, coerce=int, initial="86400"
    )


KEY_STATES = [("", "All"), ("active", "Active"), ("revoked", "Revoked")]


class ApiKeyFilterForm(forms.Form):
    q = forms.CharField(label="Name or prefix", required=False, max_length=100)
    state = forms.ChoiceField(label="State", choices=KEY_STATES, required=False)


class InvoiceFilterForm(forms.Form):
    status = forms.ChoiceField(label="State", choices=[("", "All"), *Invoice.Status.choices], required=False)
