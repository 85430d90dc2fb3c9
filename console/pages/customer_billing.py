"""The console's money pages: invoices (draft, refresh, finalize, pay, void, reissue, download),
prices per model and version, and reconciliation runs.

Platform admins only. Every invoice move goes through its guarded service
(``billing.services.invoices``); a move the invoice's state does not allow comes back as
a message naming both states, and nothing changes.
"""

from __future__ import annotations

from datetime import UTC, timedelta
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import URLPattern, URLResolver, path
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from accounts.models import Organization
from billing import invoicing
from billing.models import Invoice
from billing.reconciliation import reconcile_month
from billing.selectors import invoice_get, invoices_listed, price_get, prices_listed, reconciliations_latest
from billing.services import (
    InvoiceFrozen,
    invoice_deletable,
    invoice_delete_draft,
    invoice_draft,
    invoice_finalize,
    invoice_mark_paid,
    invoice_refresh,
    invoice_reissue,
    invoice_void,
    price_end,
    price_set,
)
from billing.services.prices import PRICE_FIELDS
from billing.usage_selectors import unpriced_usage
from console.pages import org_scoped
from console.pages.access import platform_admin_required
from console.pages.customer_forms import (
    InvoiceFilterForm,
    MonthForm,
    PriceFilterForm,
    PriceForm,
    ReconciliationFilterForm,
    ReissueForm,
    VoidForm,
)
from console.pages.invoice_lines import invoice_lines_context
from console.pages.lists import page_of, query_without_page, refuse
from console.pages.nav import CONSOLE, NavItem
from core import formats
from core.errors import InvalidInput
from core.transitions import IllegalTransition
from registry.models import Task
from registry.selectors import model_list_with_versions, model_named, model_version_named

INVOICES_PER_PAGE = 25
PRICES_PER_PAGE = 50
RECONCILIATIONS_PER_PAGE = 25


def _last_month() -> str:
    return invoicing.period_label(invoicing.previous_month(invoicing.month_start(timezone.now())))


# --- Invoices --------------------------------------------------------------------------


def _invoice_rows(invoices: Any) -> list[dict[str, Any]]:
    return [{"invoice": i, "number": invoicing.display_number(i)} for i in invoices]


def _invoice_list(
    request: HttpRequest, *, organization: Organization | None, draft_form: MonthForm | None = None
) -> HttpResponse:
    form = InvoiceFilterForm(request.GET or None)
    filters: dict[str, Any] = {}
    if form.is_valid():
        filters = {
            "status": form.cleaned_data["status"],
            "period": form.cleaned_data["period"],
            "organization_q": "" if organization is not None else form.cleaned_data["organization"].strip(),
        }
    if organization is not None:
        form.fields.pop("organization")
        filters["organization_id"] = organization.pk
    page = page_of(request, invoices_listed(**filters), INVOICES_PER_PAGE)
    context = {
        "organization": organization,
        "form": form,
        "page": page,
        "rows": _invoice_rows(page.object_list),
        "query": query_without_page(request),
        "draft_form": draft_form or MonthForm(initial={"period": _last_month()}, prefix="draft"),
    }
    return render(request, "console/customers/invoices.html", context)


@platform_admin_required
@require_GET
def invoices(request: HttpRequest) -> HttpResponse:
    """Every organisation's invoices, filtered by state, month and organisation."""
    return _invoice_list(request, organization=None)


@platform_admin_required
@require_GET
def customer_invoices(request: HttpRequest, org_id: int) -> HttpResponse:
    """One organisation's invoices, and drafting one for a month."""
    return _invoice_list(request, organization=get_object_or_404(Organization, pk=org_id))


@platform_admin_required
@require_POST
def customer_invoice_draft(request: HttpRequest, org_id: int) -> HttpResponse:
    """Draft the month's invoice, or refresh its draft (a finalized one is left as it is)."""
    organization = get_object_or_404(Organization, pk=org_id)
    form = MonthForm(request.POST, prefix="draft")
    if form.is_valid():
        try:
            invoice = invoice_draft(organization=organization, period=form.cleaned_data["period"])
        except InvalidInput as exc:
            refuse(form, exc)
        else:
            number, month = invoicing.display_number(invoice), invoicing.period_label(invoice.period)
            if invoice.status == Invoice.Status.DRAFT:
                messages.success(
                    request, f"Invoice {number} for {month} drafted: {formats.money(invoice.total, invoice.currency)}."
                )
            else:
                messages.info(request, f"Invoice {number} for {month} is {invoice.status} already: left unchanged.")
            return redirect("console:invoice", invoice_id=invoice.pk)
    messages.error(request, "No invoice drafted: see the errors below.")
    return _invoice_list(request, organization=organization, draft_form=form)


