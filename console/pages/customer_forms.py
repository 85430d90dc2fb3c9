"""The console's customer forms: organisations, members, keys, invoices, prices, reconciliation.

Forms parse and bound input; the rules (names taken, plan ceilings, legal invoice moves)
live in ``billing.services`` and come back as field errors or messages.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

from django import forms

from accounts.models import (
    CAP_FIELDS,
    LIMIT_FIELDS,
    LIMIT_MAX,
    SPEND_CAP_DECIMAL_PLACES,
    SPEND_CAP_MAX_DIGITS,
    SPEND_CAP_MIN,
    Organization,
    Role,
    Tier,
)
from accounts.services import EMAIL_MAX_LENGTH, NAME_MAX_LENGTH, USERNAME_MAX_LENGTH
from billing import invoicing
from billing.models import PRICE_DECIMAL_PLACES, PRICE_MAX_DIGITS, Invoice
from billing.services.invoices import VOID_REASON_MAX_LENGTH
from console.pages.portal_forms import KeyForm

TAX_PERCENT_PLACES = 2  # the organisation stores a fraction with 4 places: 20.25 % is 0.2025


def _count(label: str, *, required: bool = False, help_text: str = "Empty: no limit.") -> forms.IntegerField:
    return forms.IntegerField(
        label=label, required=required, min_value=1, max_value=LIMIT_MAX, help_text="" if required else help_text
    )


def _spend_cap(label: str) -> forms.DecimalField:
    return forms.DecimalField(
        label=label,
        required=False,
        max_digits=SPEND_CAP_MAX_DIGITS,
        decimal_places=SPEND_CAP_DECIMAL_PLACES,
        min_value=SPEND_CAP_MIN,
        help_text="Empty: no limit.",
    )


def _month_input(label: str, *, required: bool = True) -> forms.CharField:
    return forms.CharField(
        label=label,
        required=required,
        max_length=7,
        widget=forms.TextInput(attrs={"type": "month", "placeholder": "YYYY-MM", "pattern": r"\d{4}-\d{2}"}),
        help_text="A UTC month, YYYY-MM.",
    )


def _clean_month(value: str) -> dt.date | None:
    if not value:
        return None
    try:
        return invoicing.parse_period(value)
    except ValueError as exc:
        raise forms.ValidationError(str(exc)) from None


class OrganizationForm(forms.Form):
    """An organisation's plan: its tier, limits and budgets, and where its invoices go.

    Organisation limits may be empty (no limit at this level); keys always have their own."""

    name = forms.CharField(label="Name", max_length=NAME_MAX_LENGTH)
    tier = forms.ChoiceField(label="Tier", choices=Tier.choices, initial=Tier.PAID)
    billing_email = forms.EmailField(label="Billing email", required=False, max_length=EMAIL_MAX_LENGTH)
    tax_percent = forms.DecimalField(
        label="Tax rate (%)",
        min_value=Decimal(0),
        max_value=Decimal(100),
        decimal_places=TAX_PERCENT_PLACES,
        initial=Decimal(0),
        help_text="Added to invoice subtotals, e.g. 20 for 20 %.",
    )
    rate_limit_rpm = _count("Requests per minute")
    rate_limit_tpm = _count("Tokens per minute")
    rate_limit_ipm = _count("Inferences per minute")
    max_concurrent = _count("Requests at once")
    monthly_token_quota = _count("Token quota per month")
    monthly_spend_cap = _spend_cap("Spend cap per month")
    budget_alert_percent = forms.IntegerField(
        label="Budget alert at (%)", min_value=1, max_value=100, initial=80, help_text="Also alerted at 50, 80, 100 %."
    )

    cache_wrong_hit_budget = forms.DecimalField(
        label="Cache wrong-hit budget (%)", required=False, min_value=Decimal(0), max_value=Decimal(100),
        decimal_places=2, help_text="the stricter of this and each model's budget applies (empty: the model's)",
    )  # fmt: skip

    batch_weight = forms.IntegerField(
        label="Batch weight", min_value=1, max_value=1000, initial=1, required=False,
        help_text="its share of batch capacity when several organisations' batches wait (2: twice the lines "
                  "in flight of an organisation of 1; empty: unchanged, 1 for a new one)",
    )  # fmt: skip

    LIMITS = LIMIT_FIELDS

    def __init__(self, *args: Any, currency: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["monthly_spend_cap"].label = f"Spend cap per month ({currency})"

    @classmethod
    def initial_from(cls, organization: Organization) -> dict[str, Any]:
        names = ("name", "tier", "billing_email", "cache_wrong_hit_budget", "batch_weight", *cls.LIMITS)
        initial = {name: getattr(organization, name) for name in names}
        if organization.monthly_spend_cap is not None:
            initial["monthly_spend_cap"] = f"{organization.monthly_spend_cap.normalize():f}"
        initial["tax_percent"] = f"{(organization.tax_rate * 100).normalize():f}"  # 10, not 1E+1
        return initial

    def values(self) -> dict[str, Any]:
        """What the services take: ``tax_rate`` as a fraction, every limit (None: no limit)."""
        data = self.cleaned_data
        values = {
            name: data[name] for name in ("name", "tier", "billing_email", "cache_wrong_hit_budget", *self.LIMITS)
        }
        values["tax_rate"] = data["tax_percent"] / 100
        if data.get("batch_weight") is not None:
            values["batch_weight"] = data["batch_weight"]
        return values


class OrganizationFilterForm(forms.Form):
    q = forms.CharField(label="Name", required=False, max_length=100)
    tier = forms.ChoiceField(label="Tier", choices=[("", "All"), *Tier.choices], required=False)


class MemberForm(forms.Form):
    """Add an existing user with a role, or change a member's role."""

    username = forms.CharField(label="Username", max_length=USERNAME_MAX_LENGTH)
    role = forms.ChoiceField(label="Role", choices=Role.choices, initial=Role.ORG_MEMBER)


