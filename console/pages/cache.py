"""The semantic cache in the console: hit rate and savings, the store's size, each model's policy, purge."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

import orjson
import plotly.graph_objects as go
from django import forms
from django.conf import settings
from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import URLPattern, URLResolver, path, reverse
from django.utils import timezone
from django.utils.http import urlencode
from django.views.decorators.http import require_http_methods

from accounts.models import Organization
from accounts.selectors import organizations_visible_to
from billing.cache_savings import CacheSavings, CacheSavingsReport, cache_savings
from billing.usage_selectors import UNRECORDED_WORD_TIER, TierHits, cache_hits_by_tier
from console.pages import charts
from console.pages.access import platform_admin_required
from console.pages.lists import page_of, query_without_page, refuse
from console.pages.nav import CONSOLE, NavItem
from core.errors import InvalidInput
from core.formats import money
from core.stats import wilson
from registry.models import Model
from registry.selectors import model_named, models_for_board
from serving.gateway.routing import CacheRules
from serving.models import CachePolicy
from serving.semcache.budget import EXACT, PARAPHRASE, ModelQuality, TierQuality
from serving.semcache.feedback import NotServedFromCache, parse_request_id, report
from serving.semcache.selectors import (
    RaisedEntries,
    cache_entries_count,
    cache_policies_by_model,
    cache_quality,
    entries_raised_by_mismatch,
)
from serving.semcache.services import MAX_CACHE_TTL_SECONDS, cache_policy_set, cache_purge
from serving.semcache.store import cache_stats

VERSIONS_PER_PAGE = 25
POLICIES_PER_PAGE = 25


@dataclass(frozen=True)
class Window:
    key: str
    label: str
    span: timedelta


WINDOWS = {w.key: w for w in (
    Window("day", "Last 24 hours", timedelta(days=1)),
    Window("7d", "Last 7 days", timedelta(days=7)),
    Window("30d", "Last 30 days", timedelta(days=30)),
)}  # fmt: skip
DEFAULT_WINDOW = "day"


# --- The cache page ---------------------------------------------------------------------------


@dataclass(frozen=True)
class VersionRow:
    """One model version: what the store holds now, and what the rollups say it served."""

    model: str
    version: str
    entries: int
    expired: int
    hits: int  # hits recorded on the entries still stored
    usage: CacheSavings


class CacheFilterForm(forms.Form):
    window = forms.ChoiceField(label="Time range", required=False, choices=[(w.key, w.label) for w in WINDOWS.values()])
    q = forms.CharField(label="Model name", required=False, max_length=255)


def _version_rows(stats: dict[str, Any], report: CacheSavingsReport, q: str) -> list[VersionRow]:
    stored = {(m["model"], m["version"]): m for m in stats["models"]}
    usage = {(u.model, u.version): u for u in report.versions}
    rows = []
    for model, version in sorted(stored.keys() | usage.keys()):
        if q and q.lower() not in model.lower():
            continue
        held = stored.get((model, version), {})
        rows.append(
            VersionRow(
                model=model,
                version=version,
                entries=int(held.get("entries", 0)),
                expired=int(held.get("expired", 0)),
                hits=int(held.get("hits", 0)),
                usage=usage.get((model, version)) or CacheSavings(model=model, version=version),
            )
        )
    return rows


def hit_rate_figure(report: CacheSavingsReport) -> dict[str, Any]:
    """Each model version's hit rate per hour, in percent (gaps where it had no requests)."""
    fig = go.Figure()
    colours = charts.version_colours([(series.model, series.version) for series in report.series])
    for series in report.series:
        fig.add_trace(
            go.Scatter(
                x=[hour.isoformat() for hour in series.hours],
                y=[None if rate is None else round(rate * 100, 2) for rate in series.hit_rates],
                name=series.label,
                mode="lines+markers",
                connectgaps=False,
                line={"color": colours[(series.model, series.version)], "width": 2},
                marker={"size": 4},
                hovertemplate="%{y:.2f} %<extra>%{fullData.name}</extra>",
            )
        )
    fig.update_layout(
        **charts.layout(
            height=280,
            legend=bool(report.series),
            xaxis=charts.axis(type="date", range=[report.since.isoformat(), report.until.isoformat()]),
            yaxis=charts.axis(title={"text": "hit rate, %"}, range=[0, 100], zeroline=False),
        )
    )
    figure: dict[str, Any] = orjson.loads(fig.to_json())
    return figure


