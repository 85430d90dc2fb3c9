"""The console's customers: organisations, their plans, members and API keys, budgets and usage.

Platform admins only. Each form posts to its own URL, which calls the same service as the
management API (``billing.services``, ``actor=request.user``) and redirects back; refused,
the page is rendered again with the form's errors. A key's secret is shown once, in the
answer to the request that made it, and is never stored. Invoices, prices and
reconciliation: ``console.pages.customer_billing``.
"""

from __future__ import annotations

from datetime import timedelta

from django import forms
from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import URLPattern, URLResolver, path, reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts.models import ApiKey, Organization, Role
from accounts.selectors import api_keys_of, membership_of, memberships_of, organizations_listed, user_named
from accounts.services import (
    KEY_DEFAULTS,
    membership_remove,
    membership_set,
    organization_create,
    organization_update,
)
from billing import invoicing
from billing.usage_selectors import cost_by_organization
from console.pages import customer_billing, org_scoped
from console.pages.access import platform_admin_required
from console.pages.customer_forms import (
    ApiKeyForm,
    MemberForm,
    MemberRemoveForm,
    OrganizationFilterForm,
    OrganizationForm,
)
from console.pages.key_limits import key_limits
from console.pages.lists import page_of, query_without_page, refuse
from console.pages.nav import CONSOLE, NavItem
from console.pages.portal import key_state
from console.pages.portal_usage import (
    budget_status,
    by_model,
    daily_usage,
    figures,
    limit_text,
    money_text,
    totals_of,
)
from core.errors import InvalidInput

ORGANIZATIONS_PER_PAGE = 25
MEMBERS_PER_PAGE = 25
KEYS_PER_PAGE = 25
USAGE_DAYS = 30


def _currency() -> str:
    return str(settings.BILLING_CURRENCY)


def _organization_or_404(org_id: int) -> Organization:
    return get_object_or_404(Organization, pk=org_id)


def _back_to(organization: Organization, anchor: str = "") -> HttpResponse:
    url = reverse("console:customer", kwargs={"org_id": organization.pk})
    return redirect(f"{url}#{anchor}" if anchor else url)


# --- Organisations ---------------------------------------------------------------------


def _listing(request: HttpRequest, create_form: OrganizationForm | None = None) -> HttpResponse:
    form = OrganizationFilterForm(request.GET or None)
    q, tier = "", ""
    if form.is_valid():
        q, tier = form.cleaned_data["q"].strip(), form.cleaned_data["tier"]
    page = page_of(request, organizations_listed(q=q, tier=tier), ORGANIZATIONS_PER_PAGE)
    organizations = list(page.object_list)
    today = timezone.now().date()
    month = invoicing.month_start(today)
    spent = cost_by_organization(organization_ids=[o.pk for o in organizations], start=month, end=today)
    rows = []
    for organization in organizations:
        cap = organization.monthly_spend_cap
        used = spent[organization.pk]
        rows.append(
            {
                "organization": organization,
                "spent": money_text(used),
                "cap": limit_text(cap) if cap is not None else None,
                "percent": min(999, int(used * 100 / cap)) if cap else None,
            }
        )
    context = {
        "form": form,
        "page": page,
        "rows": rows,
        "query": query_without_page(request),
        "create_form": create_form or OrganizationForm(currency=_currency(), prefix="new"),
        "month": invoicing.period_label(month),
        "currency": _currency(),
    }
    return render(request, "console/customers/list.html", context)


@platform_admin_required
@require_GET
def customers(request: HttpRequest) -> HttpResponse:
    """Organisations with their members, keys and this month's spend against the cap."""
    return _listing(request)


@platform_admin_required
@require_POST
def customer_create(request: HttpRequest) -> HttpResponse:
    form = OrganizationForm(request.POST, currency=_currency(), prefix="new")
    if form.is_valid():
        try:
            organization = organization_create(actor=request.user, **form.values())
        except InvalidInput as exc:
            refuse(form, exc, {"tax_rate": "tax_percent"})
        else:
            messages.success(request, f"Organisation {organization.name!r} created.")
            return _back_to(organization)
    messages.error(request, "The organisation was not created: see the errors below.")
    return _listing(request, create_form=form)