def _invoice_or_404(invoice_id: int) -> Invoice:
    invoice = invoice_get(invoice_id=invoice_id)
    if invoice is None:
        raise Http404("No such invoice.")
    return invoice


@platform_admin_required
@require_GET
def invoice_detail(request: HttpRequest, invoice_id: int) -> HttpResponse:
    """An invoice's lines and totals, and the moves its state allows."""
    invoice = _invoice_or_404(invoice_id)
    now = timezone.now()
    try:
        reissued_as: Invoice | None = invoice.reissued_as
    except Invoice.DoesNotExist:
        reissued_as = None
    context = {
        "invoice": invoice,
        "organization": invoice.organization,
        "number": invoicing.display_number(invoice),
        "reissued_as": reissued_as,
        "payment": invoicing.payment(invoice, today=now.astimezone(UTC).date()),
        # Only a month that has ended is finalized (billing.services.invoice_finalize refuses it before).
        "month_ended": invoicing.month_ended(invoice.period, now=now),
        "deletable": invoice_deletable(invoice),
        "finalize_from": invoicing.month_bounds(invoice.period)[1],
        **invoice_lines_context(invoice),
    }
    return render(request, "console/customers/invoice_detail.html", context)


def _refusal(invoice: Invoice, exc: Exception) -> str:
    number = invoicing.display_number(invoice)
    if isinstance(exc, IllegalTransition):
        return f"Invoice {number} is {exc.current}: it cannot become {exc.target}."
    if isinstance(exc, InvalidInput):
        return f"Invoice {number} was not changed: {exc.message}."
    return f"Invoice {number} was not changed: {exc}."


def _move(request: HttpRequest, invoice_id: int, verb: str, move: Any) -> HttpResponse:
    invoice = _invoice_or_404(invoice_id)
    try:
        moved = move(invoice=invoice)
    except (IllegalTransition, InvoiceFrozen, ValueError) as exc:
        messages.error(request, _refusal(invoice, exc))
    else:
        messages.success(request, f"Invoice {invoicing.display_number(moved)} {verb}.")
    return redirect("console:invoice", invoice_id=invoice.pk)


@platform_admin_required
@require_POST
def invoice_refresh_view(request: HttpRequest, invoice_id: int) -> HttpResponse:
    return _move(request, invoice_id, "refreshed with the usage that arrived since", invoice_refresh)


@platform_admin_required
@require_POST
def invoice_finalize_view(request: HttpRequest, invoice_id: int) -> HttpResponse:
    return _move(request, invoice_id, "finalized: it is emailed to the billing address, if any", invoice_finalize)


@platform_admin_required
@require_POST
def invoice_pay_view(request: HttpRequest, invoice_id: int) -> HttpResponse:
    return _move(request, invoice_id, "marked paid", invoice_mark_paid)


@platform_admin_required
@require_POST
def invoice_delete_view(request: HttpRequest, invoice_id: int) -> HttpResponse:
    """Delete a draft (the latest: its number is given back); its usage goes to the next draft."""
    invoice = _invoice_or_404(invoice_id)
    number, organization = invoicing.display_number(invoice), invoice.organization
    try:
        invoice_delete_draft(invoice=invoice)
    except InvalidInput as exc:
        messages.error(request, _refusal(invoice, exc))
        return redirect("console:invoice", invoice_id=invoice.pk)
    messages.success(request, f"Draft {number} deleted; its usage waits for the month's next draft.")
    return redirect("console:customer-invoices", org_id=organization.pk)


@platform_admin_required
@require_http_methods(["GET", "POST"])
def invoice_void_view(request: HttpRequest, invoice_id: int) -> HttpResponse:
    """GET: why? POST: void it (its number stays used, its usage is released)."""
    invoice = _invoice_or_404(invoice_id)
    form = VoidForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            invoice_void(invoice=invoice, reason=form.cleaned_data["reason"])
        except InvalidInput as exc:
            refuse(form, exc)
        except (IllegalTransition, ValueError) as exc:
            messages.error(request, _refusal(invoice, exc))
            return redirect("console:invoice", invoice_id=invoice.pk)
        else:
            messages.success(request, f"Invoice {invoicing.display_number(invoice)} void.")
            return redirect("console:invoice", invoice_id=invoice.pk)
    context = {"invoice": invoice, "number": invoicing.display_number(invoice), "form": form, "action": "void"}
    return render(request, "console/customers/invoice_move.html", context)


