"""The request log, and one request by its id (the x-request-id every answer carries, and
the playground shows): what it was charged and how it was served. Platform admins see any
organisation's requests; an organisation's members their own organisation's. Prompts and
answers are never stored, so never shown. Reads are billing's (the usage records) and
rollout's (the canary a request ran in).
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import URLPattern, URLResolver, path
from django.views.decorators.http import require_GET

from accounts.models import ApiKey, Organization
from accounts.selectors import api_keys_of
from billing.models import CacheOutcome, UsageRecord
from billing.selectors import (
    OUTCOMES,
    failed_attempt_for,
    usage_record_cursor,
    usage_record_for,
    usage_records_listed,
)
from console.pages.access import OrgRequest, org_member_required, platform_admin_required
from console.pages.nav import CONSOLE, PORTAL, NavItem
from registry.selectors import model_names
from rollout.selectors import canary_arm_at
from serving.semcache.feedback import parse_request_id

CACHE_OUTCOMES = {
    "miss": "answered by the engine",
    "hit": "the same question's stored answer",
    "semantic-hit": "a verified near-repeat's stored answer",
}
CACHE_TIERS = {
    "same": "the same words",
    "typo": "the same words but for a typo",
    "reordered": "the same words in another order",
    "paraphrase": "a paraphrase, judged by the learned verifier within the entry's own bound",
}


class RequestIdForm(forms.Form):
    id = forms.CharField(label="Request id", max_length=80,
                         help_text="the x-request-id of the answer (chatcmpl-… ids work too)")  # fmt: skip

    def clean_id(self) -> Any:
        parsed = parse_request_id(self.cleaned_data["id"])
        if parsed is None:
            raise forms.ValidationError("Not a request id: a UUID, as in the x-request-id header.")
        return parsed


LOG_PAGE = 50
# UsageRecord.model_version's length: a longer filter could match nothing.
VERSION_MAX_LENGTH = 50


class _KeyChoice(forms.ModelChoiceField):  # type: ignore[type-arg]
    def __init__(self, *, with_organization: bool, **kwargs: Any) -> None:
        self.with_organization = with_organization
        super().__init__(**kwargs)

    def label_from_instance(self, key: ApiKey) -> str:
        named = f"{key.name} ({key.masked})"
        return f"{key.organization.name} · {named}" if self.with_organization else named


class RequestLogForm(forms.Form):
    """The request log's filters; every one optional. The console also filters by
    organisation; the portal's keys are its organisation's only."""

    organization = forms.ModelChoiceField(
        label="Organisation", queryset=Organization.objects.order_by("name"), required=False, empty_label="All"
    )
    key = _KeyChoice(label="Key", queryset=ApiKey.objects.none(), required=False, empty_label="All",
                     with_organization=True)  # fmt: skip
    model = forms.ChoiceField(label="Model", required=False)
    version = forms.CharField(label="Version", required=False, max_length=VERSION_MAX_LENGTH)
    outcome = forms.ChoiceField(label="Outcome", choices=[("", "All"), *OUTCOMES.items()], required=False)
    cache = forms.ChoiceField(label="Cache", choices=[("", "All"), *CacheOutcome.choices], required=False)
    slower_than = forms.IntegerField(label="Slower than (ms)", required=False, min_value=0, max_value=86_400_000)

    def __init__(self, *args: Any, organization: Organization | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        model = self.fields["model"]
        assert isinstance(model, forms.ChoiceField)
        model.choices = [("", "All"), *((name, name) for name in model_names())]
        key = self.fields["key"]
        assert isinstance(key, _KeyChoice)
        if organization is not None:
            del self.fields["organization"]
            key.queryset = api_keys_of(organization_id=organization.pk)
            key.with_organization = False
        else:
            key.queryset = ApiKey.objects.select_related("organization").order_by("organization__name", "name")


def _log(request: HttpRequest, *, organization: Organization | None) -> dict[str, Any]:
    """The log's page the request asks for: its filters, rows and the cursor of the next page."""
    form = RequestLogForm(request.GET, organization=organization)
    if not form.is_valid():
        return {"log_form": form, "rows": [], "older": None, "newest": None}
    data = form.cleaned_data
    org_id = organization.pk if organization else (data["organization"].pk if data.get("organization") else None)
    # The cursor (the last row of the page before): not a filter, so the filter form never carries it.
    cursor = request.GET.get("before", "")
    before = None
    if cursor.isascii() and cursor.isdigit() and len(cursor) <= 18:
        before = usage_record_cursor(record_id=int(cursor), organization_id=org_id)
    rows = usage_records_listed(
        organization_id=org_id,
        api_key_id=data["key"].pk if data["key"] else None,
        model=data["model"],
        model_version=data["version"],
        outcome=data["outcome"],
        cache=data["cache"],
        slower_than_ms=data["slower_than"],
        before=before,
        limit=LOG_PAGE + 1,
    )
    query = request.GET.copy()
    query.pop("before", None)
    query.pop("id", None)
    older = None
    if len(rows) > LOG_PAGE:
        rows = rows[:LOG_PAGE]
        older = query.copy()
        older["before"] = str(rows[-1].pk)
    return {
        "log_form": form,
        "rows": rows,
        "older": older.urlencode() if older is not None else None,
        "newest": query.urlencode() if cursor else None,
    }


