"""The customer portal: API keys, usage and cost, budgets, invoices.

Who may do what follows the management API (accounts/api.py, billing/api_usage.py): every member
of the organisation sees its usage and its keys (never a secret); its admins create,
rotate and revoke keys. Invoices are for its admins here. A key's secret is shown once,
in the answer to the request that made it, and is never stored (not in the session
either): that answer is not cacheable, and reloading it does not show the secret again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.conf import settings
from django.contrib import messages
from django.db.models import Q, QuerySet
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import URLPattern, URLResolver, path, reverse
from django.utils import timezone
from django.utils.http import content_disposition_header
from django.views.decorators.http import require_GET, require_http_methods

from accounts.models import ApiKey
from accounts.selectors import api_keys_of, plan_key_ceilings
from accounts.services import organization_update
from billing import invoicing
from billing.models import Invoice
from billing.usage_selectors import cache_by_model, cache_hits_by_tier, usage_by_key
from console.pages import org_scoped
from console.pages.access import ORG_ADMIN_ROLES, OrgRequest, org_member_required
from console.pages.cache import quality_context
from console.pages.invoice_lines import invoice_lines_context
from console.pages.key_limits import key_limits
from console.pages.lists import page_of, query_without_page
from console.pages.nav import PORTAL, NavItem
from console.pages.portal_forms import (
    DEFAULT_RANGE,
    GROUP_CHOICES,
    USAGE_RANGES,
    ApiKeyCreateForm,
    ApiKeyEditForm,
    ApiKeyFilterForm,
    InvoiceFilterForm,
    UsageWindowForm,
)
from console.pages.portal_usage import (
    budget_status,
    by_key,
    by_model,
    daily_usage,
    figures,
    money_text,
    month_preview,
    totals_of,
    usage_csv,
)
from core.errors import InvalidInput
from serving.semcache.selectors import cache_quality

KEYS_PER_PAGE = 25
INVOICES_PER_PAGE = 25


def _is_admin(request: OrgRequest) -> bool:
    return request.org_role in ORG_ADMIN_ROLES


# --- Usage -----------------------------------------------------------------------------


@dataclass(frozen=True)
class UsageQuery:
    """What the usage page and its CSV show: UTC days ``start`` to ``end`` (both included),
    named by ``range`` (a preset, or "custom"), one key or all, per model or per key."""

    form: UsageWindowForm
    start: date
    end: date
    range: str
    api_key_id: int | None
    group: str
    keys: dict[int, ApiKey]

    @property
    def range_label(self) -> str:
        return next((r.label for r in USAGE_RANGES if r.key == self.range), "Custom range")

    def query(self, **changes: str) -> str:
        """This query string with ``changes`` (a preset link drops the days, the days a preset)."""
        values: dict[str, str] = {"start": str(self.start), "end": str(self.end), "group": self.group}
        if self.api_key_id is not None:
            values["api_key"] = str(self.api_key_id)
        if "range" in changes:
            del values["start"], values["end"]
        values.update(changes)
        return urlencode({k: v for k, v in values.items() if v and not (k == "group" and v == "model")})


def _usage_query(request: OrgRequest) -> UsageQuery:
    """The window asked for; the last 30 UTC days, all keys, per model by default and while
    the form has errors (which it shows)."""
    today = timezone.now().date()  # UTC: rollup days are UTC days
    keys = {key.pk: key for key in api_keys_of(organization_id=request.organization.pk)}
    choices = [(key.pk, f"{key.name} ({key.masked})") for key in keys.values()]
    form = UsageWindowForm(request.GET or None, keys=choices, today=today)
    if form.is_bound and form.is_valid():
        data = form.cleaned_data
        # The form shown again holds the days shown, to adjust them from there.
        shown = UsageWindowForm(
            initial={"start": data["start"], "end": data["end"], "api_key": data["api_key"], "group": data["group"]},
            keys=choices,
            today=today,
        )
        return UsageQuery(shown, data["start"], data["end"], data["range"], data["api_key"], data["group"], keys)
    start, end = next(r for r in USAGE_RANGES if r.key == DEFAULT_RANGE).days(today)
    if not form.is_bound:
        form = UsageWindowForm(initial={"start": start, "end": end}, keys=choices, today=today)
    group = form.cleaned_data.get("group", "model") if form.is_bound else "model"
    return UsageQuery(form, start, end, DEFAULT_RANGE, None, group, keys)


@org_member_required()
def usage(request: OrgRequest, org_id: int) -> HttpResponse:
    """Usage and cost per model or key over a window, totals, the month's budget status and
    (for admins) the month's invoice so far."""
    organization = request.organization
    now = timezone.now()
    asked = _usage_query(request)
    start, end = asked.start, asked.end
    per_key = asked.group == "key"
    rows = daily_usage(
        organization_id=organization.pk, start=start, end=end, api_key_id=asked.api_key_id, by_key=per_key
    )
    currency = str(settings.BILLING_CURRENCY)
    cached = cache_by_model(organization_id=organization.pk, start=start, end=end)
    since, until = (datetime.combine(day, time.min, UTC) for day in (start, end + timedelta(days=1)))
    hits = cache_hits_by_tier(since=since, until=until, organization_id=organization.pk)
    own_budget = organization.cache_wrong_hit_budget
    quality = quality_context(
        cache_quality(models=set(cached) | set(hits), organization_id=organization.pk),
        hits=hits,
        own_budget=None if own_budget is None else float(own_budget) / 100,
    )
    for row in quality["quality"]:
        row["hits"], saved = cached.get(row["model"], (0, Decimal(0)))
        row["saved"] = money_text(saved)
    key_rows = by_key(rows, asked.keys) if per_key else []
    labels = {row.api_key_id: row.label for row in key_rows} if per_key else None
    context = {
        **quality,
        "own_reports": True,
        "tier_window": f"{start.isoformat()} to {end.isoformat()}, UTC",
        "cache_budget_form": CacheBudgetForm(initial={"cache_wrong_hit_budget": organization.cache_wrong_hit_budget})
        if _is_admin(request)
        else None,
        "organization": organization,
        "form": asked.form,
        "asked": asked,
        "start": start,
        "end": end,
        "ranges": [(r, asked.query(range=r.key)) for r in USAGE_RANGES],
        "groups": [(key, label, asked.query(group=key)) for key, label in GROUP_CHOICES],
        "totals": totals_of(rows),
        "models": by_model(rows),
        "key_rows": key_rows,
        "figures": figures(rows, start=start, end=end, currency=currency, keys=labels),
        "budget": budget_status(organization=organization, today=now.date()),
        "preview": month_preview(organization=organization, now=now) if _is_admin(request) else None,
        "currency": currency,
        "usage_api": f"/api/orgs/{organization.pk}/usage/?start_date={start}&end_date={end}",
        "csv_query": asked.query(),
    }
    return render(request, "console/portal/usage.html", context)


