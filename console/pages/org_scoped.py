"""Views of one organisation's keys and invoices, written once for both places that show them:
the console (a platform admin, any organisation) and the portal (an org admin, their own).

A ``Scope`` says where: which templates (each audience reads its own words and styles) and
where to go back to. The callers check who may act (``platform_admin_required``,
``org_member_required``) and find the organisation; the writes are ``accounts.services``'.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse

from accounts.models import ApiKey, Organization
from accounts.services import IssuedApiKey, api_key_create, api_key_revoke, api_key_rotate, api_key_update
from billing.invoice_documents import invoice_csv, invoice_filename, invoice_pdf
from billing.models import Invoice
from console.pages.key_limits import key_limits
from console.pages.lists import attachment, never_stored, refuse
from console.pages.portal_forms import ApiKeyRotateForm, KeyForm
from core.errors import InvalidInput


@dataclass(frozen=True)
class Scope:
    templates: str  # the folder of this audience's templates
    keys_page: str  # the URL name of the page listing the organisation's keys
    keys_anchor: str = ""

    def keys_url(self, organization: Organization) -> str:
        url = reverse(f"console:{self.keys_page}", kwargs={"org_id": organization.pk})
        return f"{url}#{self.keys_anchor}" if self.keys_anchor else url


CONSOLE = Scope(templates="console/customers", keys_page="customer", keys_anchor="keys")
PORTAL = Scope(templates="console/portal", keys_page="portal-keys")


def secret_shown_once(
    request: HttpRequest, scope: Scope, organization: Organization, issued: IssuedApiKey, **context: Any
) -> HttpResponse:
    """The one answer that carries a key's secret: rendered here, kept nowhere, never cached."""
    limits = key_limits([issued.api_key], organization=organization)[issued.api_key.pk]
    context = {"organization": organization, "issued": issued, "limits": limits, **context}
    return never_stored(render(request, f"{scope.templates}/key_secret.html", context))


def key_create(
    request: HttpRequest,
    scope: Scope,
    organization: Organization,
    form: KeyForm,
    *,
    page: dict[str, Any] | None = None,
    **secret_context: Any,
) -> HttpResponse:
    """GET: the form. POST: create the key (``form.values()``: its name, tier and limits) and
    show its secret once (``secret_context``); a refusal is shown on the field it names.
    ``page``: what the form's template needs besides the organisation and the form."""
    if request.method == "POST" and form.is_valid():
        try:
            issued = api_key_create(organization=organization, actor=request.user, **form.values())
        except InvalidInput as exc:
            refuse(form, exc)
        else:
            messages.success(request, f"API key {issued.api_key.name!r} created.")
            return secret_shown_once(request, scope, organization, issued, **secret_context)
    context = {"organization": organization, "form": form, **(page or {})}
    return render(request, f"{scope.templates}/key_form.html", context)


def key_saved(
    request: HttpRequest, scope: Scope, organization: Organization, api_key: ApiKey, form: KeyForm
) -> HttpResponse | None:
    """Save a valid edit of ``api_key`` (``form.values()`` against ``form.initial``: only what
    changed) and answer with the keys page; None when the service refused it (shown on the
    field it names: the caller renders the form again)."""
    changes = {name: value for name, value in form.values().items() if value != form.initial.get(name)}
    if not changes:
        messages.info(request, f"API key {api_key.name!r}: nothing changed.")
        return redirect(scope.keys_url(organization))
    try:
        api_key_update(api_key=api_key, actor=request.user, **changes)
    except InvalidInput as exc:
        refuse(form, exc)
        return None
    messages.success(request, f"API key {api_key.name!r} saved: {', '.join(sorted(changes))} changed.")
    return redirect(scope.keys_url(organization))


def key_revoke(request: HttpRequest, scope: Scope, organization: Organization, api_key: ApiKey) -> HttpResponse:
    """GET: are you sure? POST: revoke (refused by every gateway within a second)."""
    if request.method == "POST":
        if api_key.is_active:
            api_key_revoke(api_key=api_key, actor=request.user)
            messages.success(request, f"API key {api_key.name!r} ({api_key.prefix}…) revoked.")
        else:
            messages.info(request, f"API key {api_key.name!r} was revoked already.")
        return redirect(scope.keys_url(organization))
    context = {"organization": organization, "api_key": api_key}
    return render(request, f"{scope.templates}/key_revoke.html", context)


def key_rotate(
    request: HttpRequest, scope: Scope, organization: Organization, api_key: ApiKey, **secret_context: Any
) -> HttpResponse:
    """GET: how long the old key keeps working. POST: a new key with the same grants, its
    secret shown once (``secret_context``: what that page needs besides the key)."""
    form = ApiKeyRotateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            issued = api_key_rotate(
                api_key=api_key, grace=timedelta(seconds=form.cleaned_data["grace_seconds"]), actor=request.user
            )
        except InvalidInput as exc:
            refuse(form, exc)
        except ValueError as exc:  # revoked, expired or rotated already
            messages.error(request, f"API key {api_key.name!r} cannot be rotated: {exc}.")
            return redirect(scope.keys_url(organization))
        else:
            messages.success(request, f"API key {api_key.name!r} rotated.")
            return secret_shown_once(request, scope, organization, issued, **secret_context)
    context = {"organization": organization, "api_key": api_key, "form": form}
    return render(request, f"{scope.templates}/key_rotate.html", context)


def invoice_document(invoice: Invoice, kind: str) -> HttpResponse:
    """An invoice as a file to download: ``pdf`` or ``csv``."""
    filename = invoice_filename(invoice, kind)
    if kind == "pdf":
        return attachment(invoice_pdf(invoice), content_type="application/pdf", filename=filename)
    return attachment(invoice_csv(invoice), content_type="text/csv; charset=utf-8", filename=filename)
