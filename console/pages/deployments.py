"""Deployments and rollouts in the console: replicas (and their restart), scaling, LoRA adapters per
batch, traffic splits, hot-swaps, rollbacks, canaries, shadows.

One page lists each model's deployments with every form beside them; each form posts to its
own URL, which calls the same service as the management API and redirects back (or, refused,
renders the page again with the form's errors). Canaries and shadows: ``console.pages.canaries``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import messages
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import render
from django.urls import URLPattern, URLResolver, path, reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from console.pages import canaries
from console.pages.access import platform_admin_required
from console.pages.lists import page_of, query_without_page, refuse
from console.pages.nav import CONSOLE, NavItem
from console.pages.rollout_forms import (
    AdaptersForm,
    AutoscaleForm,
    DeployForm,
    ScaleForm,
    SwapForm,
    TrafficSplitForm,
)
from core.errors import InvalidInput
from core.formats import MISSING
from registry.adapters import base_refusal, is_adapter_framework
from registry.models import AuditEntry, Deployment, Model, Replica
from registry.selectors import (
    SCALE_ACTIONS,
    adapter_replicas,
    deployment_board,
    deployment_with_version,
    deployments_live,
    last_changes,
    model_named,
    model_traffic_split,
    model_version_named,
    models_for_board,
    replica_get,
    replica_load_seconds,
    scale_decisions,
)
from registry.services import (
    SERVING_STATUSES,
    deployment_adapters_set,
    deployment_bounds_set,
    deployment_create,
    deployment_scale,
    replica_restart_refusal,
    replica_restart_request,
    traffic_set,
)
from rollout.autoscaler import AutoscalePolicy, deployment_autoscale_set
from rollout.hotswap import (
    SWAP,
    SWAP_DONE,
    SWAP_DRAIN,
    SWAP_SHIFT,
    Swap,
    deployment_swap_cancel,
    deployment_swap_version,
    swap_get,
)
from rollout.predictive import demand_profile
from rollout.rollback import ROLLBACK, VIA_TRAFFIC, RollbackPlan, model_rollback, rollback_plan
from rollout.selectors import Lifecycle, lifecycle_of, swap_latest_id
from rollout.served_requests import ServedSummary, served_summaries

MODELS_PER_PAGE = 25
DECISIONS_PER_PAGE = 25
DECISIONS_PER_MODEL = 5
SWAP_PHASES = ("starting", "shifted", "draining", "completed")
# The live table's window: what "requests/s", "p99" and "errors" are over.
LIVE_WINDOW = timedelta(minutes=5)
LIVE_IDS_MAX = 200
# Audited actions as the live table's "last change" says them.
CHANGES = {
    "deployment.create": "deployed",
    **dict.fromkeys(SCALE_ACTIONS, "scaled"),
    "deployment.bounds": "replica bounds set",
    "deployment.autoscale": "autoscaling set",
    "deployment.adapters": "LoRA adapters per batch set",
    SWAP: "hot-swap started",
    SWAP_SHIFT: "hot-swap shifted traffic",
    SWAP_DRAIN: "hot-swap draining",
    SWAP_DONE: "hot-swap finished",
    "traffic.set": "traffic split set",
    ROLLBACK: "rolled back",
}


@dataclass
class ReplicaRow:
    replica: Replica
    load_seconds: float | None
    deployment_status: str

    @property
    def restart_requested(self) -> bool:
        return self.replica.restart_requested_at is not None

    @property
    def restartable(self) -> bool:
        """What ``replica_restart_request`` accepts: offer the button only then."""
        return replica_restart_refusal(replica=self.replica, deployment_status=self.deployment_status) is None


def live_cells(deployment: Deployment, served: ServedSummary) -> dict[str, str]:
    """The live table's figures of one deployment as shown, for the page and its polling alike."""
    replicas = list(deployment.replica_set.all())
    ready = sum(1 for r in replicas if r.state == Replica.State.READY and not r.standby)
    warm = sum(1 for r in replicas if r.state == Replica.State.READY and r.standby)
    restarting = sum(1 for r in replicas if r.restart_requested_at is not None)
    replicas_cell = (
        f"{ready}/{deployment.replicas} ready"
        + (f", {warm}/{deployment.standby} standby" if deployment.standby or warm else "")
        + (f", {restarting} restarting" if restarting else "")
    )
    if is_adapter_framework(deployment.version.framework):
        # No replica of its own: the base's replicas whose engine holds it.
        held = len(adapter_replicas(version_ids=[deployment.version_id]).get(deployment.version_id, ()))
        replicas_cell = f"on {held} base replica{'s' if held != 1 else ''}"
    rate = served.per_second
    error_percent = served.error_percent
    return {
        "status": deployment.get_status_display(),
        "state": deployment.status,
        "replicas": replicas_cell,
        "rate": MISSING if not served.requests else f"{rate:.2f}/s" if rate < 10 else f"{rate:,.0f}/s",
        "p99": MISSING if served.p99_latency_ms is None else f"{served.p99_latency_ms:,} ms",
        "errors": MISSING if error_percent is None else f"{error_percent:.1f} %",
        # A client's cancel is no error: its own count, beside the error % (billing.outcomes).
        "cancelled": f"{served.cancelled:,} cancelled" if served.cancelled else "",
        "requests": f"{served.requests:,}",
    }


