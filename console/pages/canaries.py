"""Canaries and shadow runs in the console: the list, each model's canary with its live
comparison charts and decision timeline, the start wizard, and the shadow policy.

Part of the deployments area (``console.pages.deployments`` lists these routes). The charts
are built here from the figures each ``CanaryDecision`` stored (``rollout.canary_stats``),
so the page reads no usage records: one row per decision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import plotly.graph_objects as go
from django import forms
from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import render
from django.urls import URLPattern, URLResolver, path, reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from plotly.subplots import make_subplots

from console.pages.access import platform_admin_required
from console.pages.charts import axis, layout
from console.pages.lists import page_of, query_without_page, refuse
from console.pages.nav import CONSOLE, NavItem
from console.pages.rollout_forms import CanaryStartForm, ShadowForm
from core.errors import InvalidInput
from core.formats import utc
from core.transitions import IllegalTransition
from registry.models import Deployment, Model
from registry.selectors import model_named, model_traffic_split, model_version_named, version_counts
from rollout.canary import (
    CanaryConflict,
    active_canary,
    canary_create,
    canary_pause,
    canary_promote,
    canary_resume,
    canary_rollback,
)
from rollout.models import Canary, CanaryDecision
from rollout.selectors import (
    Lifecycle,
    canaries_of,
    canary_latest,
    lifecycle_of,
    models_with_latest_canary,
    promotions_of,
)
from serving.shadow.selectors import shadow_comparison, shadow_policy_of
from serving.shadow.services import shadow_policy_delete, shadow_policy_set

CANARIES_PER_PAGE = 25
SHADOW_WINDOWS = {"1": "the last hour", "24": "the last 24 hours", "168": "the last 7 days"}
# What each button does, as the confirm step and the success message say it.
ACTIONS: dict[str, tuple[Any, str]] = {
    "pause": (canary_pause, "paused: the split stays as it is until resumed"),
    "resume": (canary_resume, "resumed: judged again from a fresh window of the current step"),
    "promote": (canary_promote, "promoted: the canary version takes all the traffic"),
    "rollback": (canary_rollback, "rolled back: the base version takes all the traffic"),
}
CONFIRMED = ("promote", "rollback")


def _model_or_404(name: str) -> Model:
    model = model_named(name=name)
    if model is None:
        raise Http404("No such model.")
    return model


def _shadow_versions(model: Model) -> list[tuple[str, str]]:
    """(version, what it is now) of each of the model's versions, as the shadow form offers them."""
    versions = list(model.versions.all())
    now = lifecycle_of(versions=versions)
    return [(version.version, now[version.pk].label) for version in versions]


def one_version_only(model: Model, versions: list[str]) -> str:
    """Why no canary of ``model`` can start, when it has one version (or none); "" otherwise."""
    if len(versions) >= 2:
        return ""
    if not versions:
        return f"{model.name} has no version yet: a canary compares two of its versions."
    return f"{model.name} has one version ({versions[0]}): a canary compares a second version with it."


def criteria_text(criteria: dict[str, float]) -> list[str]:
    """A canary's absolute bounds in the units the pages use (the success rate in %)."""
    out = []
    for key, value in criteria.items():
        if key == "min_success_rate":
            out.append(f"success rate ≥ {value * 100:g} %")
        elif key == "max_p99_latency_ms":
            out.append(f"p99 latency ≤ {value:,g} ms")
        elif key == "max_ttft_p99_ms":
            out.append(f"p99 TTFT ≤ {value:,g} ms")
        else:
            out.append(f"{key} {value:g}")
    return out


def _wizard_versions(model: Model) -> tuple[list[str], list[str]]:
    """(versions serving now: a running deployment with traffic, versions deployed: a pending
    or running deployment), newest first."""
    serving, deployed = [], []
    for version in model.versions.all().prefetch_related("deployments"):
        live = [
            d for d in version.deployments.all() if d.status in (Deployment.Status.PENDING, Deployment.Status.RUNNING)
        ]
        if live:
            deployed.append(version.version)
        if any(d.status == Deployment.Status.RUNNING and d.traffic_weight > 0 for d in live):
            serving.append(version.version)
    return serving, deployed


# --- How far a canary went --------------------------------------------------------------


def promoted_by_controller(decisions: list[CanaryDecision]) -> bool:
    """Whether the controller made the promotion among ``decisions``: its decisions carry the
    judged figures, a person's carry none."""
    return any(d.verdict == CanaryDecision.Verdict.PROMOTE for d in judged(decisions))