# --- One organisation ------------------------------------------------------------------


def _detail(
    request: HttpRequest, organization: Organization, refused: dict[str, forms.Form] | None = None
) -> HttpResponse:
    refused = refused or {}
    today = timezone.now().date()
    start = today - timedelta(days=USAGE_DAYS - 1)
    rows = daily_usage(organization_id=organization.pk, start=start, end=today)
    members = page_of(request, memberships_of(organization_id=organization.pk), MEMBERS_PER_PAGE, "members_page")
    keys = page_of(request, api_keys_of(organization_id=organization.pk), KEYS_PER_PAGE, "keys_page")
    limits = key_limits(keys.object_list, organization=organization)
    all_figures = figures(rows, start=start, end=today, currency=_currency())
    context = {
        "organization": organization,
        "settings_form": refused.get("settings")
        or OrganizationForm(initial=OrganizationForm.initial_from(organization), currency=_currency()),
        "member_form": refused.get("member") or MemberForm(prefix="member"),
        "members": members,
        "roles": Role.choices,
        "keys": keys,
        "members_query": query_without_page(request, "members_page"),
        "keys_query": query_without_page(request, "keys_page"),
        "key_rows": [{"key": key, "state": key_state(key), "limits": limits[key.pk]} for key in keys.object_list],
        "budget": budget_status(organization=organization, today=today),
        "totals": totals_of(rows),
        "models": by_model(rows),
        "figures": {"cost": all_figures["cost"]},
        "start": start,
        "end": today,
        "currency": _currency(),
    }
    return render(request, "console/customers/detail.html", context)


@platform_admin_required
@require_GET
def customer(request: HttpRequest, org_id: int) -> HttpResponse:
    """An organisation's plan, members, keys, budget, usage, and links to its portal."""
    return _detail(request, _organization_or_404(org_id))


def _refused_detail(request: HttpRequest, organization: Organization, name: str, form: forms.Form) -> HttpResponse:
    messages.error(request, "Not saved: see the errors below.")
    return _detail(request, organization, {name: form})


@platform_admin_required
@require_POST
def customer_settings(request: HttpRequest, org_id: int) -> HttpResponse:
    organization = _organization_or_404(org_id)
    form = OrganizationForm(request.POST, currency=_currency())
    if form.is_valid():
        try:
            organization_update(organization=organization, actor=request.user, **form.values())
        except InvalidInput as exc:
            organization.refresh_from_db()
            refuse(form, exc, {"tax_rate": "tax_percent"})
        else:
            messages.success(request, f"Settings of {organization.name!r} saved; gateways apply them within a second.")
            return _back_to(organization, "settings")
    return _refused_detail(request, organization, "settings", form)


@platform_admin_required
@require_POST
def member_set(request: HttpRequest, org_id: int) -> HttpResponse:
    """Add an existing user with a role, or change a member's role."""
    organization = _organization_or_404(org_id)
    form = MemberForm(request.POST, prefix="member")
    if form.is_valid():
        username, role = form.cleaned_data["username"].strip(), form.cleaned_data["role"]
        user = user_named(username=username)
        if user is None:
            form.add_error("username", "No user has this username.")
        else:
            existed = membership_of(organization_id=organization.pk, username=username) is not None
            try:
                membership = membership_set(user=user, organization=organization, role=role, actor=request.user)
            except InvalidInput as exc:
                refuse(form, exc)
            else:
                what = "now" if existed else "added as"
                messages.success(
                    request, f"{username} is {what} {membership.get_role_display()} of {organization.name}."
                )
                return _back_to(organization, "members")
    return _refused_detail(request, organization, "member", form)