@platform_admin_required
@require_http_methods(["GET", "POST"])
def invoice_reissue_view(request: HttpRequest, invoice_id: int) -> HttpResponse:
    """GET: why? POST: void it and draft its replacement, which takes its usage."""
    invoice = _invoice_or_404(invoice_id)
    form = ReissueForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            new = invoice_reissue(invoice=invoice, reason=form.cleaned_data["reason"])
        except InvalidInput as exc:
            refuse(form, exc)
        except (IllegalTransition, ValueError) as exc:
            messages.error(request, _refusal(invoice, exc))
            return redirect("console:invoice", invoice_id=invoice.pk)
        else:
            messages.success(
                request,
                f"Invoice {invoicing.display_number(invoice)} void; its replacement "
                f"{invoicing.display_number(new)} is a draft.",
            )
            return redirect("console:invoice", invoice_id=new.pk)
    context = {"invoice": invoice, "number": invoicing.display_number(invoice), "form": form, "action": "reissue"}
    return render(request, "console/customers/invoice_move.html", context)


@platform_admin_required
@require_GET
def invoice_download(request: HttpRequest, invoice_id: int, kind: str) -> HttpResponse:
    return org_scoped.invoice_document(_invoice_or_404(invoice_id), kind)


# --- Prices ----------------------------------------------------------------------------


def _price_form(data: Any = None, initial: dict[str, Any] | None = None) -> PriceForm:
    names = [model.name for model in model_list_with_versions()]
    return PriceForm(data, initial=initial, models=names, currency=str(settings.BILLING_CURRENCY), prefix="price")


def _editing(request: HttpRequest) -> dict[str, Any] | None:
    """``?edit=<price id>``: the set-price form filled with that price, to change from now on."""
    asked = request.GET.get("edit", "")
    if not (asked.isascii() and asked.isdigit()) or len(asked) > 18:
        return None
    price = price_get(price_id=int(asked))
    if price is None:
        return None
    values = {field: getattr(price, field) for field in PRICE_FIELDS}
    return {"model": price.model.name, "version": price.version.version if price.version else "", **values}


# What each kind of model is billed in: the units the prices table shows it (the rest: "—").
TOKEN_TASKS = {Task.CHAT, Task.COMPLETION, Task.EMBEDDING}


@platform_admin_required
@require_POST
def price_end_view(request: HttpRequest, price_id: int) -> HttpResponse:
    """End a price now (one scheduled later is withdrawn); audited."""
    price = price_get(price_id=price_id)
    if price is None:
        raise Http404("No such price.")
    scope = f"{price.model.name}:{price.version.version}" if price.version else price.model.name
    try:
        ended = price_end(price=price, actor=request.user)
    except InvalidInput as exc:
        messages.error(request, f"The price of {scope} was not ended: {exc.message}.")
    else:
        messages.success(request, f"The price of {scope} {'ended now' if ended else 'was withdrawn'}.")
    return redirect("console:prices")