def canary_progress(canary: Canary, *, by_controller: bool) -> str:
    """How far ``canary`` went, as the list and its page both say it: the step and share while
    it runs; once it ends, whether every step was done and the share the promotion or rollback
    left (a canary auto-promoted from the step before a last step of 100 % never runs that one:
    no base traffic would be left to compare with)."""
    total = len(canary.steps)
    step = f"step {canary.current_step + 1} of {total} ({canary.canary_percent} %)"
    every = f"All {total} step{'s' if total != 1 else ''} done"
    if canary.status == Canary.Status.PROMOTED:
        if by_controller or canary.current_step == total - 1:
            return f"{every} · promoted to 100 %"
        return f"Promoted at {step} · now 100 %"
    if canary.status == Canary.Status.ROLLED_BACK:
        return f"Rolled back at {step} · now 0 %"
    if canary.status == Canary.Status.COMPLETED:
        return f"{every} · canary at {canary.canary_percent} %"
    return f"Step {canary.current_step + 1} of {total} · canary at {canary.canary_percent} %"


# --- Charts and the decision timeline ---------------------------------------------------


@dataclass(frozen=True)
class Series:
    """One of the comparison charts: where its value sits in an arm's figures, its unit, and
    what its empty plot says instead of an empty grid."""

    title: str
    keys: tuple[str, ...]
    scale: float
    unit: str
    empty: str


# What the comparison charts plot per decision window.
SERIES = (
    Series("Success rate", ("error_rate",), 100.0, "%", "No requests judged yet"),
    Series("p99 latency", ("latency_ms", "p99"), 1.0, "ms", "No answered requests yet"),
    Series("p99 time to first token", ("ttft_ms", "p99"), 1.0, "ms", "TTFT: streamed requests only, none yet"),
    Series("Time per output token, median", ("tpot_ms", "p50"), 1.0, "ms", "TPOT: streams of 2+ tokens only, none yet"),
)
ARM_COLOURS = {"base": "#5b6472", "canary": "#2f5bea"}


def _arm_value(arm: dict[str, Any], keys: tuple[str, ...], scale: float) -> float | None:
    value: Any = arm
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    if not isinstance(value, int | float):
        return None
    if keys == ("error_rate",):
        value = 1 - value  # success: no server error
    return round(float(value) * scale, 3)


def judged(decisions: list[CanaryDecision]) -> list[CanaryDecision]:
    """The controller's decisions that carry per-arm figures (a person's promote carries none)."""
    return [d for d in decisions if isinstance(d.figures, dict) and isinstance(d.figures.get("arms"), dict)]


def comparison_figure(decisions: list[CanaryDecision]) -> dict[str, Any]:
    """Base vs canary per decision window: success rate, p99 latency, p99 TTFT and TPOT, as plotly
    JSON. Each plot's y axis names its unit, the x axis its windows (step and canary share; the
    time is in the hover), and a plot with nothing to show says why."""
    figure = make_subplots(
        rows=2, cols=2, subplot_titles=[f"{s.title} ({s.unit})" for s in SERIES],
        vertical_spacing=0.2, horizontal_spacing=0.12,
    )  # fmt: skip
    windows = judged(decisions)
    labels = [f"{d.step + 1}: {d.canary_percent} %" for d in windows]
    times = [f"{utc(d.at, seconds=True)} UTC" for d in windows]
    for index, series in enumerate(SERIES):
        row, col = divmod(index, 2)
        ref = "" if index == 0 else str(index + 1)
        empty = True
        for arm, colour in ARM_COLOURS.items():
            values = [_arm_value(d.figures["arms"].get(arm) or {}, series.keys, series.scale) for d in windows]
            empty = empty and all(value is None for value in values)
            figure.add_trace(
                go.Scatter(
                    x=labels, y=values, name=arm, legendgroup=arm, showlegend=index == 0, customdata=times,
                    mode="lines+markers", line={"color": colour},
                    hovertemplate=f"{arm}: %{{y:,}} {series.unit}<br>step %{{x}} · %{{customdata}}<extra></extra>",
                ),
                row=row + 1, col=col + 1,
            )  # fmt: skip
        if empty:
            figure.add_annotation(
                text=series.empty, xref=f"x{ref} domain", yref=f"y{ref} domain", x=0.5, y=0.5,
                showarrow=False, font={"color": "#5b6472"},
            )  # fmt: skip
        figure.update_yaxes(title_text=series.unit, row=row + 1, col=col + 1)
        if row == 1:
            figure.update_xaxes(title_text="step: canary share", row=row + 1, col=col + 1)
    # The legend above the plots, at the right: it never takes their room.
    legend = {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.12}
    figure.update_layout(
        {**layout(height=560, legend=True, margin={"l": 60, "r": 10, "t": 50, "b": 60}), "legend": legend}
    )
    figure.update_xaxes(axis(type="category"))
    figure.update_yaxes(axis(rangemode="tozero"))
    figure_json: dict[str, Any] = json.loads(figure.to_json())
    return figure_json


