"""The console's overview dashboard (platform admins): traffic, latency, errors and cache hits per
model version over a chosen window, from the rollups, with a live view over a WebSocket; the
batch queue's depth and throughput; and what needs attention now (``console.monitoring.attention``:
the alert rules' conditions, from the platform's own state)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import URLPattern, URLResolver, path

from billing.usage_series import DEFAULT_RANGE, TIME_RANGES
from console.monitoring import attention, platform_state
from console.pages.access import platform_admin_required
from console.pages.nav import CONSOLE, NavItem
from console.pages.overview_data import CHARTS, dashboard
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


@platform_admin_required
def overview(request: HttpRequest) -> HttpResponse:
    range_key = request.GET.get("range", DEFAULT_RANGE)
    if range_key not in TIME_RANGES:
        range_key = DEFAULT_RANGE
    data = dashboard(range_key=range_key)
    context = {
        "data": data,
        "ranges": TIME_RANGES.values(),
        "range": TIME_RANGES[range_key],
        "headlines": [(key, label, data["headline"][key]) for key, label in HEADLINES],
        "charts": CHARTS,
        "batch_queue": batch_queue_stats(),
        "attention": attention(platform_state()),
    }
    return render(request, "console/overview/overview.html", context)


urlpatterns: list[URLPattern | URLResolver] = [
    path("console/", overview, name="overview"),
]
NAV: list[NavItem] = [NavItem("Overview", "overview", CONSOLE)]