@org_member_required()
@require_GET
def usage_download(request: OrgRequest, org_id: int) -> HttpResponse:
    """The usage window as CSV, per UTC day, model and key; a window that does not parse is a
    400 that says why (never another window than the one asked for)."""
    asked = _usage_query(request)
    if asked.form.is_bound and asked.form.errors:
        problems = "; ".join(f"{field}: {' '.join(map(str, errors))}" for field, errors in asked.form.errors.items())
        return HttpResponse(f"No CSV for this window: {problems}\n", status=400, content_type="text/plain")
    start, end = asked.start, asked.end
    rows = daily_usage(organization_id=request.organization.pk, start=start, end=end, api_key_id=asked.api_key_id,
                       by_key=True)  # fmt: skip
    body = usage_csv(rows, currency=str(settings.BILLING_CURRENCY), keys=asked.keys)
    response = HttpResponse(body, content_type="text/csv")
    filename = f"usage-{request.organization.slug}-{start}-{end}.csv"
    response["Content-Disposition"] = content_disposition_header(True, filename) or "attachment"
    return response


# --- API keys --------------------------------------------------------------------------


def key_state(api_key: ApiKey) -> str:
    if not api_key.is_active:
        return "revoked"
    if api_key.expires_at is not None and api_key.expires_at <= timezone.now():
        return "expired"
    if api_key.rotated_to_id is not None:
        return "rotated"
    return "active"


def _edit_form(request: OrgRequest, api_key: ApiKey, data: Any = None) -> ApiKeyEditForm:
    initial = {name: getattr(api_key, name) for name in ("name", *ApiKeyEditForm.LIMITS)}
    return ApiKeyEditForm(
        data, initial=initial, ceilings=plan_key_ceilings(organization=request.organization),
        currency=str(settings.BILLING_CURRENCY), prefix=f"key-{api_key.pk}",
    )  # fmt: skip