@dataclass
class DeploymentRow:
    deployment: Deployment
    replicas: list[ReplicaRow]
    scale_form: forms.Form
    autoscale_form: forms.Form
    swap_form: forms.Form
    swap: Swap | None
    live: dict[str, str] = field(default_factory=dict)
    last_change: AuditEntry | None = None
    lifecycle: Lifecycle | None = None
    outlook: str = ""  # a predictive policy's busiest moment expected in the next day
    adapters_form: forms.Form | None = None  # None: its version cannot carry LoRA adapters

    @property
    def last_change_words(self) -> str:
        entry = self.last_change
        return "" if entry is None else CHANGES.get(entry.action, entry.action)

    @property
    def swap_note(self) -> str:
        return (
            f"Starts the new version beside {self.deployment.version}, moves this deployment's traffic to it"
            " once it is ready, then drains and stops the old one."
        )

    @property
    def autoscales(self) -> bool:
        return _autoscales(self.deployment)

    @property
    def refused(self) -> str:
        """The drawer to open with the page: the scaling one ("replicas") holds both scaling forms."""
        scaling = (
            _refused(replicas=self.scale_form)
            or _refused(replicas=self.autoscale_form)
            or _refused(replicas=self.adapters_form)
        )
        return scaling or _refused(swap=self.swap_form)

    @property
    def swap_open(self) -> bool:
        return self.swap is not None and self.swap.outcome is None


@dataclass
class ModelPanel:
    model: Model
    deployments: list[DeploymentRow]
    split: dict[str, int]
    traffic_form: forms.Form | None
    deploy_form: forms.Form
    decisions: list[dict[str, Any]] = field(default_factory=list)
    rollback: RollbackPlan | None = None  # None: its serving version never changed

    @property
    def refused(self) -> str:
        return _refused(traffic=self.traffic_form, deploy=self.deploy_form)


def _refused(**forms_by_kind: forms.Form | None) -> str:
    """The drawer to open with the page: the kind whose form came back refused, if any."""
    return next(
        (kind for kind, form in forms_by_kind.items() if form is not None and form.is_bound and form.errors), ""
    )


# A form refused on a POST, shown again in its place: (form kind, model name or deployment id) -> form.
Refused = dict[tuple[str, str], forms.Form]


def _outlook(deployment: Deployment) -> str:
    """What a predictive policy expects: the busiest moment of the next day, or why nothing."""
    if not (deployment.autoscale.get("enabled") and deployment.autoscale.get("predictive")):
        return ""
    now = timezone.now()
    profile = demand_profile(deployment, now=now)
    peak = profile.peak(now) if profile is not None else None
    if peak is None:
        return "predictive: no forecast until a day of usage is rolled up"
    return f"predictive: busiest next {peak.in_flight:.3g} in flight, {peak.at:%a %H:%M} UTC"


