"""The registry in the console: models, versions, registering a version, the audit log."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.conf import settings
from django.contrib import messages
from django.core.exceptions import TooManyFilesSent
from django.core.files.uploadedfile import UploadedFile
from django.core.files.uploadhandler import StopUpload, TemporaryFileUploadHandler
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.template.defaultfilters import filesizeformat
from django.urls import URLPattern, URLResolver, path, reverse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt, csrf_protect
from django.views.decorators.http import require_GET, require_http_methods

from accounts.services import platform_organization
from console.pages.access import platform_admin_required
from console.pages.audit_rows import audit_rows, describe_target
from console.pages.lists import page_of, query_without_page, refuse
from console.pages.nav import CONSOLE, NavItem
from console.pages.overview_data import replica_in_flight, version_figures
from core.errors import InvalidInput
from core.stats import wilson
from registry.adapters import ADAPTER_FRAMEWORK, is_adapter_framework
from registry.audit_selectors import AuditTarget, audit_actions, audit_actors, audit_entries
from registry.batching import BatcherConfig
from registry.bundled_import import bundled_import_start, bundled_models_status, import_state
from registry.models import ModelVersion, Replica, Task
from registry.selectors import (
    adapter_bases,
    adapter_of,
    adapters_on,
    model_version_frameworks,
    model_version_with_replicas,
    model_versions_listed,
    replica_load_seconds,
    upstream_of,
)
from registry.services import (
    SYSTEM_ACTOR_NAMES,
    VersionConflict,
    adapter_version_create,
    model_version_create,
    model_version_create_from_upload,
)
from registry.signatures import is_predict_framework
from registry.uploads import is_archive, stage_files, unpack_archive
from rollout.selectors import Lifecycle, lifecycle_of, version_timeline
from serving.predict.worker_stats import batch_histogram, replica_stats

VERSIONS_PER_PAGE = 25
AUDIT_PER_PAGE = 50


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
    page = page_of(request, versions, VERSIONS_PER_PAGE)
    shown = list(page.object_list)
    now = lifecycle_of(versions=shown)
    context = {
        "form": form,
        "page": page,
        "rows": [(version, now[version.pk]) for version in shown],
        "query": query_without_page(request),
    }
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
    now = lifecycle_of(versions=[found])[found.pk]
    context = {
        **_small_model_context(found, [row.replica for rows in replicas.values() for row in rows]),
        "version": found,
        "upstream": upstream_of(version=found),
        "adapter": adapter_of(version=found),
        "adapters": adapters_on(version=found),
        "now": now,
        "try_url": _try_url(found, now),
        "config": _pretty_json(found.config),
        "quality": held_out_quality(found.config),
        "live": version_figures(model=found.model.name, version=found.version),
        "requests_of_version": f"{reverse('console:requests')}?"
        + urlencode({"model": found.model.name, "version": found.version}),
        "timeline": version_timeline(version=found),
        "system_actors": SYSTEM_ACTOR_NAMES,
        "audit_of_version": _audit_of(AuditTarget("model_version", str(found))),
        "audit_of_model": _audit_of(AuditTarget("model", found.model.name)),
        "deployments": deployments,
        "stale_after": settings.REPLICA_STALE_AFTER,
    }
    return render(request, "console/registry/version.html", context)


# What a version can be tried in, while it serves (a pinned request reaches any running deployment).
TRYABLE = ("serving", "promoted", "canary", "base", "deployed")


def _try_url(version: ModelVersion, now: Lifecycle) -> str:
    """The playground on this version (the platform organisation's, where staff try things)
    for a chat model that is deployed; empty otherwise."""
    if version.model.task != Task.CHAT or now.state not in TRYABLE:
        return ""
    url = reverse("console:playground", kwargs={"org_id": platform_organization().pk})
    return f"{url}?{urlencode({'model': version.model.name, 'version': version.version})}"


@dataclass(frozen=True)
class LabelQuality:
    label: str
    accuracy: float
    rows: int
    interval: tuple[float, float]


@dataclass(frozen=True)
class HeldOutQuality:
    """How a version did on data held out from its training, as its config records it."""

    accuracy: float
    rows: int
    interval: tuple[float, float]  # 95 % (Wilson)
    source: str
    trained_on: list[str]
    per_label: list[LabelQuality]
    cross_source_accuracy: float | None


def held_out_quality(config: dict[str, Any]) -> HeldOutQuality | None:
    """The held-out figures a version's config carries (the bundled small models record
    them when built: registry.small_models), with 95 % intervals; None without them."""
    accuracy, rows = config.get("heldout_accuracy"), config.get("heldout_rows")
    if not isinstance(accuracy, int | float) or not isinstance(rows, int) or rows <= 0:
        return None

    def interval(share: float, n: int, recorded: Any) -> tuple[float, float]:
        if isinstance(recorded, list) and len(recorded) == 2:
            return float(recorded[0]), float(recorded[1])
        return wilson(round(share * n), n)

    labels = config.get("heldout_per_label")
    per_label = [
        LabelQuality(str(label), float(found["accuracy"]), int(found["rows"]),
                     interval(float(found["accuracy"]), int(found["rows"]), found.get("interval95")))
        for label, found in (labels.items() if isinstance(labels, dict) else ())
        if isinstance(found, dict) and found.get("rows")
    ]  # fmt: skip
    cross = config.get("cross_source_accuracy")
    return HeldOutQuality(
        accuracy=float(accuracy),
        rows=rows,
        interval=interval(float(accuracy), rows, config.get("heldout_interval95")),
        source=str(config.get("heldout_source") or ""),
        trained_on=[str(s) for s in config.get("trained_on") or []],
        per_label=per_label,
        cross_source_accuracy=float(cross) if isinstance(cross, int | float) else None,
    )


def _audit_of(target: AuditTarget) -> str:
    """The audit log filtered to ``target`` and everything under it."""
    return f"{reverse('console:audit')}?{urlencode({'target': str(target)})}"


def _pretty_json(value: Any) -> str:
    """Indented JSON with every list of plain values on one line (a 64-pixel example is one
    line, not 64)."""
    text = json.dumps(value, indent=2, sort_keys=True)
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def _small_model_context(version: ModelVersion, replicas: list[Replica]) -> dict[str, Any]:
    """A small model's signature, batcher settings and, per ready replica, the batches its
    batcher formed (from the worker's /stats)."""
    if not is_predict_framework(version.framework):
        return {}
    try:
        batcher = BatcherConfig.from_json(version.config.get("batcher")).as_json()
    except InvalidInput:
        batcher = {}
    stats = replica_stats(replicas)
    return {
        "signature": version.config.get("signature") or {},
        "labels": version.config.get("labels") or [],
        "batcher": batcher,
        "replica_batches": [
            {"replica": pk, "stats": found, "histogram": batch_histogram(found)} for pk, found in sorted(stats.items())
        ],
        "is_small_model": True,
    }


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
    base = forms.ChoiceField(
        label="Base version (adapters only)",
        required=False,
        help_text=f"For framework {ADAPTER_FRAMEWORK}: the version the LoRA adapter applies to (a chat or "
        "completion model served from its artifact).",
    )
    config = forms.JSONField(
        label="Config (JSON)",
        required=False,
        initial=dict,
        help_text='A JSON object, e.g. {"max_seq_len": 8192}.',
        widget=forms.Textarea(attrs={"rows": 5, "spellcheck": "false"}),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bases = {str(version.pk): version for version in adapter_bases()}
        choices = [("", "None: not an adapter"), *((pk, str(version)) for pk, version in self.bases.items())]
        self.fields["base"].choices = choices  # type: ignore[attr-defined]

    def clean_config(self) -> dict[str, Any]:
        config = self.cleaned_data.get("config")
        if config in (None, ""):
            return {}
        if not isinstance(config, dict):
            raise forms.ValidationError("Must be a JSON object, e.g. {}.")
        return config

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        adapter = is_adapter_framework(data.get("framework") or "")
        if adapter and not data.get("base"):
            self.add_error("base", f"A {ADAPTER_FRAMEWORK} version names the base version it applies to.")
        if not adapter and data.get("base"):
            self.add_error("base", f"Only a {ADAPTER_FRAMEWORK} (adapter) version has a base; leave it empty.")
        return data


@platform_admin_required
def model_version_register(request: HttpRequest) -> HttpResponse:
    # ?name=: the model to add a version to, from the pages that ask for one (a canary needs two).
    form = RegisterVersionForm(request.POST or None, initial={"name": request.GET.get("name", "")})
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            if data["base"]:
                version, created = adapter_version_create(
                    actor=request.user, name=data["name"], version=data["version"],
                    artifact_uri=data["artifact_uri"], base=form.bases[data["base"]], config=data["config"],
                    task=data["task"] or None,
                )  # fmt: skip
            else:
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
            refuse(form, exc)
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


# --- Registering by uploading an artifact ------------------------------------------------------


class MultipleFileInput(forms.ClearableFileInput):
    allow_multiple_selected = True


class MultipleFileField(forms.FileField):
    """Any number of files (Django's FileField takes one); empty files are allowed, as an
    artifact may hold one (an empty merges file, a marker)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("widget", MultipleFileInput())
        kwargs.setdefault("allow_empty_file", True)
        super().__init__(*args, **kwargs)

    def clean(self, data: Any, initial: Any = None) -> list[UploadedFile]:
        single = super().clean
        if isinstance(data, (list, tuple)):
            return [single(item, initial) for item in data]
        return [single(data, initial)] if data else []


class UploadVersionForm(forms.Form):
    name = RegisterVersionForm.base_fields["name"]
    version = RegisterVersionForm.base_fields["version"]
    framework = RegisterVersionForm.base_fields["framework"]
    task = RegisterVersionForm.base_fields["task"]
    config = RegisterVersionForm.base_fields["config"]
    artifact_files = MultipleFileField(
        label="Files, or one .tar, .tar.gz or .zip",
        required=False,
        help_text="Pick every file of the artifact, or one archive of it (or a folder above).",
    )
    clean_config = RegisterVersionForm.clean_config

    def clean_artifact_files(self) -> list[UploadedFile]:
        files: list[UploadedFile] = self.cleaned_data.get("artifact_files") or []
        if not files:
            raise forms.ValidationError("Choose a folder, its files, or one .tar or .zip.")
        if len(files) > 1 and any(is_archive(f.name or "") for f in files):
            raise forms.ValidationError("Send one archive on its own, or the files without an archive.")
        return files


class _LimitedUpload(TemporaryFileUploadHandler):
    """Every uploaded file goes to a temporary file (never memory), and the upload stops
    once the files pass ``limit`` bytes together (a body sent without Content-Length)."""

    def __init__(self, request: HttpRequest, *, limit: int) -> None:
        super().__init__(request)
        self.limit = limit
        self.received = 0
        self.exceeded = False

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes | None:
        self.received += len(raw_data)
        if self.received > self.limit:
            self.exceeded = True
            raise StopUpload(connection_reset=False)
        return super().receive_data_chunk(raw_data, start)


def _upload_limit_error(limit: int) -> str:
    return f"The upload is larger than the limit of {filesizeformat(limit)} ({limit:,} bytes)."


def _wants_json(request: HttpRequest) -> bool:
    return request.headers.get("X-Requested-With") == "XMLHttpRequest"


def _upload_refused(request: HttpRequest, form: UploadVersionForm, status: int = 400) -> HttpResponse:
    if _wants_json(request):
        return JsonResponse({"errors": form.errors.get_json_data()}, status=status)
    return render(request, "console/registry/upload.html", _upload_context(form), status=status)


def _refuse_unparsed(request: HttpRequest, message: str, status: int) -> HttpResponse:
    """Refuse an upload whose form could not be read at all (too large, too many files)."""
    if _wants_json(request):
        return JsonResponse({"errors": {"__all__": [{"message": message, "code": "upload"}]}}, status=status)
    return render(request, "console/registry/upload.html", _upload_context(UploadVersionForm(), refusal=message),
                  status=status)  # fmt: skip


def _upload_context(form: UploadVersionForm, refusal: str = "") -> dict[str, Any]:
    limit = settings.ARTIFACT_UPLOAD_MAX_BYTES
    return {"form": form, "limit": limit, "limit_text": filesizeformat(limit), "refusal": refusal}


def _stage_upload(files: list[UploadedFile], paths: list[str], target: Path) -> None:
    limit = settings.ARTIFACT_UPLOAD_MAX_BYTES
    if len(files) == 1 and is_archive(files[0].name or ""):
        upload = files[0]
        archive = Path(upload.temporary_file_path()) if hasattr(upload, "temporary_file_path") else None
        if archive is None:  # a small upload some handler kept in memory: write it out first
            archive = target.parent / "upload.archive"
            with open(archive, "wb") as out:
                for chunk in upload.chunks():
                    out.write(chunk)
        unpack_archive(archive, original_name=upload.name or "archive", target=target, max_bytes=limit)
        return
    # The browser's relative paths (folder/sub/file) come as a field beside the files, in the
    # same order: the multipart parser keeps only each file's base name.
    names = paths if len(paths) == len(files) and all(paths) else [f.name or "" for f in files]
    stage_files(zip(names, files, strict=True), target=target, max_bytes=limit)


@platform_admin_required
@csrf_exempt  # checked by _upload_protected, after the upload handlers are set (Django's documented way)
def model_version_upload(request: HttpRequest) -> HttpResponse:
    limit = settings.ARTIFACT_UPLOAD_MAX_BYTES
    if request.method == "POST":
        handler = _LimitedUpload(request, limit=limit)
        request.upload_handlers = [handler]
        # A body much larger than the limit is refused before it is parsed (the form fields
        # beside the files take a few kilobytes; DATA_UPLOAD_MAX_MEMORY_SIZE bounds them).
        if int(request.META.get("CONTENT_LENGTH") or 0) > limit + settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
            return _refuse_unparsed(request, _upload_limit_error(limit), status=413)
        return _upload_protected(request, handler)
    return _upload_protected(request, None)


@csrf_protect
def _upload_protected(request: HttpRequest, handler: _LimitedUpload | None) -> HttpResponse:
    if request.method != "POST":
        return render(request, "console/registry/upload.html", _upload_context(UploadVersionForm()))
    try:
        form = UploadVersionForm(request.POST, request.FILES)
        valid = form.is_valid()
    except TooManyFilesSent:
        message = f"More than {settings.DATA_UPLOAD_MAX_NUMBER_FILES} files: upload one .tar or .zip instead."
        return _refuse_unparsed(request, message, status=400)
    if handler is not None and handler.exceeded:
        form.add_error(None, _upload_limit_error(handler.limit))
        return _upload_refused(request, form, status=413)
    if not valid:
        return _upload_refused(request, form)
    data = form.cleaned_data
    try:
        with tempfile.TemporaryDirectory(prefix="artifact-upload-", dir=settings.FILE_UPLOAD_TEMP_DIR) as tmp:
            source = Path(tmp) / "artifact"
            source.mkdir()
            _stage_upload(data["artifact_files"], request.POST.getlist("paths"), source)
            version = model_version_create_from_upload(
                actor=request.user, name=data["name"], version=data["version"], framework=data["framework"],
                source=source, config=data["config"], task=data["task"] or None,
            )  # fmt: skip
    except InvalidInput as exc:
        refuse(form, exc)
        return _upload_refused(request, form)
    except VersionConflict as exc:
        form.add_error("version", str(exc))
        return _upload_refused(request, form)
    summary = f"Registered {version}: {version.artifact_size:,} bytes, SHA-256 {version.artifact_sha256}."
    messages.success(request, summary)
    url = reverse("console:model-version", args=[version.model.name, version.version])
    if _wants_json(request):
        return JsonResponse({"redirect": url, "sha256": version.artifact_sha256, "size": version.artifact_size,
                             "message": summary})  # fmt: skip
    return redirect(url)


# --- The bundled models' import -----------------------------------------------------------


class BundledImportForm(forms.Form):
    force = forms.BooleanField(
        label="Rebuild even if up to date", required=False,
        help_text="re-convert and re-hash every bundled model (SmolLM2's conversion takes about 20 s)",
    )  # fmt: skip


@platform_admin_required
@require_http_methods(["GET", "POST"])
def bundled_models(request: HttpRequest) -> HttpResponse:
    form = BundledImportForm(request.POST if request.method == "POST" else None)
    if request.method == "POST" and form.is_valid():
        if bundled_import_start(actor=request.user, force=form.cleaned_data["force"]):
            messages.success(request, "The import of the bundled models is queued; its progress shows below.")
        else:
            messages.warning(request, "An import is queued or running already; its progress shows below.")
        return redirect(reverse("console:bundled-models"))
    rows = bundled_models_status()
    now = lifecycle_of(versions=[row.registered for row in rows if row.registered is not None])
    context = {
        "form": form,
        # (the bundled model's status, what its registered version is now)
        "rows": [(row, now.get(row.registered.pk) if row.registered else None) for row in rows],
        "state": import_state(),
    }
    return render(request, "console/registry/bundled.html", context)


@platform_admin_required
@require_GET
def bundled_models_progress(request: HttpRequest) -> HttpResponse:
    """The import's state for the page to poll."""
    return JsonResponse(import_state())


# --- The audit log --------------------------------------------------------------------------


class AuditFilterForm(forms.Form):
    target = forms.CharField(
        label="Target", required=False, max_length=255,
        help_text="type:id, e.g. deployment:12 or model:NAME (with everything under it), or an exact target",
    )  # fmt: skip
    actor = forms.CharField(label="Actor", required=False, max_length=150,
                            help_text="a username, or a part of the platform (autoscaler, …)")  # fmt: skip
    action = forms.ChoiceField(label="Action", required=False)
    q = forms.CharField(label="Search", required=False, max_length=255, help_text="target, action or actor contains")
    since = forms.DateField(label="From (UTC)", required=False, widget=forms.DateInput(attrs={"type": "date"}))
    until = forms.DateField(label="To (UTC, inclusive)", required=False, widget=forms.DateInput(attrs={"type": "date"}))
    entry = forms.IntegerField(required=False, min_value=1, widget=forms.HiddenInput)

    def __init__(self, *args: Any, actions: list[str], actors: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["action"].choices = [("", "Any action"), *((a, a) for a in actions)]  # type: ignore[attr-defined]
        self.fields["actor"].widget.attrs["list"] = "audit-actors"
        self.actors = actors

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        since, until = cleaned.get("since"), cleaned.get("until")
        if since and until and since > until:
            self.add_error("until", "Must be on or after the From date.")
        return cleaned


def _midnight(day: Any) -> datetime | None:
    return datetime.combine(day, time.min, UTC) if day else None


def _filters_shown(request: HttpRequest, filters: dict[str, Any]) -> list[tuple[str, str]]:
    """Each filter in force in words, with the address of the log without it."""
    words: dict[str, Callable[[Any], str]] = {
        "entry": lambda v: f"entry #{v}",
        "target": describe_target,
        "actor": lambda v: f"by {v}",
        "action": lambda v: f"action {v}",
        "q": lambda v: f"contains “{v}”",
        "since": lambda v: f"from {v:%Y-%m-%d}",
        "until": lambda v: f"to {v:%Y-%m-%d}",
    }
    shown = []
    for name, say in words.items():
        value = filters.get(name)
        if value not in (None, ""):
            query = request.GET.copy()
            query.pop(name, None)
            query.pop("page", None)
            rest = query.urlencode()
            shown.append((say(value), reverse("console:audit") + (f"?{rest}" if rest else "")))
    return shown


@platform_admin_required
def audit_log(request: HttpRequest) -> HttpResponse:
    form = AuditFilterForm(request.GET or None, actions=audit_actions(), actors=audit_actors())
    filters = form.cleaned_data if form.is_valid() else {}
    until = _midnight(filters.get("until"))
    entries = audit_entries(
        q=filters.get("q") or None,
        action=filters.get("action") or None,
        actor=filters.get("actor") or None,
        target=filters.get("target"),
        entry_id=filters.get("entry"),
        since=_midnight(filters.get("since")),
        until=until + timedelta(days=1) if until else None,
    )
    page = page_of(request, entries, AUDIT_PER_PAGE)
    context = {
        "form": form,
        "page": page,
        "rows": audit_rows(page.object_list),
        "query": query_without_page(request),
        "filters_shown": _filters_shown(request, filters),
    }
    return render(request, "console/registry/audit.html", context)


urlpatterns: list[URLPattern | URLResolver] = [
    path("console/models/", model_list, name="models"),
    path("console/models/register/", model_version_register, name="model-register"),
    path("console/models/upload/", model_version_upload, name="model-upload"),
    path("console/models/bundled/", bundled_models, name="bundled-models"),
    path("console/models/bundled/progress/", bundled_models_progress, name="bundled-models-progress"),
    path("console/models/<slug:name>/<str:version>/", model_version_detail, name="model-version"),
    path("console/audit/", audit_log, name="audit"),
]
NAV: list[NavItem] = [
    NavItem("Models", "models", CONSOLE),
    NavItem("Audit log", "audit", CONSOLE),
]
