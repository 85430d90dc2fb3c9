"""The console's overview dashboard (platform admins): traffic, latency, errors and cache hits per
model version over a chosen window, from the rollups, with a live view over a WebSocket; the
batch queue's depth and throughput; and what needs attention now (``console.monitoring.attention``:
the alert rules' conditions, from the platform's own state)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.template.defaultfilters import pluralize
from django.urls import URLPattern, URLResolver, path, reverse

from billing.selectors import month_so_far
from billing.usage_series import DEFAULT_RANGE, TIME_RANGES
from console.monitoring import PlatformState, attention, platform_state
from console.pages.access import platform_admin_required
from console.pages.nav import CONSOLE, NavItem
from console.pages.overview_data import CHARTS, dashboard
from core import formats
from rollout.selectors import canaries_live_count
from serving.batches.selectors import batch_queue_stats

# The headline numbers, in the order the page shows them (keys of overview_data's headline).
HEADLINES = (
    ("requests_per_second", "Requests/s"),
    ("output_tokens_per_second", "Output tokens/s"),
    ("latency_p50_ms", "Latency p50"),
    ("latency_p99_ms", "Latency p99"),
    ("ttft_p50_ms", "TTFT p50"),
    ("error_rate", "Error rate"),
    ("cancelled", "Cancelled by client"),
    ("cache_hit_rate", "Cache hit rate"),
    ("requests", "Requests"),
)


@dataclass(frozen=True)
class Glance:
    """One figure an operator reads first, where to act on it, and whether it wants a look."""

    key: str
    label: str
    value: str
    detail: str
    url: str
    warn: bool = False


def at_a_glance(state: PlatformState, queue: dict[str, Any], *, now: datetime) -> list[Glance]:
    """Revenue this month, replicas, budget alerts, canaries and the batch backlog, with links."""
    revenue, alerts = month_so_far(today=now.date())
    wanted = sum(d.wanted for d in state.deployments)
    ready = sum(min(d.ready, d.wanted) for d in state.deployments)
    short = sum(1 for d in state.deployments if d.ready < d.wanted or d.failed)
    canaries = canaries_live_count()
    return [
        Glance("revenue", "Revenue this month", formats.money(revenue),
               f"usage cost since {now:%Y-%m}-01, before tax", reverse("console:invoices")),
        Glance("replicas", "Replicas ready", f"{ready} of {wanted}",
               f"{short} deployment{pluralize(short)} short or failing" if short else "every deployment as wanted",
               reverse("console:deployments"), warn=bool(short)),
        Glance("budget_alerts", "Budget alerts this month", f"{alerts:,}",
               "spend caps and token quotas crossed", reverse("console:customers"), warn=bool(alerts)),
        Glance("canaries", "Canaries live", f"{canaries:,}", "running or paused", reverse("console:canaries")),
        Glance("batch_backlog", "Batch lines waiting", f"{queue['waiting']:,}",
               f"{queue['in_progress']} batch{pluralize(queue['in_progress'], 'es')} in progress",
               reverse("console:batches"),
               warn=state.batch_backlog_age_seconds > 6 * 3600),
    ]  # fmt: skip


@platform_admin_required
def overview(request: HttpRequest) -> HttpResponse:
    range_key = request.GET.get("range", DEFAULT_RANGE)
    if range_key not in TIME_RANGES:
        range_key = DEFAULT_RANGE
    data = dashboard(range_key=range_key)
    state = platform_state()
    queue = batch_queue_stats()
    context = {
        "data": data,
        "ranges": TIME_RANGES.values(),
        "range": TIME_RANGES[range_key],
        "headlines": [(key, label, data["headline"][key]) for key, label in HEADLINES],
        "charts": CHARTS,
        "batch_queue": queue,
        "attention": attention(state),
        "glance": at_a_glance(state, queue, now=datetime.now(UTC)),
    }
    return render(request, "console/overview/overview.html", context)


urlpatterns: list[URLPattern | URLResolver] = [
    path("console/", overview, name="overview"),
]
NAV: list[NavItem] = [NavItem("Overview", "overview", CONSOLE)]