@platform_admin_required
@require_http_methods(["GET", "POST"])
def prices(request: HttpRequest) -> HttpResponse:
    """Prices per model and version with their periods; POST sets a new one from a moment on."""
    editing = _editing(request) if request.method == "GET" else None
    form = _price_form(request.POST if request.method == "POST" else None, initial=editing)
    if request.method == "POST":
        if form.is_valid():
            data = dict(form.cleaned_data)
            model = model_named(name=data.pop("model"))
            version_name = data.pop("version").strip()
            version = model_version_named(model=model, version=version_name) if model and version_name else None
            if model is None:
                form.add_error("model", "No such model.")
            elif version_name and version is None:
                form.add_error("version", f"{model.name} has no version {version_name!r}.")
            else:
                try:
                    price = price_set(model=model, version=version, actor=request.user, **data)
                except InvalidInput as exc:
                    refuse(form, exc)
                else:
                    scope = f"{model.name}:{version.version}" if version is not None else model.name
                    per_1k = formats.unit_price(price.per_thousand_inferences, price.currency)
                    messages.success(
                        request,
                        f"Price of {scope} set from {price.effective_from:%Y-%m-%d %H:%M} UTC: "
                        f"{formats.unit_price(price.input_per_million, price.currency)} in, "
                        f"{formats.unit_price(price.output_per_million, price.currency)} out per 1M tokens; "
                        f"{per_1k} per 1k inferences; batch lines at {price.batch_percent.normalize():f} %.",
                    )
                    return redirect("console:prices")
        messages.error(request, "The price was not set: see the errors below.")
    filters = PriceFilterForm(request.GET or None)
    model_q, ended = "", False
    if filters.is_valid():
        model_q, ended = filters.cleaned_data["model"].strip(), filters.cleaned_data["ended"]
    page = page_of(request, prices_listed(model=model_q, include_ended=ended), PRICES_PER_PAGE)
    context = {
        "form": form,
        "filters": filters,
        "page": page,
        "query": query_without_page(request),
        "now": timezone.now(),
        "editing": editing,
        "token_tasks": [str(task) for task in TOKEN_TASKS],
        "unpriced": unpriced_usage(since=timezone.now().date() - timedelta(days=UNPRICED_DAYS)),
        "unpriced_days": UNPRICED_DAYS,
    }
    return render(request, "console/customers/prices.html", context)


# Usage without a price this far back is shown on the prices page as a warning.
UNPRICED_DAYS = 30


# --- Reconciliation --------------------------------------------------------------------


@platform_admin_required
@require_http_methods(["GET", "POST"])
def reconciliation(request: HttpRequest) -> HttpResponse:
    """The latest reconciliations and their differences; POST reconciles a month now."""
    form = MonthForm(request.POST if request.method == "POST" else None, prefix="reconcile")
    if request.method == "POST":
        if form.is_valid():
            period = form.cleaned_data["period"]
            try:
                result = reconcile_month(period=period)
            except ValueError as exc:
                form.add_error("period", str(exc))
            else:
                verdict = "everything agrees" if result.ok else "MISMATCH: see the differences below"
                level = messages.SUCCESS if result.ok else messages.WARNING
                messages.add_message(request, level, f"{invoicing.period_label(period)} reconciled: {verdict}.")
                return redirect("console:reconciliation")
        messages.error(request, "Not reconciled: see the errors below.")
    else:
        form = MonthForm(initial={"period": _last_month()}, prefix="reconcile")
    filters = ReconciliationFilterForm(request.GET or None)
    ok: bool | None = None
    if filters.is_valid() and filters.cleaned_data["result"]:
        ok = filters.cleaned_data["result"] == "ok"
    page = page_of(request, reconciliations_latest(ok=ok), RECONCILIATIONS_PER_PAGE)
    context = {"form": form, "filters": filters, "page": page, "query": query_without_page(request)}
    return render(request, "console/customers/reconciliation.html", context)


INVOICE = "console/invoices/<int:invoice_id>/"
urlpatterns: list[URLPattern | URLResolver] = [
    path("console/customers/<int:org_id>/invoices/", customer_invoices, name="customer-invoices"),
    path("console/customers/<int:org_id>/invoices/draft/", customer_invoice_draft, name="customer-invoice-draft"),
    path("console/invoices/", invoices, name="invoices"),
    path(INVOICE, invoice_detail, name="invoice"),
    path(f"{INVOICE}refresh/", invoice_refresh_view, name="invoice-refresh"),
    path(f"{INVOICE}finalize/", invoice_finalize_view, name="invoice-finalize"),
    path(f"{INVOICE}pay/", invoice_pay_view, name="invoice-pay"),
    path(f"{INVOICE}delete/", invoice_delete_view, name="invoice-delete"),
    path(f"{INVOICE}void/", invoice_void_view, name="invoice-void"),
    path(f"{INVOICE}reissue/", invoice_reissue_view, name="invoice-reissue"),
    path(f"{INVOICE}pdf/", invoice_download, {"kind": "pdf"}, name="invoice-pdf"),
    path(f"{INVOICE}csv/", invoice_download, {"kind": "csv"}, name="invoice-csv"),
    path("console/prices/", prices, name="prices"),
    path("console/prices/<int:price_id>/end/", price_end_view, name="price-end"),
    path("console/reconciliation/", reconciliation, name="reconciliation"),
]
NAV: list[NavItem] = [
    NavItem("Invoices", "invoices", CONSOLE),
    NavItem("Prices", "prices", CONSOLE),
    NavItem("Reconciliation", "reconciliation", CONSOLE),
]