class PurgeForm(forms.Form):
    """What to purge: every entry matching all the filters given (at least one)."""

    model = forms.CharField(label="Model", required=False, max_length=255, help_text="the public model name")
    version = forms.CharField(label="Version", required=False, max_length=50,
                              help_text="of the model given, or of every model when alone")  # fmt: skip
    organization = forms.ModelChoiceField(
        label="Organisation", required=False, queryset=Organization.objects.none(), empty_label="Any organisation",
        help_text="whose requests stored the entries",
    )  # fmt: skip

    def __init__(self, *args: Any, organizations: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["organization"].queryset = organizations  # type: ignore[attr-defined]

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        for name in ("model", "version"):
            cleaned[name] = (cleaned.get(name) or "").strip() or None
        if not self.errors and not any(cleaned.get(n) for n in ("model", "version", "organization")):
            raise forms.ValidationError("Give at least one of model, version or organisation.")
        return cleaned

    def filters(self) -> dict[str, Any]:
        data = self.cleaned_data
        organization: Organization | None = data.get("organization")
        return {"model": data["model"], "version": data["version"],
                "organization_id": organization.pk if organization is not None else None}  # fmt: skip


def _sizes(stats: dict[str, Any]) -> list[tuple[str, int]]:
    return [
        ("Table", stats["table_bytes"]),
        ("Indexes (all)", stats["index_bytes"]),
        ("HNSW indexes", stats["hnsw_index_bytes"]),
    ]


@platform_admin_required
def cache_overview(request: HttpRequest) -> HttpResponse:
    form = CacheFilterForm(request.GET or None)
    filters = form.cleaned_data if form.is_valid() else {}
    window = WINDOWS[filters.get("window") or DEFAULT_WINDOW]
    now = timezone.now()
    report = cache_savings(span=window.span, now=now)
    stats = cache_stats()
    rows = _version_rows(stats, report, filters.get("q", ""))
    models = {row.model for row in rows}
    quality = quality_context(
        cache_quality(models=models),
        hits=cache_hits_by_tier(since=report.since, until=now, models=models),
        raised=entries_raised_by_mismatch(models=models),
    )
    saved: dict[str, Decimal] = {}
    for version in report.versions:
        saved[version.model] = saved.get(version.model, Decimal(0)) + version.saved
    for row in quality["quality"]:
        row["saved"] = money(saved.get(row["model"], Decimal(0)), str(settings.BILLING_CURRENCY))
    context = {
        **quality,
        "feedback_form": FeedbackForm(),
        "form": form,
        "window": window,
        "tier_window": window.label.lower(),
        "report": report,
        "stats": stats,
        "sizes": _sizes(stats),
        "page": page_of(request, rows, VERSIONS_PER_PAGE),
        "query": query_without_page(request),
        "figure": hit_rate_figure(report),
        "purge_form": PurgeForm(organizations=organizations_visible_to(request.user).order_by("name")),
        "defaults": CacheRules.defaults(),
        "min_similarity": settings.SEMANTIC_CACHE_MIN_SIMILARITY,
        "wrong_hit_budget": settings.SEMANTIC_CACHE_WRONG_HIT_BUDGET * 100,
        "cache_enabled": settings.SEMANTIC_CACHE_ENABLED,
    }
    return render(request, "console/cache/cache.html", context)


def _percent(share: float) -> str:
    value = share * 100
    return f"{value:.2f} %" if value < 10 else f"{value:.1f} %"


# The tiers in the order a lookup tries them, in words (serving.semcache: verify's word tiers,
# then budget.PARAPHRASE); UNRECORDED_WORD_TIER only where such older hits fall in the window.
TIER_LABELS = {
    EXACT: "Same text",
    "same": "Same words",
    "typo": "Same words but for a typo",
    "reordered": "Same words, a clause moved",
    PARAPHRASE: "Paraphrases (learned verifier)",
    UNRECORDED_WORD_TIER: "Same words, tier not recorded (older hits)",
}
ALWAYS, SERVING, CLOSED, OFF = "always", "serving", "closed", "off"
STATE_LABELS = {ALWAYS: "always served", SERVING: "serving", CLOSED: "closed: outside δ",
                OFF: "off (the model's policy)"}  # fmt: skip


@dataclass(frozen=True)
class TierRow:
    """One tier of one model: its hits in the window, and its audits and estimate so far."""

    tier: str
    label: str
    hits: int
    share: str  # of the model's requests in the window
    audits: int | None = None  # None: the tier is not audited (the same text; older hits)
    disagreed: int = 0
    reported: int = 0
    observed: str = ""  # the wrong rate from audits and reports alone, with its 95 % interval
    estimate: str = ""  # with the prior too: what decides
    state: str = ""

    @property
    def state_label(self) -> str:
        return STATE_LABELS.get(self.state, "")


def _rate(wrong: float, n: float) -> str:
    low, high = wilson(wrong, n)
    return f"{_percent(wrong / n)} [{_percent(low)} to {_percent(high)}]"


def _tier_state(q: ModelQuality, t: TierQuality, bound: float) -> str:
    if t.tier == PARAPHRASE and not q.paraphrases:
        return OFF
    return SERVING if t.estimate.high <= bound else CLOSED


def tier_rows(q: ModelQuality, hits: TierHits | None, *, bound: float) -> list[TierRow]:
    """A model's tiers: hits served in the window (``hits``) and their share of its requests;
    audits, disagreements and reports since its counters began, the wrong rate they alone
    show and the estimate with the prior; serving or closed against ``bound``."""
    hits = hits or TierHits(model=q.model)

    def share(tier: str) -> str:
        found = hits.share(tier)
        return "—" if found is None else _percent(found)

    rows = [TierRow(tier=EXACT, label=TIER_LABELS[EXACT], hits=hits.hits.get(EXACT, 0), share=share(EXACT),
                    state=ALWAYS)]  # fmt: skip
    for t in q.tiers:
        record = t.record
        n = record.audits + record.reported
        rows.append(
            TierRow(
                tier=t.tier, label=TIER_LABELS.get(t.tier, t.tier), hits=hits.hits.get(t.tier, 0), share=share(t.tier),
                audits=record.audits, disagreed=record.disagreed, reported=record.reported,
                observed=_rate(record.disagreed + record.reported, n) if n else "no audits yet",
                estimate=f"{_percent(t.estimate.rate)} [{_percent(t.estimate.low)} to {_percent(t.estimate.high)}]",
                state=_tier_state(q, t, bound),
            )
        )  # fmt: skip
    if hits.hits.get(UNRECORDED_WORD_TIER):
        tier = UNRECORDED_WORD_TIER
        rows.append(TierRow(tier=tier, label=TIER_LABELS[tier], hits=hits.hits[tier], share=share(tier)))
    return rows


def _raised_text(found: RaisedEntries | None) -> str:
    if found is None:
        return "0"
    return f"at least {found.raised:,} (of the first {found.scanned:,} read)" if found.capped else f"{found.raised:,}"


def quality_rows(
    quality: list[ModelQuality],
    *,
    hits: dict[str, TierHits] | None = None,
    raised: dict[str, RaisedEntries] | None = None,
    own_budget: float | None = None,
) -> list[dict[str, Any]]:
    """The cache-quality table's rows (templates/console/cache/_quality.html), each with its
    tiers; ``own_budget``: an organisation's own bound, where stricter than a model's the one
    its requests are served under."""
    rows = []
    for q in quality:
        bound = q.budget if own_budget is None else min(q.budget, own_budget)
        tiers = tier_rows(q, (hits or {}).get(q.model), bound=bound)
        served = [t.tier for t in tiers[1:] if t.state == SERVING]
        rows.append({
            "model": q.model, "exact": q.exact_served, "semantic": q.semantic_served, "audits": q.audits,
            "disagreed": q.disagreed, "feedback": q.feedback, "estimate": _percent(q.estimate.rate),
            "interval": f"{_percent(q.estimate.low)} to {_percent(q.estimate.high)}", "budget": _percent(q.budget),
            "own_budget": _percent(bound) if bound < q.budget else "",
            "tiers": ", ".join(served) or "the same text only", "tier_rows": tiers,
            "raised": _raised_text((raised or {}).get(q.model)) if raised is not None else None,
        })  # fmt: skip
    return rows


def quality_context(
    quality: list[ModelQuality],
    *,
    hits: dict[str, TierHits] | None = None,
    raised: dict[str, RaisedEntries] | None = None,
    own_budget: float | None = None,
) -> dict[str, Any]:
    return {
        "quality": quality_rows(quality, hits=hits, raised=raised, own_budget=own_budget),
        "prior_served": settings.SEMANTIC_CACHE_PRIOR_SERVED,
        "prior_wrong": settings.SEMANTIC_CACHE_PRIOR_WRONG,
        "paraphrase_prior_served": settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_SERVED,
        "paraphrase_prior_wrong": settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_WRONG,
    }


class FeedbackForm(forms.Form):
    request_id = forms.CharField(label="Request id", max_length=80,
                                 help_text="the x-request-id of the answer, or its id (chatcmpl-…)")  # fmt: skip
    reason = forms.CharField(label="What was wrong", required=False, max_length=500)

    def clean_request_id(self) -> uuid.UUID:
        parsed = parse_request_id(self.cleaned_data["request_id"])
        if parsed is None:
            raise forms.ValidationError("Give the x-request-id header's UUID or the answer's id (chatcmpl-…).")
        return parsed


@platform_admin_required
@require_http_methods(["POST"])
def cache_feedback(request: HttpRequest) -> HttpResponse:
    """A platform admin reports an answer served from the cache as wrong (any organisation)."""
    form = FeedbackForm(request.POST)
    if form.is_valid():
        try:
            made = report(form.cleaned_data["request_id"], organization_id=None,
                          reported_by=request.user.get_username(), reason=form.cleaned_data["reason"])  # fmt: skip
        except NotServedFromCache:
            messages.error(request, "No answer from the cache is on record for that request (or its window passed).")
        else:
            entries = f"{made.tightened} entr{'y' if made.tightened == 1 else 'ies'}"
            messages.success(
                request, f"Recorded: {made.model}'s answer at the {made.wording} tier; {entries} tightened."
            )
    else:
        messages.error(request, " ".join(str(e) for errors in form.errors.values() for e in errors))
    return redirect(reverse("console:cache"))


@platform_admin_required
@require_http_methods(["GET", "POST"])
def cache_purge_confirm(request: HttpRequest) -> HttpResponse:
    """GET: how many entries the filters match, and a button to purge them; POST: purge."""
    organizations = organizations_visible_to(request.user).order_by("name")
    form = PurgeForm(request.POST if request.method == "POST" else request.GET, organizations=organizations)
    if not form.is_valid():
        return render(request, "console/cache/purge.html", {"form": form, "count": None}, status=400)
    filters = form.filters()
    if request.method == "POST":
        try:
            purged = cache_purge(model=filters["model"], version=filters["version"],
                                 organization=filters["organization_id"])  # fmt: skip
        except InvalidInput as exc:
            form.add_error(None, exc.message)
            return render(request, "console/cache/purge.html", {"form": form, "count": None}, status=400)
        messages.success(request, f"Purged {purged:,} cache entr{'y' if purged == 1 else 'ies'} ({_describe(form)}).")
        return redirect(reverse("console:cache"))
    context = {"form": form, "count": cache_entries_count(**filters), "described": _describe(form)}
    return render(request, "console/cache/purge.html", context)


def _describe(form: PurgeForm) -> str:
    data = form.cleaned_data
    parts = []
    if data.get("model"):
        parts.append(f"model {data['model']}")
    if data.get("version"):
        parts.append(f"version {data['version']}")
    if data.get("organization"):
        parts.append(f"organisation {data['organization'].name}")
    return ", ".join(parts)


# --- Policies -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyRow:
    model: Model
    policy: CachePolicy | None  # None: the defaults apply


class PolicyFilterForm(forms.Form):
    q = forms.CharField(label="Model name", required=False, max_length=255)


@platform_admin_required
def cache_policy_list(request: HttpRequest) -> HttpResponse:
    form = PolicyFilterForm(request.GET or None)
    q = form.cleaned_data.get("q", "") if form.is_valid() else ""
    page = page_of(request, models_for_board(q=q).order_by("name"), POLICIES_PER_PAGE)
    policies = cache_policies_by_model()
    context = {
        "form": form,
        "page": page,
        "rows": [PolicyRow(model=m, policy=policies.get(m.pk)) for m in page.object_list],
        "query": query_without_page(request),
        "defaults": CacheRules.defaults(),
    }
    return render(request, "console/cache/policies.html", context)


class CachePolicyForm(forms.Form):
    enabled = forms.BooleanField(label="Cache this model's answers", required=False)
    max_temperature = forms.DecimalField(
        label="Highest temperature cached", min_value=Decimal(0), max_value=Decimal(2), max_digits=3, decimal_places=2,
        help_text="requests sampling hotter than this neither use nor fill the cache (0-2)",
    )  # fmt: skip
    max_prompt_tokens = forms.IntegerField(label="Longest prompt cached (tokens)", min_value=1)
    ttl_seconds = forms.IntegerField(label="Time to live (seconds)", min_value=1, max_value=MAX_CACHE_TTL_SECONDS,
                                     help_text="how long a stored answer may be served")  # fmt: skip
    shared_scope = forms.BooleanField(
        label="Share entries across organisations", required=False,
        help_text="only for models whose answers are public: one organisation's answer may be served to another",
    )  # fmt: skip
    wrong_hit_budget = forms.DecimalField(
        label="Wrong-hit budget (%)", required=False, min_value=Decimal(0), max_value=Decimal(100), decimal_places=2,
        help_text="the share of wrong semantic hits accepted; a wording tier whose measured rate may exceed it is "
                  "answered by the engine instead (empty: the platform's default)",
    )  # fmt: skip
    paraphrases = forms.BooleanField(
        label="Serve paraphrases", required=False,
        help_text="prompts worded otherwise, judged by the learned verifier and held to each entry's own bound",
    )  # fmt: skip


def _policy_initial(policy: CachePolicy | None) -> dict[str, Any]:
    rules = CacheRules.defaults()
    if policy is None:
        return {"enabled": rules.enabled, "max_temperature": Decimal(str(rules.max_temperature)),
                "max_prompt_tokens": rules.max_prompt_tokens, "ttl_seconds": rules.ttl_seconds,
                "shared_scope": rules.shared_scope, "wrong_hit_budget": None,
                "paraphrases": rules.paraphrases}  # fmt: skip
    return {"enabled": policy.enabled, "max_temperature": policy.max_temperature,
            "max_prompt_tokens": policy.max_prompt_tokens, "ttl_seconds": policy.ttl_seconds,
            "shared_scope": policy.shared_scope, "wrong_hit_budget": policy.wrong_hit_budget,
            "paraphrases": CacheRules.of(policy).paraphrases}  # fmt: skip


@platform_admin_required
@require_http_methods(["GET", "POST"])
def cache_policy_edit(request: HttpRequest, name: str) -> HttpResponse:
    model = model_named(name=name)
    if model is None:
        raise Http404("No such model.")
    policy = cache_policies_by_model().get(model.pk)
    form = CachePolicyForm(request.POST if request.method == "POST" else None, initial=_policy_initial(policy))
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            cache_policy_set(model=model, actor=request.user, enabled=data["enabled"],
                             max_temperature=data["max_temperature"], max_prompt_tokens=data["max_prompt_tokens"],
                             ttl_seconds=data["ttl_seconds"], shared_scope=data["shared_scope"],
                             wrong_hit_budget=data.get("wrong_hit_budget"),
                             paraphrases=data["paraphrases"])  # fmt: skip
        except InvalidInput as exc:
            refuse(form, exc)
        else:
            messages.success(request, f"Saved the cache policy of {model.name}; gateways apply it at once.")
            return redirect(f"{reverse('console:cache-policies')}?{urlencode({'q': model.name})}")
    context = {"form": form, "model": model, "policy": policy}
    return render(request, "console/cache/policy_form.html", context, status=400 if form.errors else 200)


urlpatterns: list[URLPattern | URLResolver] = [
    path("console/cache/", cache_overview, name="cache"),
    path("console/cache/purge/", cache_purge_confirm, name="cache-purge"),
    path("console/cache/feedback/", cache_feedback, name="cache-feedback"),
    path("console/cache/policies/", cache_policy_list, name="cache-policies"),
    path("console/cache/policies/<slug:name>/", cache_policy_edit, name="cache-policy"),
]
NAV: list[NavItem] = [NavItem("Cache", "cache", CONSOLE)]