@platform_admin_required
@require_http_methods(["GET", "POST"])
def member_remove(request: HttpRequest, org_id: int) -> HttpResponse:
    """GET ?username=: are you sure? POST: remove the member."""
    organization = _organization_or_404(org_id)
    form = MemberRemoveForm(request.POST if request.method == "POST" else request.GET)
    if not form.is_valid():
        messages.error(request, "Choose a member to remove.")
        return _back_to(organization, "members")
    membership = membership_of(organization_id=organization.pk, username=form.cleaned_data["username"])
    if membership is None:
        messages.info(request, f"{form.cleaned_data['username']} is not a member of {organization.name}.")
        return _back_to(organization, "members")
    if request.method == "POST":
        membership_remove(membership=membership, actor=request.user)
        messages.success(request, f"{membership.user.get_username()} removed from {organization.name}.")
        return _back_to(organization, "members")
    context = {"organization": organization, "membership": membership, "form": form}
    return render(request, "console/customers/member_remove.html", context)


# --- API keys --------------------------------------------------------------------------


def _key_of(organization: Organization, key_id: int) -> ApiKey:
    return get_object_or_404(api_keys_of(organization_id=organization.pk), pk=key_id)


@platform_admin_required
@require_http_methods(["GET", "POST"])
def key_create(request: HttpRequest, org_id: int) -> HttpResponse:
    """A key with its tier and limits (a platform admin may go beyond the plan)."""
    organization = _organization_or_404(org_id)
    initial = {"tier": organization.tier, **{name: KEY_DEFAULTS[name] for name in ApiKeyForm.LIMITS}}
    form = ApiKeyForm(request.POST or None, initial=initial, currency=_currency())
    return org_scoped.key_create(
        request, org_scoped.CONSOLE, organization, form,
        page={"title": "Create an API key", "button": "Create key"}, title="New API key", currency=_currency(),
    )  # fmt: skip


@platform_admin_required
@require_http_methods(["GET", "POST"])
def key_edit(request: HttpRequest, org_id: int, key_id: int) -> HttpResponse:
    """A key's name, tier and limits; gateways apply them within a second."""
    organization = _organization_or_404(org_id)
    api_key = _key_of(organization, key_id)
    initial = {name: getattr(api_key, name) for name in ("name", "tier", *ApiKeyForm.LIMITS)}
    form = ApiKeyForm(request.POST or None, initial=initial, currency=_currency())
    if request.method == "POST" and form.is_valid():
        saved = org_scoped.key_saved(request, org_scoped.CONSOLE, organization, api_key, form)
        if saved is not None:
            return saved
    context = {
        "organization": organization,
        "form": form,
        "api_key": api_key,
        "title": f"Edit API key {api_key.name}",
        "button": "Save key",
    }
    return render(request, "console/customers/key_form.html", context)


@platform_admin_required
@require_http_methods(["GET", "POST"])
def key_revoke(request: HttpRequest, org_id: int, key_id: int) -> HttpResponse:
    organization = _organization_or_404(org_id)
    return org_scoped.key_revoke(request, org_scoped.CONSOLE, organization, _key_of(organization, key_id))


@platform_admin_required
@require_http_methods(["GET", "POST"])
def key_rotate(request: HttpRequest, org_id: int, key_id: int) -> HttpResponse:
    organization = _organization_or_404(org_id)
    return org_scoped.key_rotate(
        request, org_scoped.CONSOLE, organization, _key_of(organization, key_id),
        title="Rotated API key", currency=_currency(),
    )  # fmt: skip


C = "console/customers/<int:org_id>/"
urlpatterns: list[URLPattern | URLResolver] = [
    path("console/customers/", customers, name="customers"),
    path("console/customers/new/", customer_create, name="customer-create"),
    path(C, customer, name="customer"),
    path(f"{C}settings/", customer_settings, name="customer-settings"),
    path(f"{C}members/", member_set, name="customer-member-set"),
    path(f"{C}members/remove/", member_remove, name="customer-member-remove"),
    path(f"{C}keys/new/", key_create, name="customer-key-create"),
    path(f"{C}keys/<int:key_id>/", key_edit, name="customer-key-edit"),
    path(f"{C}keys/<int:key_id>/revoke/", key_revoke, name="customer-key-revoke"),
    path(f"{C}keys/<int:key_id>/rotate/", key_rotate, name="customer-key-rotate"),
    *customer_billing.urlpatterns,
]
NAV: list[NavItem] = [
    NavItem("Customers", "customers", CONSOLE),
    *customer_billing.NAV,
]
