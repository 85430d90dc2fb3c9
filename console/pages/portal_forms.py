"""The portal's forms: the usage window, keys (create, rotate) and list filters.

Forms only parse and bound input; the rules (plan ceilings, who may do what) live in
``billing.services`` and come back as field errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal
from typing import Any

from django import forms

from accounts.models import CAP_FIELDS, LIMIT_MAX, SPEND_CAP_DECIMAL_PLACES, SPEND_CAP_MAX_DIGITS, SPEND_CAP_MIN
from accounts.services import NAME_MAX_LENGTH
from billing.models import Invoice
from core import formats

DEFAULT_RANGE = "30"
MAX_WINDOW_DAYS = 366


@dataclass(frozen=True)
class UsageRange:
    """A named window of whole UTC days, today included where it reaches today."""

    key: str
    label: str
    days: Callable[[date], tuple[date, date]]  # today → (first day, last day)


def _last(n: int) -> Callable[[date], tuple[date, date]]:
    return lambda today: (today - timedelta(days=n - 1), today)


def _this_month(today: date) -> tuple[date, date]:
    return today.replace(day=1), today


def _last_month(today: date) -> tuple[date, date]:
    last_day = today.replace(day=1) - timedelta(days=1)
    return last_day.replace(day=1), last_day


USAGE_RANGES = (
    UsageRange("7", "Last 7 days", _last(7)),
    UsageRange("30", "Last 30 days", _last(30)),
    UsageRange("month", "This month", _this_month),
    UsageRange("last-month", "Last month", _last_month),
    UsageRange("90", "Last 90 days", _last(90)),
)
GROUP_CHOICES = [("model", "By model"), ("key", "By key")]
_DATE_ERRORS = {"invalid": "Enter a day as YYYY-MM-DD, for example 2026-11-01."}


def _day(label: str) -> forms.DateField:
    return forms.DateField(
        label=label,
        required=False,
        input_formats=["%Y-%m-%d"],
        error_messages=_DATE_ERRORS,
        widget=forms.DateInput(attrs={"type": "date"}, format="%Y-%m-%d"),
    )


class UsageWindowForm(forms.Form):
    """The usage page's question: a named range (``range``, from the preset links) or the
    days ``start`` to ``end`` (UTC, both included; the dates win when given), one key or all,
    grouped by model or by key. ``cleaned_data["range"]`` is the preset the days match, or
    ``"custom"``."""

    range = forms.ChoiceField(
        label="Range", choices=[(r.key, r.label) for r in USAGE_RANGES], required=False, widget=forms.HiddenInput
    )
    start = _day("From")
    end = _day("To")
    api_key = forms.TypedChoiceField(label="API key", required=False, coerce=int, empty_value=None)
    group = forms.ChoiceField(label="Group", choices=GROUP_CHOICES, required=False, widget=forms.HiddenInput)

    def __init__(self, *args: Any, keys: list[tuple[int, str]], today: date, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.today = today
        api_key = self.fields["api_key"]
        assert isinstance(api_key, forms.TypedChoiceField)
        api_key.choices = [("", "All keys"), *keys]
        for name in ("start", "end"):  # the browser's picker offers no day after today
            self.fields[name].widget.attrs["max"] = today.isoformat()

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        data["group"] = data.get("group") or "model"
        start, end = data.get("start"), data.get("end")
        if start is None and end is None:
            if self.has_error("start") or self.has_error("end"):
                return data
            chosen = next(r for r in USAGE_RANGES if r.key == (data.get("range") or DEFAULT_RANGE))
            data["start"], data["end"] = chosen.days(self.today)
            data["range"] = chosen.key
            return data
        end = end or self.today
        start = start or end - timedelta(days=int(DEFAULT_RANGE) - 1)
        if start > end:
            self.add_error("end", f"The last day ({end}) is before the first ({start}).")
        elif end > self.today:
            self.add_error("end", f"Usage is known up to today, {self.today} (UTC).")
        elif (end - start).days + 1 > MAX_WINDOW_DAYS:
            self.add_error("start", f"Choose at most {MAX_WINDOW_DAYS} days ({(end - start).days + 1} asked).")
        data["start"], data["end"] = start, end
        data["range"] = next((r.key for r in USAGE_RANGES if r.days(self.today) == (start, end)), "custom")
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
        self.require()
        for name in self.LIMITS:
            ceiling = ceilings.get(name)
            if ceiling is None:
                allows = "no plan limit"
            elif name == "monthly_spend_cap":  # as configured: a cap of 0.0002 is $0.0002
                allows = f"your plan allows at most {formats.unit_price(ceiling, currency)}"
            else:
                allows = f"your plan allows at most {ceiling:,}"
            empty = self.EMPTY if not self.fields[name].required else ""
            self.fields[name].help_text = f"{empty}{allows}."

    # What a limit left empty means, before what the plan allows.
    EMPTY = "Optional: empty for the default; "

    def require(self) -> None:
        """Make required the limits this form cannot leave empty (none, to create a key)."""

    def values(self) -> dict[str, Any]:
        """The key's name and the limits given (left-out ones are not passed, so the service
        applies its defaults)."""
        given = {name: self.cleaned_data[name] for name in self.LIMITS if self.cleaned_data.get(name) is not None}
        return {"name": self.cleaned_data["name"], **given}


class ApiKeyEditForm(ApiKeyCreateForm):
    """A key's name and limits, as an org admin changes them: within the plan; an optional
    limit left empty is no limit of the key's own (the organisation's and the plan's still hold)."""

    EMPTY = "Empty: none of the key's own; "

    def require(self) -> None:
        for name in ("rate_limit_rpm", "rate_limit_tpm"):
            self.fields[name].required = True  # a key always has both (accounts.services)

    def values(self) -> dict[str, Any]:
        """The key's name and every limit (None: none of its own)."""
        return {"name": self.cleaned_data["name"], **{name: self.cleaned_data.get(name) for name in self.LIMITS}}


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