def _panel(model: Model, deployments: list[Deployment], load: dict[int, float], refused: Refused) -> ModelPanel:
    versions = [version.version for version in model.versions.all()]
    rows = []
    for deployment in deployments:
        key = str(deployment.pk)
        swap_id = swap_latest_id(deployment_id=deployment.pk)
        rows.append(
            DeploymentRow(
                deployment=deployment,
                replicas=[ReplicaRow(r, load.get(r.pk), deployment.status) for r in deployment.replica_set.all()],
                scale_form=refused.get(("scale", key))
                or ScaleForm(
                    initial={
                        "replicas": deployment.replicas,
                        "min_replicas": deployment.min_replicas,
                        "max_replicas": deployment.max_replicas,
                    },
                    prefix=f"scale-{key}",
                ),
                autoscale_form=refused.get(("autoscale", key))
                or AutoscaleForm(initial=AutoscaleForm.initial_from(deployment.autoscale), prefix=f"autoscale-{key}"),
                swap_form=refused.get(("swap", key))
                or SwapForm(versions=versions, current=deployment.version.version, prefix=f"swap-{key}"),
                swap=swap_get(swap_id=swap_id) if swap_id is not None else None,
                outlook=_outlook(deployment),
                adapters_form=refused.get(("adapters", key))
                or (
                    AdaptersForm(initial={"max_adapters": deployment.max_adapters}, prefix=f"adapters-{key}")
                    if _takes_adapters(deployment)
                    else None
                ),
            )
        )
    split = model_traffic_split(model=model)
    return ModelPanel(
        model=model,
        deployments=rows,
        split=split,
        traffic_form=refused.get(("traffic", model.name)) or (TrafficSplitForm(split=split) if split else None),
        deploy_form=refused.get(("deploy", model.name)) or DeployForm(versions=versions, prefix=f"deploy-{model.pk}"),
        decisions=[_scale_row(entry) for entry in scale_decisions(model=model)[:DECISIONS_PER_MODEL]],
        rollback=rollback_plan(model=model),
    )