class MemberRemoveForm(forms.Form):
    username = forms.CharField(max_length=USERNAME_MAX_LENGTH, widget=forms.HiddenInput)


class ApiKeyForm(KeyForm):
    """A key's name, tier and limits, as a platform admin sets them (beyond the plan if need
    be). Requests and tokens per minute are required; the others empty mean no limit."""

    name = forms.CharField(label="Name", max_length=NAME_MAX_LENGTH)
    tier = forms.ChoiceField(label="Tier", choices=Tier.choices)
    rate_limit_rpm = _count("Requests per minute", required=True)
    rate_limit_tpm = _count("Tokens per minute", required=True)
    rate_limit_ipm = _count("Inferences per minute")
    max_concurrent = _count("Requests at once")
    monthly_token_quota = _count("Tokens per month")
    monthly_spend_cap = _spend_cap("Spend per month")

    LIMITS = CAP_FIELDS

    def __init__(self, *args: Any, currency: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["monthly_spend_cap"].label = f"Spend per month ({currency})"

    def values(self) -> dict[str, Any]:
        return {name: self.cleaned_data[name] for name in ("name", "tier", *self.LIMITS)}


class MonthForm(forms.Form):
    """A UTC month to draft invoices for or to reconcile."""

    period = _month_input("Month")

    def clean_period(self) -> dt.date | None:
        return _clean_month(self.cleaned_data["period"])


class VoidForm(forms.Form):
    reason = forms.CharField(
        label="Why is it void?",
        max_length=VOID_REASON_MAX_LENGTH,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text="Kept on the invoice.",
    )


class ReissueForm(forms.Form):
    reason = forms.CharField(
        label="Reason",
        required=False,
        max_length=VOID_REASON_MAX_LENGTH,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text="Kept on the voided invoice; empty: “reissued”.",
    )


class InvoiceFilterForm(forms.Form):
    status = forms.ChoiceField(label="State", choices=[("", "All"), *Invoice.Status.choices], required=False)
    period = _month_input("Month", required=False)
    organization = forms.CharField(label="Organisation", required=False, max_length=100)

    def clean_period(self) -> dt.date | None:
        return _clean_month(self.cleaned_data["period"])


def _price(label: str, *, required: bool = True) -> forms.DecimalField:
    return forms.DecimalField(
        label=label,
        required=required,
        min_value=Decimal(0),
        max_digits=PRICE_MAX_DIGITS,
        decimal_places=PRICE_DECIMAL_PLACES,
    )


class PriceForm(forms.Form):
    """A model's (or one version's) prices from a moment on: per million tokens, per thousand
    inferences (small models) and what a batch line pays of them."""

    model = forms.ChoiceField(label="Model")
    version = forms.CharField(
        label="Version", required=False, max_length=50, help_text="Empty: every version without a price of its own."
    )
    input_per_million = _price("Input per 1M tokens")
    output_per_million = _price("Output per 1M tokens")
    cached_input_per_million = _price("Cached input per 1M tokens", required=False)
    per_thousand_inferences = _price("Per 1k inferences", required=False)
    cached_per_thousand_inferences = _price("Cached per 1k inferences", required=False)
    batch_percent = forms.DecimalField(
        label="Batch price (%)",
        min_value=Decimal(0),
        max_value=Decimal(100),
        decimal_places=2,
        initial=Decimal(50),
        help_text="What a batch job's line pays of each price: 50 is half price.",
    )
    currency = forms.CharField(label="Currency", max_length=3, min_length=3)
    effective_from = forms.DateTimeField(
        label="Effective from (UTC)",
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
        input_formats=["%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S"],
        help_text="Empty: now.",
    )

    def __init__(self, *args: Any, models: list[str], currency: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        model = self.fields["model"]
        assert isinstance(model, forms.ChoiceField)
        model.choices = [(name, name) for name in models]
        self.fields["currency"].initial = currency
        self.fields["cached_input_per_million"].help_text = "Empty: the input price."
        self.fields["per_thousand_inferences"].help_text = "Small models (classifiers): empty is free."
        self.fields["cached_per_thousand_inferences"].help_text = "Empty: the per 1k inferences price."

    def clean_per_thousand_inferences(self) -> Decimal:
        value: Decimal | None = self.cleaned_data["per_thousand_inferences"]
        return Decimal(0) if value is None else value

    def clean_effective_from(self) -> dt.datetime | None:
        """Taken as UTC, whatever the server's time zone."""
        moment: dt.datetime | None = self.cleaned_data["effective_from"]
        if moment is None:
            return None
        return moment.replace(tzinfo=dt.UTC) if moment.tzinfo is None else moment.astimezone(dt.UTC)


class PriceFilterForm(forms.Form):
    model = forms.CharField(label="Model", required=False, max_length=100)
    ended = forms.BooleanField(label="Include ended prices", required=False)


class ReconciliationFilterForm(forms.Form):
    result = forms.ChoiceField(
        label="Result", required=False, choices=[("", "All"), ("ok", "Agree"), ("mismatch", "Mismatch")]
    )