@org_member_required()
def keys(request: OrgRequest, org_id: int) -> HttpResponse:
    return _keys_page(request)


def _keys_page(request: OrgRequest, refused: ApiKeyEditForm | None = None, refused_key: int = 0) -> HttpResponse:
    """The organisation's keys; each opens a drawer with its dates, limits and (org admins) an
    edit form. ``refused``: a refused edit of ``refused_key``, whose drawer opens with its errors."""
    organization = request.organization
    found = api_keys_of(organization_id=organization.pk)
    form = ApiKeyFilterForm(request.GET or None)
    if form.is_valid():
        if text := form.cleaned_data["q"].strip():
            found = found.filter(Q(name__icontains=text) | Q(prefix__startswith=text))
        if form.cleaned_data["state"] == "active":
            found = found.filter(is_active=True).exclude(expires_at__lte=timezone.now())
        elif form.cleaned_data["state"] == "revoked":
            found = found.filter(is_active=False)
    page = page_of(request, found, KEYS_PER_PAGE)
    today = timezone.now().astimezone(UTC).date()
    used = usage_by_key(api_key_ids=[key.pk for key in page.object_list], start=today.replace(day=1), end=today)
    limits = key_limits(page.object_list, organization=organization)
    manage = _is_admin(request)
    rows = [
        {"key": key, "state": key_state(key), "used": used[key.pk], "limits": limits[key.pk],
         "edit": (refused if key.pk == refused_key and refused else _edit_form(request, key))
         if manage and key.is_active else None,
         "refused": "key" if key.pk == refused_key else ""}
        for key in page.object_list
    ]  # fmt: skip
    context = {
        "organization": organization,
        "month": today.replace(day=1),
        "form": form,
        "page": page,
        "rows": rows,
        "can_manage": manage,
        "query": query_without_page(request),
        "currency": settings.BILLING_CURRENCY,
    }
    return render(request, "console/portal/keys.html", context, status=400 if refused else 200)


@org_member_required(admin=True)
@require_http_methods(["GET", "POST"])
def key_create(request: OrgRequest, org_id: int) -> HttpResponse:
    organization = request.organization
    form = ApiKeyCreateForm(
        request.POST or None,
        ceilings=plan_key_ceilings(organization=organization),
        currency=str(settings.BILLING_CURRENCY),
    )
    return org_scoped.key_create(request, org_scoped.PORTAL, organization, form, title="Your new API key")


def _key_of(request: OrgRequest, key_id: int) -> ApiKey:
    organization = request.organization
    return get_object_or_404(api_keys_of(organization_id=organization.pk), pk=key_id)


@org_member_required(admin=True)
@require_http_methods(["POST"])
def key_edit(request: OrgRequest, org_id: int, key_id: int) -> HttpResponse:
    """A key's name and limits, within the plan (from its drawer on the keys page); gateways
    apply them within a second. A refusal reopens the drawer with its errors."""
    api_key = _key_of(request, key_id)
    if not api_key.is_active:
        messages.error(request, f"API key {api_key.name!r} is revoked: it cannot be changed.")
        return redirect("console:portal-keys", org_id=org_id)
    form = _edit_form(request, api_key, request.POST)
    if form.is_valid():
        saved = org_scoped.key_saved(request, org_scoped.PORTAL, request.organization, api_key, form)
        if saved is not None:
            return saved
    return _keys_page(request, refused=form, refused_key=api_key.pk)


@org_member_required(admin=True)
@require_http_methods(["GET", "POST"])
def key_revoke(request: OrgRequest, org_id: int, key_id: int) -> HttpResponse:
    return org_scoped.key_revoke(request, org_scoped.PORTAL, request.organization, _key_of(request, key_id))


@org_member_required(admin=True)
@require_http_methods(["GET", "POST"])
def key_rotate(request: OrgRequest, org_id: int, key_id: int) -> HttpResponse:
    return org_scoped.key_rotate(
        request, org_scoped.PORTAL, request.organization, _key_of(request, key_id), title="Your rotated API key"
    )


class CacheBudgetForm(forms.Form):
    cache_wrong_hit_budget = forms.DecimalField(
        label="Your wrong-hit budget (%)", required=False, min_value=Decimal(0), max_value=Decimal(100),
        decimal_places=2, help_text="the stricter of this and each model's budget applies to your requests; "
                                    "empty: each model's",
    )  # fmt: skip


