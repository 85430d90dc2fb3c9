"""The registry in the console: models, versions, registering a version, the audit log."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import messages
from django.core.paginator import Page, Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import URLPattern, URLResolver, path, reverse
from django.utils import timezone

from console.pages.access import platform_admin_required
from console.pages.nav import CONSOLE, NavItem
from console.pages.overview_data import replica_in_flight
from core.errors import InvalidInput
from registry.models import AuditEntry, ModelVersion, Replica, Task
from registry.selectors import (
    audit_actions,
    audit_entries,
    model_version_frameworks,
    model_version_history,
    model_version_with_replicas,
    model_versions_listed,
    replica_load_seconds,
)
from registry.services import VersionConflict, model_version_create

VERSIONS_PER_PAGE = 25
AUDIT_PER_PAGE = 50


def _page(request: HttpRequest, items: Any, per_page: int) -> Page[Any]:
    return Paginator(items, per_page).get_page(request.GET.get("page"))


def _query_without_page(request: HttpRequest) -> str:
    """The current filters as a query string, for the pager's links to keep."""
    query = request.GET.copy()
    query.pop("page", None)
    return query.urlencode()


# --- Models and versions ------------------------------------------------------------------


class VersionFilterForm(forms.Form):
    q = forms.CharField(label="Model name", required=False, max_length=255)
    status = forms.ChoiceField(
        label="Status", required=False, choices=[("", "Any status"), *ModelVersion.Status.choices]
    )
    framework = forms.ChoiceField(label="Framework", required=False)

    def __init__(self, *args: Any, frameworks: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["framework"].choices = [("", "Any framework"), *((f, f) for f in frameworks)]  # type: ignore[attr-defined]


@platform_admin_required
def model_list(request: HttpRequest) -> HttpResponse:
    form = VersionFilterForm(request.GET or None, frameworks=model_version_frameworks())
    filters = form.cleaned_data if form.is_valid() else {}
    versions = model_versions_listed(
        q=filters.get("q", ""), status=filters.get("status", ""), framework=filters.get("framework", "")
    )
    context = {"form": form, "page": _page(request, versions, VERSIONS_PER_PAGE), "query": _query_without_page(request)}
    return render(request, "console/registry/models.html", context)


@dataclass(frozen=True)
class ReplicaRow:
    replica: Replica
    healthy: bool
    heartbeat_age: float | None  # seconds since its last heartbeat
    in_flight: float | None  # requests this host's gateways have on it; None: not known here
    load_seconds: float | None


def _replica_rows(version: ModelVersion) -> dict[int, list[ReplicaRow]]:
    """Each deployment's replicas with their health, in-flight requests and load time."""
    replicas = [r for d in version.deployments.all() for r in d.replica_set.all()]
    load = replica_load_seconds(replica_ids=[r.pk for r in replicas])
    in_flight = replica_in_flight()
    now = timezone.now()
    stale_after = settings.REPLICA_STALE_AFTER
    rows: dict[int, list[ReplicaRow]] = {}
    for replica in replicas:
        age = (now - replica.last_heartbeat).total_seconds() if replica.last_heartbeat else None
        rows.setdefault(replica.deployment_id, []).append(
            ReplicaRow(
                replica=replica,
                healthy=replica.state == Replica.State.READY and age is not None and age <= stale_after,
                heartbeat_age=age,
                in_flight=in_flight.get(str(replica.pk)),
                load_seconds=load.get(replica.pk),
            )
        )
    return rows


@platform_admin_required
def model_version_detail(request: HttpRequest, name: str, version: str) -> HttpResponse:
    found = model_version_with_replicas(name=name, version=version)
    if found is None:
        raise Http404("No such model version.")
    replicas = _replica_rows(found)
    deployments = [(d, replicas.get(d.pk, [])) for d in found.deployments.all()]
    context = {
        "version": found,
        "config": json.dumps(found.config, indent=2, sort_keys=True),
        "history": [AuditRow.of(e) for e in model_version_history(version=found)],
        "deployments": deployments,
        "stale_after": settings.REPLICA_STALE_AFTER,
    }
    return render(request, "console/registry/version.html", context)


class RegisterVersionForm(forms.Form):
    name = forms.SlugField(
        label="Model name", max_length=255, help_text="The public name customers ask for; a new name creates the model."
    )
    version = forms.CharField(label="Version", max_length=50)
    framework = forms.CharField(label="Framework", max_length=50, initial="transformers",
                                help_text="e.g. transformers, sentence-transformers")  # fmt: skip
    artifact_uri = forms.CharField(
        label="Artifact URI",
        max_length=1024,
        help_text="An artifact already in the store, e.g. local://my-model/1; it is read and hashed (SHA-256).",
    )
    task = forms.ChoiceField(
        label="Task", required=False, choices=[("", "Chat for a new model, else the model's"), *Task.choices]
    )
    config = forms.JSONField(
        label="Config (JSON)",
        required=False,
        initial=dict,
        help_text='A JSON object, e.g. {"max_seq_len": 8192}.',
        widget=forms.Textarea(attrs={"rows": 5, "spellcheck": "false"}),
    )

    def clean_config(self) -> dict[str, Any]:
        config = self.cleaned_data.get("config")
        if config in (None, ""):
            return {}
        if not isinstance(config, dict):
            raise forms.ValidationError("Must be a JSON object, e.g. {}.")
        return config


@platform_admin_required
def model_version_register(request: HttpRequest) -> HttpResponse:
    form = RegisterVersionForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            version, created = model_version_create(
                actor=request.user,
                name=data["name"],
                version=data["version"],
                framework=data["framework"],
                artifact_uri=data["artifact_uri"],
                config=data["config"],
                task=data["task"] or None,
            )
        except InvalidInput as exc:
            form.add_error(exc.field if exc.field in form.fields else None, exc.message)
        except VersionConflict as exc:
            form.add_error("version", str(exc))
        else:
            if created:
                messages.success(
                    request,
                    f"Registered {version}: {version.artifact_size:,} bytes, SHA-256 {version.artifact_sha256}.",
                )
            else:
                messages.info(request, f"{version} is registered already with these values; nothing changed.")
            return redirect(reverse("console:model-version", args=[version.model.name, version.version]))
    return render(request, "console/registry/register.html", {"form": form})


# --- The audit log --------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    field: str
    before: str
    after: str
    changed: bool


def _show(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _as_fields(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    return value if isinstance(value, dict) else {"value": value}


@dataclass(frozen=True)
class AuditRow:
    """An audit entry with its before and after as a field-by-field diff."""

    entry: AuditEntry
    changes: list[Change]

    @property
    def changed(self) -> list[Change]:
        return [c for c in self.changes if c.changed]

    @property
    def unchanged(self) -> list[Change]:
        return [c for c in self.changes if not c.changed]

    @classmethod
    def of(cls, entry: AuditEntry) -> AuditRow:
        before, after = _as_fields(entry.before), _as_fields(entry.after)
        fields = [*before, *(k for k in after if k not in before)]
        changes = [
            Change(
                field=str(name),
                before=_show(before[name]) if name in before else "—",
                after=_show(after[name]) if name in after else "—",
                changed=before.get(name, ...) != after.get(name, ...),
            )
            for name in fields
        ]
        return cls(entry=entry, changes=changes)


class AuditFilterForm(forms.Form):
    q = forms.CharField(label="Search", required=False, max_length=255, help_text="target, action or actor contains")
    action = forms.ChoiceField(label="Action", required=False)
    actor = forms.CharField(label="Actor (username)", required=False, max_length=150)
    target = forms.CharField(label="Target (exact)", required=False, max_length=255)
    since = forms.DateField(label="From (UTC)", required=False, widget=forms.DateInput(attrs={"type": "date"}))
    until = forms.DateField(label="To (UTC, inclusive)", required=False, widget=forms.DateInput(attrs={"type": "date"}))

    def __init__(self, *args: Any, actions: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["action"].choices = [("", "Any action"), *((a, a) for a in actions)]  # type: ignore[attr-defined]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        since, until = cleaned.get("since"), cleaned.get("until")
        if since and until and since > until:
            self.add_error("until", "Must be on or after the From date.")
        return cleaned


def _midnight(day: Any) -> datetime | None:
    return datetime.combine(day, time.min, UTC) if day else None


@platform_admin_required
def audit_log(request: HttpRequest) -> HttpResponse:
    form = AuditFilterForm(request.GET or None, actions=audit_actions())
    filters = form.cleaned_data if form.is_valid() else {}
    until = _midnight(filters.get("until"))
    entries = audit_entries(
        q=filters.get("q") or None,
        action=filters.get("action") or None,
        actor=filters.get("actor") or None,
        target=filters.get("target") or None,
        since=_midnight(filters.get("since")),
        until=until + timedelta(days=1) if until else None,
    )
    page = _page(request, entries, AUDIT_PER_PAGE)
    context = {
        "form": form,
        "page": page,
        "rows": [AuditRow.of(entry) for entry in page.object_list],
        "query": _query_without_page(request),
    }
    return render(request, "console/registry/audit.html", context)


urlpatterns: list[URLPattern | URLResolver] = [
    path("console/models/", model_list, name="models"),
    path("console/models/register/", model_version_register, name="model-register"),
    path("console/models/<slug:name>/<str:version>/", model_version_detail, name="model-version"),
    path("console/audit/", audit_log, name="audit"),
]
NAV: list[NavItem] = [
    NavItem("Models", "models", CONSOLE),
    NavItem("Audit log", "audit", CONSOLE),
]