def _number(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    return f"{value:.{digits}g}"


@dataclass(frozen=True)
class TimelineEntry:
    decision: CanaryDecision
    tests: list[dict[str, Any]]
    arms: list[dict[str, Any]]
    skipped: list[str]


def timeline(decisions: list[CanaryDecision]) -> list[TimelineEntry]:
    """Each decision, newest first, with the statistics behind it, ready to show."""
    entries = []
    for decision in reversed(decisions):
        figures = decision.figures if isinstance(decision.figures, dict) else {}
        tests = [
            {
                "name": name,
                "test": test.get("test", ""),
                "statistic": _number(test.get("statistic")),
                "p_value": _number(test.get("p_value")),
                "p_adjusted": _number(test.get("p_adjusted")),
                "base": _number(test.get("base")),
                "canary": _number(test.get("canary")),
                "effect": _number(test.get("effect")),
                "n_base": test.get("n_base"),
                "n_canary": test.get("n_canary"),
                "worse": bool(test.get("worse")),
                "suspicious": bool(test.get("suspicious")),
            }
            for name, test in sorted((figures.get("tests") or {}).items())
            if isinstance(test, dict)
        ]
        arms = [
            {
                "arm": arm,
                "n": data.get("n"),
                # Not in n: their clients went away first (billing.outcomes). "-" on a decision
                # judged before they were counted apart.
                "cancelled": data.get("cancelled", "-"),
                "success": _number(_arm_value(data, ("error_rate",), 100.0), 4),
                "latency_p99": _number(_arm_value(data, ("latency_ms", "p99"), 1.0), 4),
                "ttft_p99": _number(_arm_value(data, ("ttft_ms", "p99"), 1.0), 4),
                "tpot_p50": _number(_arm_value(data, ("tpot_ms", "p50"), 1.0), 4),
            }
            for arm, data in (figures.get("arms") or {}).items()
            if isinstance(data, dict)
        ]
        entries.append(TimelineEntry(decision, tests, arms, list(figures.get("skipped") or [])))
    return entries


def _stamp(canary: Canary | None) -> str:
    """Changes whenever the canary moves or a decision is added: what the page's poll compares."""
    if canary is None:
        return "none"
    return (
        f"{canary.pk}:{canary.status}:{canary.current_step}:{canary.decisions.count()}:{canary.updated_at.isoformat()}"
    )


# --- Pages ------------------------------------------------------------------------------


@require_GET
@platform_admin_required
def canary_list(request: HttpRequest) -> HttpResponse:
    q = request.GET.get("model", "").strip()
    status = request.GET.get("status", "")
    rows = models_with_latest_canary(q=q)
    if status == "active":
        rows = [(m, c) for m, c in rows if c is not None and c.status in Canary.ACTIVE_STATUSES]
    elif status in Canary.Status.values:
        rows = [(m, c) for m, c in rows if c is not None and c.status == status]
    page = page_of(request, rows, CANARIES_PER_PAGE)
    shown = [c for _, c in page.object_list if c is not None]
    now = lifecycle_of(versions=[v for c in shown for v in (c.base_version, c.canary_version)])
    promotions = promotions_of(canary_ids=[c.pk for c in shown if c.status == Canary.Status.PROMOTED])
    counts = version_counts(model_ids=[m.pk for m, _ in page.object_list])
    # (model, its latest canary, what the canary's version is now, how far the canary went, and
    # whether a canary can be offered: a model with one version has nothing to compare it with)
    table: list[tuple[Model, Canary | None, Lifecycle | None, str, bool]] = []
    for model, canary in page.object_list:
        startable = counts.get(model.pk, 0) >= 2
        if canary is None:
            table.append((model, None, None, "", startable))
            continue
        by_controller = promoted_by_controller(promotions.get(canary.pk, []))
        progress = canary_progress(canary, by_controller=by_controller)
        table.append((model, canary, now.get(canary.canary_version_id), progress, startable))
    context = {
        "page": page,
        "rows": table,
        "q": q,
        "status": status,
        "statuses": Canary.Status.choices,
        "query": query_without_page(request),
    }
    return render(request, "console/deployments/canary_list.html", context)


def _versions_now(canary: Canary | None) -> list[tuple[str, Lifecycle]]:
    """The canary's base and candidate, each with what it is now."""
    if canary is None:
        return []
    pair = [canary.base_version, canary.canary_version]
    now = lifecycle_of(versions=pair)
    return [(version.version, now[version.pk]) for version in pair]


def _detail(
    request: HttpRequest, model: Model, *, shadow_form: forms.Form | None = None, fragment: bool = False
) -> HttpResponse:
    canary = canary_latest(model=model)
    decisions = list(canary.decisions.all()) if canary is not None else []
    hours = request.GET.get("hours", "24")
    hours = hours if hours in SHADOW_WINDOWS else "24"
    policy = shadow_policy_of(model_id=model.pk)
    shadow_versions = _shadow_versions(model)
    comparison = shadow_comparison(model=model.name, since=timezone.now() - timedelta(hours=int(hours)))
    # The split in force, as the API shows it: a canary promoted (or rolled back) from an early
    # step keeps that step's percentage, which is no longer the traffic.
    split = model_traffic_split(model=model) if canary else {}
    context = {
        "model": model,
        "canary": canary,
        "criteria": criteria_text(canary.success_criteria) if canary else [],
        "progress": canary_progress(canary, by_controller=promoted_by_controller(decisions)) if canary else "",
        "versions_now": _versions_now(canary),
        "stamp": _stamp(canary),
        "figure": comparison_figure(decisions) if judged(decisions) else None,
        "timeline": timeline(decisions),
        "weights": {
            version.version: split.get(version.version, 0) for version in (canary.base_version, canary.canary_version)
        }
        if canary
        else {},
        "active": canary is not None and canary.status in Canary.ACTIVE_STATUSES,
        "cannot_start": one_version_only(model, [v for v, _ in shadow_versions]),
        "policy": policy,
        "shadow_form": shadow_form
        or ShadowForm(
            versions=shadow_versions,
            initial={"version": policy.candidate.version, "percent": policy.percent} if policy else None,
        ),
        "comparison": comparison,
        "comparison_rows": [("candidate", comparison["candidate"]), ("primary", comparison["primary"])],
        "hours": hours,
        "window_label": SHADOW_WINDOWS[hours],
        "windows": SHADOW_WINDOWS,
        # Every canary the model ran, the one above included (in the live fragment: its counts move).
        "history": list(canaries_of(model=model)),
    }
    template = "console/deployments/_canary_live.html" if fragment else "console/deployments/canary_detail.html"
    return render(request, template, context)


@require_GET
@platform_admin_required
def canary_detail(request: HttpRequest, name: str) -> HttpResponse:
    return _detail(request, _model_or_404(name), fragment=request.GET.get("fragment") == "1")


@require_GET
@platform_admin_required
def canary_state(request: HttpRequest, name: str) -> JsonResponse:
    """What the canary page polls: a stamp that changes with every move and decision."""
    canary = canary_latest(model=_model_or_404(name))
    return JsonResponse(
        {
            "stamp": _stamp(canary),
            "status": canary.status if canary is not None else None,
            "decisions": canary.decisions.count() if canary is not None else 0,
        }
    )


@platform_admin_required
@require_http_methods(["GET", "POST"])
def canary_new(request: HttpRequest, name: str) -> HttpResponse:
    """The start wizard."""
    model = _model_or_404(name)
    serving, deployed = _wizard_versions(model)
    current = active_canary(model=model)
    cannot_start = one_version_only(model, [version.version for version in model.versions.all()])
    if cannot_start:
        context = {"model": model, "cannot_start": cannot_start}
        return render(request, "console/deployments/canary_new.html", context)
    if request.method == "POST":
        form = CanaryStartForm(request.POST, serving=serving, deployed=deployed)
        if form.is_valid():
            data = form.cleaned_data
            try:
                canary = canary_create(
                    actor=request.user, model=model, base_version=data["base_version"],
                    canary_version=data["canary_version"], steps=data["steps"],
                    interval_seconds=data["interval_seconds"], min_samples=data["min_samples"],
                    success_criteria=form.criteria(), auto_promote=data["auto_promote"],
                )  # fmt: skip
            except InvalidInput as exc:
                refuse(form, exc, {"canary_percentage": "steps"})
            except CanaryConflict as exc:
                form.add_error(None, str(exc))
            else:
                messages.success(
                    request,
                    f"Canary of {model.name} started: {canary.canary_version.version} takes "
                    f"{canary.canary_percent} % from {canary.base_version.version}.",
                )
                return HttpResponseRedirect(reverse("console:canary", kwargs={"name": model.name}))
    else:
        candidates = [v for v in deployed if v not in serving]
        initial: dict[str, Any] = {"base_version": serving[0] if serving else None,
                                   "canary_version": candidates[0] if candidates else None}  # the newest  # fmt: skip
        form = CanaryStartForm(serving=serving, deployed=deployed, initial=initial)
    context = {"model": model, "form": form, "current": current, "schedule": form.schedule(),
               "serving": serving, "deployed": deployed}  # fmt: skip
    return render(request, "console/deployments/canary_new.html", context)


@platform_admin_required
@require_http_methods(["GET", "POST"])
def canary_act(request: HttpRequest, name: str, action: str) -> HttpResponse:
    """Pause, resume, promote or roll back the active canary; promote and roll back ask first (GET)."""
    model = _model_or_404(name)
    if action not in ACTIONS:
        raise Http404("No such action.")
    canary = active_canary(model=model)
    back = HttpResponseRedirect(reverse("console:canary", kwargs={"name": model.name}))
    if canary is None:
        messages.error(request, f"{model.name} has no active canary.")
        return back
    act, outcome = ACTIONS[action]
    if request.method == "GET" or (action in CONFIRMED and request.POST.get("confirm") != "yes"):
        context = {"model": model, "canary": canary, "action": action, "outcome": outcome}
        return render(request, "console/deployments/canary_confirm.html", context)
    try:
        act(actor=request.user, canary=canary)
    except IllegalTransition as exc:
        messages.error(request, f"The canary is {exc.current}: it cannot {action}.")
    except InvalidInput as exc:  # the split could not be set (a version's deployment has stopped)
        messages.error(request, f"Not done: {exc.message}")
    else:
        messages.success(request, f"Canary of {model.name} {outcome}.")
    return back


@platform_admin_required
@require_POST
def shadow_set(request: HttpRequest, name: str) -> HttpResponse:
    model = _model_or_404(name)
    form = ShadowForm(request.POST, versions=_shadow_versions(model))
    if form.is_valid():
        candidate = model_version_named(model=model, version=form.cleaned_data["version"])
        if candidate is None:
            form.add_error("version", f"{model.name} has no such version.")
        else:
            try:
                shadow_policy_set(model=model, candidate=candidate, percent=form.cleaned_data["percent"],
                                  actor=request.user)  # fmt: skip
            except InvalidInput as exc:
                refuse(form, exc, {"candidate": "version"})
            else:
                messages.success(
                    request, f"Mirroring {form.cleaned_data['percent']} % of {model.name}'s requests to {candidate}."
                )
                return HttpResponseRedirect(reverse("console:canary", kwargs={"name": model.name}) + "#shadow")
    messages.error(request, "Not saved: see the errors below.")
    return _detail(request, model, shadow_form=form)


@platform_admin_required
@require_POST
def shadow_stop(request: HttpRequest, name: str) -> HttpResponse:
    model = _model_or_404(name)
    if shadow_policy_delete(model=model, actor=request.user):
        messages.success(request, f"Stopped mirroring {model.name}'s requests.")
    else:
        messages.error(request, f"{model.name} has no shadow policy.")
    return HttpResponseRedirect(reverse("console:canary", kwargs={"name": model.name}) + "#shadow")


urlpatterns: list[URLPattern | URLResolver] = [
    path("console/canaries/", canary_list, name="canaries"),
    path("console/canaries/<str:name>/", canary_detail, name="canary"),
    path("console/canaries/<str:name>/state/", canary_state, name="canary-state"),
    path("console/canaries/<str:name>/new/", canary_new, name="canary-new"),
    path("console/canaries/<str:name>/shadow/", shadow_set, name="canary-shadow"),
    path("console/canaries/<str:name>/shadow/stop/", shadow_stop, name="canary-shadow-stop"),
    path("console/canaries/<str:name>/<str:action>/", canary_act, name="canary-action"),
]
NAV: list[NavItem] = [NavItem("Canaries", "canaries", CONSOLE)]