def trail(record: UsageRecord) -> list[tuple[str, str]]:
    """How the request was served, in the order it happened."""
    steps = []
    failed = failed_attempt_for(request_id=record.request_id)
    if failed is not None:
        code = f" {failed.error_code}" if failed.error_code else ""
        steps.append(("Tried first", f"{failed.model} version {failed.model_version}: failed with {failed.status_code}"
                                     f"{code} after {failed.latency_ms:,} ms"))  # fmt: skip
    steps.append(("Fell back to" if failed else "Routed to", f"{record.model} version {record.model_version}"))
    found = canary_arm_at(model=record.model, version=record.model_version, at=record.created_at)
    if found is not None:
        canary, arm = found
        steps.append(("Canary", f"#{canary.pk} ({canary.base_version.version} → {canary.canary_version.version}):"
                                f" the {arm} arm"))  # fmt: skip
    if record.batch:
        steps.append(("Batch", "a line of a batch job, at the batch price"))
    served = CACHE_OUTCOMES.get(record.cache, record.cache)
    if record.cache_tier in CACHE_TIERS:
        served += f" ({CACHE_TIERS[record.cache_tier]})"
    if record.cache_entry is not None:
        served += f", entry {record.cache_entry}"
    steps.append(("Cache", served))
    return steps


def _lookup(request: HttpRequest, *, organization_id: int | None) -> dict[str, Any]:
    form = RequestIdForm(request.GET or None)
    record = None
    searched = form.is_bound and form.is_valid()
    if searched:
        record = usage_record_for(request_id=form.cleaned_data["id"], organization_id=organization_id)
    return {"form": form, "record": record, "searched": searched, "trail": trail(record) if record else []}


def _page(request: HttpRequest, *, organization: Organization | None) -> dict[str, Any]:
    """A request's page when the query names one (``?id=``), else the log."""
    if "id" in request.GET:
        return _lookup(request, organization_id=organization.pk if organization else None)
    return {**_log(request, organization=organization), "form": RequestIdForm(), "log": True}


@platform_admin_required
@require_GET
def console_request(request: HttpRequest) -> HttpResponse:
    return render(request, "console/requests/lookup.html", _page(request, organization=None))


@org_member_required()
@require_GET
def portal_request(request: OrgRequest, org_id: int) -> HttpResponse:
    context = _page(request, organization=request.organization)
    return render(request, "console/requests/lookup.html", {**context, "organization": request.organization})


urlpatterns: list[URLPattern | URLResolver] = [
    path("console/requests/", console_request, name="requests"),
    path("portal/<int:org_id>/requests/", portal_request, name="portal-requests"),
]
NAV: list[NavItem] = [
    NavItem("Requests", "requests", CONSOLE),
    NavItem("Requests", "portal-requests", PORTAL),
]