def _board(request: HttpRequest, refused: Refused | None = None) -> HttpResponse:
    q = request.GET.get("model", "").strip()
    include_stopped = request.GET.get("stopped") == "1"
    page = page_of(request, models_for_board(q=q), MODELS_PER_PAGE)
    models = list(page.object_list)
    grouped: dict[int, list[Deployment]] = {model.pk: [] for model in models}
    for deployment in deployment_board(model_ids=list(grouped), include_stopped=include_stopped):
        grouped[deployment.version.model_id].append(deployment)
    load = replica_load_seconds(replica_ids=[r.pk for ds in grouped.values() for d in ds for r in d.replica_set.all()])
    panels = [_panel(model, grouped[model.pk], load, refused or {}) for model in models]
    rows = [row for panel in panels for row in panel.deployments]
    deployments = [row.deployment for row in rows]
    served = _served(deployments)
    changes = last_changes(deployments=deployments)
    now = lifecycle_of(versions=list({d.version_id: d.version for d in deployments}.values()))
    for row in rows:
        d = row.deployment
        row.live = live_cells(d, served[d.pk])
        row.last_change = changes.get(d.pk)
        row.lifecycle = now.get(d.version_id)
    context = {
        "page": page, "panels": panels, "q": q, "include_stopped": include_stopped, "phases": SWAP_PHASES,
        "query": query_without_page(request), "live_minutes": int(LIVE_WINDOW.total_seconds() // 60),
    }  # fmt: skip
    return render(request, "console/deployments/board.html", context)


def _served(deployments: list[Deployment]) -> dict[int, ServedSummary]:
    """What each deployment's version served over the live window (by deployment id)."""
    end = timezone.now()
    versions = [(d.version.model.name, d.version.version) for d in deployments]
    summaries = served_summaries(versions=versions, since=end - LIVE_WINDOW, now=end)
    return {d.pk: summaries[(d.version.model.name, d.version.version)] for d in deployments}


@require_GET
@platform_admin_required
def live(request: HttpRequest) -> JsonResponse:
    """The live table's figures of the deployments asked for (``?ids=1,2``), which the page
    polls: the same cells the page rendered."""
    try:
        ids = [int(part) for part in request.GET.get("ids", "").split(",") if part.strip()]
    except ValueError:
        return JsonResponse({"error": "ids must be deployment ids separated by commas."}, status=400)
    if len(ids) > LIVE_IDS_MAX:
        return JsonResponse({"error": f"at most {LIVE_IDS_MAX} ids."}, status=400)
    deployments = list(deployments_live(deployment_ids=ids))
    served = _served(deployments)
    return JsonResponse({"deployments": {str(d.pk): live_cells(d, served[d.pk]) for d in deployments}})


def _back(request: HttpRequest, model: Model | None = None) -> HttpResponseRedirect:
    """To the page the form was on (its filter kept), else the board filtered to the model."""
    url = reverse("console:deployments")
    if model is not None:
        url += f"?model={model.name}"
    return HttpResponseRedirect(url + (f"#model-{model.name}" if model is not None else ""))


def _model_or_404(name: str) -> Model:
    model = model_named(name=name)
    if model is None:
        raise Http404("No such model.")
    return model


def _deployment_or_404(pk: int) -> Deployment:
    deployment = deployment_with_version(deployment_id=pk)
    if deployment is None:
        raise Http404("No such deployment.")
    return deployment


def _refused_board(request: HttpRequest, key: tuple[str, str], form: forms.Form) -> HttpResponse:
    messages.error(request, "Not saved: see the errors below.")
    return _board(request, {key: form})


@require_GET
@platform_admin_required
def board(request: HttpRequest) -> HttpResponse:
    return _board(request)


@platform_admin_required
@require_POST
def deploy(request: HttpRequest, name: str) -> HttpResponse:
    model = _model_or_404(name)
    form = DeployForm(request.POST, versions=[v.version for v in model.versions.all()], prefix=f"deploy-{model.pk}")
    if form.is_valid():
        version = model_version_named(model=model, version=form.cleaned_data["version"])
        if version is None:
            form.add_error("version", f"{model.name} has no such version.")
        else:
            replicas = form.cleaned_data["replicas"]
            try:
                deployment = deployment_create(
                    actor=request.user, version=version, traffic_weight=form.cleaned_data["traffic_percent"],
                    replicas=replicas, min_replicas=1, max_replicas=replicas, gpu_type=version.gpu_type,
                    max_adapters=form.cleaned_data["max_adapters"] or 0,
                )  # fmt: skip
            except InvalidInput as exc:
                refuse(form, exc, {"traffic_weight": "traffic_percent"})
            else:
                messages.success(request, f"Deployed {version} as deployment {deployment.pk}; its replicas start now.")
                return _back(request, model)
    return _refused_board(request, ("deploy", model.name), form)


@platform_admin_required
@require_POST
def traffic(request: HttpRequest, name: str) -> HttpResponse:
    model = _model_or_404(name)
    form = TrafficSplitForm(request.POST, split=model_traffic_split(model=model))
    if form.is_valid():
        try:
            split = traffic_set(actor=request.user, model=model, weights=form.weights())
        except InvalidInput as exc:
            refuse(form, exc, {version: TrafficSplitForm.PREFIX + version for version in form.weights()})
        else:
            shown = ", ".join(f"{version} {weight} %" for version, weight in sorted(split.items()))
            messages.success(request, f"Traffic of {model.name} split: {shown}.")
            return _back(request, model)
    return _refused_board(request, ("traffic", model.name), form)


@platform_admin_required
@require_POST
def scale(request: HttpRequest, pk: int) -> HttpResponse:
    """The one scaling form: the replica count and its bounds, and (where the deployment can
    autoscale: not a LoRA adapter) the autoscaling policy, set together or not at all."""
    deployment = _deployment_or_404(pk)
    scale_form = ScaleForm(request.POST, prefix=f"scale-{pk}")
    autoscale_form = AutoscaleForm(request.POST, prefix=f"autoscale-{pk}") if _autoscales(deployment) else None
    valid = [form.is_valid() for form in (scale_form, autoscale_form) if form is not None]  # both show their errors
    if all(valid):
        data = scale_form.cleaned_data
        try:
            with transaction.atomic():  # bounds, count and policy together, as the management API sets each
                deployment_bounds_set(
                    actor=request.user, deployment=deployment,
                    min_replicas=data["min_replicas"], max_replicas=data["max_replicas"],
                )  # fmt: skip
                deployment_scale(
                    actor=request.user, deployment=deployment, replicas=data["replicas"],
                    reasons=["set by a platform admin"], action="deployment.scale",
                )  # fmt: skip
                if autoscale_form is not None and _policy_changed(deployment, autoscale_form.policy()):
                    deployment_autoscale_set(
                        actor=request.user, deployment=deployment, autoscale=autoscale_form.policy()
                    )
        except InvalidInput as exc:
            form = autoscale_form if autoscale_form is not None and exc.field in autoscale_form.fields else scale_form
            refuse(form, exc)
        else:
            count = data["replicas"]
            policy = ""
            if autoscale_form is not None:
                policy = f"; autoscaling {'on' if autoscale_form.cleaned_data['enabled'] else 'off'}"
            messages.success(
                request,
                f"Deployment {pk} wants {count} replica{'s' if count != 1 else ''} "
                f"(between {data['min_replicas']} and {data['max_replicas']}){policy}.",
            )
            return _back(request, deployment.version.model)
    refused: Refused = {("scale", str(pk)): scale_form}
    if autoscale_form is not None:
        refused[("autoscale", str(pk))] = autoscale_form
    messages.error(request, "Not saved: see the errors below.")
    return _board(request, refused)


@platform_admin_required
@require_POST
def adapters(request: HttpRequest, pk: int) -> HttpResponse:
    """A deployment's LoRA adapters per batch; its supervisors restart its engines one replica at a time."""
    deployment = _deployment_or_404(pk)
    form = AdaptersForm(request.POST, prefix=f"adapters-{pk}")
    if form.is_valid():
        before = deployment.max_adapters
        try:
            changed = deployment_adapters_set(
                actor=request.user, deployment=deployment, max_adapters=form.cleaned_data["max_adapters"]
            )
        except InvalidInput as exc:
            refuse(form, exc)
        else:
            count = changed.max_adapters
            what = "LoRA off" if count == 0 else f"{count} LoRA adapter{'s' if count != 1 else ''} per batch"
            if count == before:
                messages.success(request, f"Deployment {pk}: {what} already.")
            else:
                messages.success(
                    request, f"Deployment {pk}: {what}; its engines restart one replica at a time to take it."
                )
            return _back(request, deployment.version.model)
    return _refused_board(request, ("adapters", str(pk)), form)


def _takes_adapters(deployment: Deployment) -> bool:
    """Whether the deployment's adapters per batch can be set: it serves a chat or completion
    model on the platform's vLLM engines."""
    return deployment.status in SERVING_STATUSES and base_refusal(deployment.version) is None


def _policy_changed(deployment: Deployment, policy: dict[str, Any]) -> bool:
    """Whether the scaling form's policy differs from the one in force: the form always posts
    one, and a count changed alone must not rewrite (and audit) an unchanged policy."""
    try:
        return AutoscalePolicy.from_json(policy) != AutoscalePolicy.from_json(deployment.autoscale)
    except InvalidInput:
        return True  # the service says why


def _autoscales(deployment: Deployment) -> bool:
    """Whether the deployment has an autoscaling policy to set: a LoRA adapter runs on its base's replicas."""
    return not is_adapter_framework(deployment.version.framework)


@platform_admin_required
@require_POST
def swap(request: HttpRequest, pk: int) -> HttpResponse:
    deployment = _deployment_or_404(pk)
    model = deployment.version.model
    versions = [v.version for v in model.versions.all()]
    form = SwapForm(request.POST, versions=versions, current=deployment.version.version, prefix=f"swap-{pk}")
    if form.is_valid():
        version = model_version_named(model=model, version=form.cleaned_data["version"])
        if version is None:
            form.add_error("version", f"{model.name} has no such version.")
        else:
            try:
                new = deployment_swap_version(actor=request.user, deployment=deployment, version=version)
            except InvalidInput as exc:
                refuse(form, exc)
            else:
                messages.success(
                    request, f"Hot-swap of deployment {pk} to {version} started: deployment {new.pk} is starting."
                )
                return _back(request, model)
    return _refused_board(request, ("swap", str(pk)), form)


@platform_admin_required
@require_POST
def swap_cancel(request: HttpRequest, swap_id: int) -> HttpResponse:
    found = swap_get(swap_id=swap_id)
    if found is None:
        raise Http404("No such swap.")
    try:
        deployment_swap_cancel(actor=request.user, swap=found.entry)
    except InvalidInput as exc:
        messages.error(request, f"The swap was not cancelled: {exc.message}")
    else:
        messages.success(request, f"Hot-swap of {found.model} to {found.to_version} cancelled.")
    model = model_named(name=found.model)
    return _back(request, model)


@platform_admin_required
@require_http_methods(["GET", "POST"])
def rollback(request: HttpRequest, name: str) -> HttpResponse:
    """Roll a model back to the version it served before its last promotion or hot-swap; asks
    first (GET, or a POST without ``confirm``), naming the version the person confirms."""
    model = _model_or_404(name)
    if request.method == "GET" or request.POST.get("confirm") != "yes":
        context = {"model": model, "plan": rollback_plan(model=model), "traffic": VIA_TRAFFIC}
        return render(request, "console/deployments/rollback_confirm.html", context)
    try:
        done = model_rollback(actor=request.user, model=model, version=request.POST.get("version", ""))
    except InvalidInput as exc:
        messages.error(request, f"Not rolled back: {exc.message}")
    else:
        if done.swap_to is None:
            messages.success(request, f"Rolled {model.name} back to {done.plan.to_version}: it serves all the traffic.")
        else:
            messages.success(
                request,
                f"Rollback of {model.name} to {done.plan.to_version} started: deployment {done.swap_to.pk} is "
                f"starting, and takes the traffic of deployment {done.plan.deployment_id} once every replica is ready.",
            )
    return _back(request, model)


@platform_admin_required
@require_http_methods(["GET", "POST"])
def replica_restart(request: HttpRequest, replica_id: int) -> HttpResponse:
    """Restart one replica's engine (drained, stopped, started again by its supervisor); asks
    first (GET, or a POST without ``confirm``)."""
    replica = replica_get(replica_id=replica_id)
    if replica is None:
        raise Http404("No such replica.")
    deployment = _deployment_or_404(replica.deployment_id)
    if request.method == "GET" or request.POST.get("confirm") != "yes":
        others_ready = sum(
            1 for other in deployment.replica_set.all() if other.pk != replica.pk and other.state == Replica.State.READY
        )
        context = {"replica": replica, "deployment": deployment, "others_ready": others_ready}
        return render(request, "console/deployments/replica_restart_confirm.html", context)
    try:
        replica_restart_request(actor=request.user, replica=replica)
    except InvalidInput as exc:
        messages.error(request, f"Not restarted: {exc.message}")
    else:
        messages.success(
            request, f"Restart of replica {replica.pk} requested: its supervisor drains it, then starts it again."
        )
    return _back(request, deployment.version.model)


@require_GET
@platform_admin_required
def swap_status(request: HttpRequest, swap_id: int) -> JsonResponse:
    """What the page polls while a swap is under way."""
    found = swap_get(swap_id=swap_id)
    if found is None:
        raise Http404("No such swap.")
    return JsonResponse(
        {
            "id": swap_id,
            "phase": found.phase,
            "open": found.outcome is None,
            "started_at": found.started_at.isoformat(),
            "shifted_at": found.shifted_at.isoformat() if found.shifted_at else None,
            "drain_at": found.drain_at.isoformat() if found.drain_at else None,
            "outcome": found.outcome,
        }
    )


def _scale_row(entry: AuditEntry) -> dict[str, Any]:
    before, after = entry.before or {}, entry.after or {}
    observations = after.get("observations") or {}
    return {
        "entry": entry,
        "from": before.get("replicas"),
        "to": after.get("replicas"),
        "reasons": after.get("reasons") or [],
        "figures": sorted(observations.items()) if isinstance(observations, dict) else [],
    }


@require_GET
@platform_admin_required
def scaling(request: HttpRequest) -> HttpResponse:
    """Every replica-count change, newest first: the autoscaler's decisions with their reasons
    and the figures behind them, and people's."""
    q = request.GET.get("model", "").strip()
    model = model_named(name=q) if q else None
    entries = scale_decisions(model=model) if model is not None or not q else scale_decisions(deployment_ids=[])
    page = page_of(request, entries, DECISIONS_PER_PAGE)
    rows = [_scale_row(entry) for entry in page.object_list]
    context = {"page": page, "rows": rows, "q": q, "query": query_without_page(request)}
    return render(request, "console/deployments/scaling.html", context)


urlpatterns: list[URLPattern | URLResolver] = [
    path("console/deployments/", board, name="deployments"),
    path("console/deployments/scaling/", scaling, name="deployments-scaling"),
    path("console/deployments/live/", live, name="deployments-live"),
    path("console/deployments/models/<str:name>/deploy/", deploy, name="deployments-deploy"),
    path("console/deployments/models/<str:name>/traffic/", traffic, name="deployments-traffic"),
    path("console/deployments/models/<str:name>/rollback/", rollback, name="deployments-rollback"),
    path("console/deployments/<int:pk>/scale/", scale, name="deployments-scale"),
    path("console/deployments/<int:pk>/adapters/", adapters, name="deployments-adapters"),
    path("console/deployments/<int:pk>/swap/", swap, name="deployments-swap"),
    path("console/deployments/swaps/<int:swap_id>/cancel/", swap_cancel, name="deployments-swap-cancel"),
    path("console/deployments/replicas/<int:replica_id>/restart/", replica_restart, name="deployments-replica-restart"),
    path("console/deployments/swaps/<int:swap_id>/status/", swap_status, name="deployments-swap-status"),
    *canaries.urlpatterns,
]
NAV: list[NavItem] = [
    NavItem("Deployments", "deployments", CONSOLE),
    *canaries.NAV,
]
