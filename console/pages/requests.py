"""One request by its id (the x-request-id every answer carries, and the playground shows):
what it was charged and how it was served. Platform admins find any request; an
organisation's members find their own organisation's. Prompts and answers are never stored,
so never shown. Reads are billing's (the usage record) and rollout's (the canary it ran in).
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import URLPattern, URLResolver, path
from django.views.decorators.http import require_GET

from billing.models import UsageRecord
from billing.selectors import failed_attempt_for, usage_record_for
from console.pages.access import OrgRequest, org_member_required, platform_admin_required
from console.pages.nav import CONSOLE, PORTAL, NavItem
from rollout.selectors import canary_arm_at
from serving.semcache.feedback import parse_request_id

CACHE_OUTCOMES = {
    "miss": "answered by the engine",
    "hit": "the same question's stored answer",
    "semantic-hit": "a verified near-repeat's stored answer",
}


class RequestIdForm(forms.Form):
    id = forms.CharField(label="Request id", max_length=80,
                         help_text="the x-request-id of the answer (chatcmpl-… ids work too)")  # fmt: skip

    def clean_id(self) -> Any:
        parsed = parse_request_id(self.cleaned_data["id"])
        if parsed is None:
            raise forms.ValidationError("Not a request id: a UUID, as in the x-request-id header.")
        return parsed


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
    steps.append(("Cache", CACHE_OUTCOMES.get(record.cache, record.cache)))
    return steps


def _lookup(request: HttpRequest, *, organization_id: int | None) -> dict[str, Any]:
    form = RequestIdForm(request.GET or None)
    record = None
    searched = form.is_bound and form.is_valid()
    if searched:
        record = usage_record_for(request_id=form.cleaned_data["id"], organization_id=organization_id)
    return {"form": form, "record": record, "searched": searched, "trail": trail(record) if record else []}


@platform_admin_required
@require_GET
def console_request(request: HttpRequest) -> HttpResponse:
    return render(request, "console/requests/lookup.html", _lookup(request, organization_id=None))


@org_member_required()
@require_GET
def portal_request(request: OrgRequest, org_id: int) -> HttpResponse:
    context = _lookup(request, organization_id=request.organization.pk)
    return render(request, "console/requests/lookup.html", {**context, "organization": request.organization})


urlpatterns: list[URLPattern | URLResolver] = [
    path("console/requests/", console_request, name="requests"),
    path("portal/<int:org_id>/requests/", portal_request, name="portal-requests"),
]
NAV: list[NavItem] = [
    NavItem("Requests", "requests", CONSOLE),
    NavItem("Requests", "portal-requests", PORTAL),
]