@org_member_required(admin=True)
@require_http_methods(["POST"])
def cache_budget(request: OrgRequest, org_id: int) -> HttpResponse:
    """An organisation's admins set the share of wrong cache hits they accept."""
    form = CacheBudgetForm(request.POST)
    if form.is_valid():
        value = form.cleaned_data["cache_wrong_hit_budget"]
        try:
            organization_update(organization=request.organization, actor=request.user, cache_wrong_hit_budget=value)
        except InvalidInput as exc:
            messages.error(request, exc.message)
        else:
            shown = "each model's budget" if value is None else f"{value.normalize():f} %"
            messages.success(request, f"Cache wrong-hit budget set: {shown}; it applies to your next requests.")
    else:
        messages.error(request, " ".join(str(e) for errors in form.errors.values() for e in errors))
    return redirect(f"{reverse('console:portal-usage', kwargs={'org_id': org_id})}#cache-quality-section")


# --- Invoices --------------------------------------------------------------------------


def _invoices(request: OrgRequest) -> QuerySet[Invoice]:
    return invoicing.invoices_of(organization=request.organization)


@org_member_required(admin=True)
def invoices(request: OrgRequest, org_id: int) -> HttpResponse:
    found = _invoices(request).order_by("-period", "-number")
    form = InvoiceFilterForm(request.GET or None)
    if form.is_valid() and form.cleaned_data["status"]:
        found = found.filter(status=form.cleaned_data["status"])
    page = page_of(request, found, INVOICES_PER_PAGE)
    today = timezone.now().astimezone(UTC).date()
    context = {
        "organization": request.organization,
        "form": form,
        "page": page,
        "rows": [
            {
                "invoice": i,
                "number": invoicing.display_number(i),
                "payment": invoicing.payment(i, today=today),
                "bill_to": i.billed_name or request.organization.name,
            }
            for i in page.object_list
        ],
        "query": query_without_page(request),
    }
    return render(request, "console/portal/invoices.html", context)


def _invoice_of(request: OrgRequest, invoice_id: int) -> Invoice:
    return get_object_or_404(_invoices(request), pk=invoice_id)


@org_member_required(admin=True)
def invoice_detail(request: OrgRequest, org_id: int, invoice_id: int) -> HttpResponse:
    invoice = _invoice_of(request, invoice_id)
    context = {
        "organization": request.organization,
        "invoice": invoice,
        "number": invoicing.display_number(invoice),
        "payment": invoicing.payment(invoice, today=timezone.now().astimezone(UTC).date()),
        **invoice_lines_context(invoice),
    }
    return render(request, "console/portal/invoice_detail.html", context)


@org_member_required(admin=True)
def invoice_download(request: OrgRequest, org_id: int, invoice_id: int, kind: str) -> HttpResponse:
    return org_scoped.invoice_document(_invoice_of(request, invoice_id), kind)


P = "portal/<int:org_id>/"
urlpatterns: list[URLPattern | URLResolver] = [
    path(P, usage, name="portal-usage"),
    path(f"{P}usage.csv", usage_download, name="portal-usage-csv"),
    path(f"{P}cache-budget/", cache_budget, name="portal-cache-budget"),
    path(f"{P}keys/", keys, name="portal-keys"),
    path(f"{P}keys/new/", key_create, name="portal-key-create"),
    path(f"{P}keys/<int:key_id>/edit/", key_edit, name="portal-key-edit"),
    path(f"{P}keys/<int:key_id>/revoke/", key_revoke, name="portal-key-revoke"),
    path(f"{P}keys/<int:key_id>/rotate/", key_rotate, name="portal-key-rotate"),
    path(f"{P}invoices/", invoices, name="portal-invoices"),
    path(f"{P}invoices/<int:invoice_id>/", invoice_detail, name="portal-invoice"),
    path(f"{P}invoices/<int:invoice_id>/pdf/", invoice_download, {"kind": "pdf"}, name="portal-invoice-pdf"),
    path(f"{P}invoices/<int:invoice_id>/csv/", invoice_download, {"kind": "csv"}, name="portal-invoice-csv"),
]
NAV: list[NavItem] = [
    NavItem("Usage", "portal-usage", PORTAL),
    NavItem("API keys", "portal-keys", PORTAL),
    NavItem("Invoices", "portal-invoices", PORTAL, admin_only=True),
]
