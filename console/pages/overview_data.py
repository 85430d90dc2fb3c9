"""The overview's figures and headline numbers, built server-side with plotly from the rollups,
and the gateways' own counters (this host's Prometheus samples) for the live view.

The page renders ``dashboard(...)`` once; the live consumer sends the same payload every few
seconds and the page applies it with ``Plotly.react``, so both read the same code.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
import plotly.graph_objects as go

from billing import outcomes
from billing.usage_series import Bucket, UsageOverview, VersionSeries, busiest, usage_overview
from console.pages import charts


@dataclass(frozen=True)
class Chart:
    key: str
    title: str
    unit: str
    # Each entry: (line name suffix, dash style, the bucket's value).
    lines: tuple[tuple[str, str, Callable[[Bucket], float | None]], ...]
    percent: bool = False


def _percent(value: float | None) -> float | None:
    return None if value is None else round(100 * value, 3)


def _requests(b: Bucket) -> float:
    return round(b.requests_per_second, 6)


def _tokens(b: Bucket) -> float:
    return round(b.output_tokens_per_second, 6)


CHARTS: tuple[Chart, ...] = (
    Chart("requests", "Requests per second", "req/s", (("", "solid", _requests),)),
    Chart("tokens", "Output tokens per second", "tokens/s", (("", "solid", _tokens),)),
    Chart(
        "latency",
        "Latency p50 and p99",
        "ms",
        (("p50", "solid", lambda b: b.latency_p50_ms), ("p99", "dot", lambda b: b.latency_p99_ms)),
    ),
    Chart(
        "ttft",
        "Time to first token p50 and p99",
        "ms",
        (("p50", "solid", lambda b: b.ttft_p50_ms), ("p99", "dot", lambda b: b.ttft_p99_ms)),
    ),
    # A client's cancel is no error (billing.outcomes): the error rate leaves cancels out; the
    # dotted line is the share of requests their clients cancelled, beside it.
    Chart(
        "errors",
        "Error rate, and requests cancelled by their clients (dotted)",
        "%",
        (
            ("", "solid", lambda b: _percent(b.error_rate)),
            ("cancelled", "dot", lambda b: _percent(b.cancelled_share)),
        ),
        percent=True,
    ),
    Chart("cache", "Cache hit rate", "%", (("", "solid", lambda b: _percent(b.cache_hit_rate)),), percent=True),
)


# A chart names its busiest versions; the rest are one "other" line (the table lists them all).
CHART_SERIES = 5
CHART_HEIGHT = 300  # the plot itself keeps about 250 px: the legend sits beside it


def _figure(chart: Chart, overview: UsageOverview) -> dict[str, Any]:
    fig = go.Figure()
    shown, other = busiest(overview.series, CHART_SERIES)
    colours = charts.version_colours([(series.model, series.version) for series in shown])
    for series in [*shown, *([other] if other else [])]:
        colour = colours.get((series.model, series.version), charts.OTHER)
        for suffix, dash, value in chart.lines:
            fig.add_trace(
                go.Scatter(
                    x=[b.start.isoformat() for b in series.buckets],
                    y=[value(b) for b in series.buckets],
                    name=f"{series.label} {suffix}".strip(),
                    legendgroup=series.label,
                    mode="lines+markers",
                    line={"color": colour, "dash": dash, "width": 2},
                    marker={"size": 4},
                    hovertemplate=f"%{{y:.4g}} {chart.unit}<extra>%{{fullData.name}}</extra>",
                )
            )
    fig.update_layout(
        **charts.layout(
            height=CHART_HEIGHT, legend=bool(overview.series), legend_beside=True,
            xaxis=charts.axis(type="date", range=[overview.start.isoformat(), overview.now.isoformat()],
                              hoverformat="%Y-%m-%d %H:%M UTC"),
            yaxis=charts.axis(title={"text": chart.unit}, rangemode="tozero", zeroline=False),
            uirevision=overview.time_range.key,  # Plotly.react keeps a person's zoom across live updates
        )
    )  # fmt: skip
    figure: dict[str, Any] = orjson.loads(fig.to_json())
    return figure


def _number(value: float | None, digits: int = 2, unit: str = "") -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}{unit}"


def _headline(total: Bucket) -> dict[str, str]:
    return {
        "requests": f"{total.requests:,}",
        "requests_per_second": _number(total.requests_per_second, 3),
        "output_tokens_per_second": _number(total.output_tokens_per_second, 2),
        "latency_p50_ms": _number(total.latency_p50_ms, 0, " ms"),
        "latency_p99_ms": _number(total.latency_p99_ms, 0, " ms"),
        "ttft_p50_ms": _number(total.ttft_p50_ms, 0, " ms"),
        "error_rate": _number(_percent(total.error_rate), 2, " %"),
        "cancelled": f"{total.cancelled:,}",
        "cache_hit_rate": _number(_percent(total.cache_hit_rate), 1, " %"),
    }


def _row(series: VersionSeries) -> dict[str, str]:
    assert series.total is not None
    return {"model": series.model, "version": series.version, **_headline(series.total)}


def dashboard(*, range_key: str, now: datetime | None = None) -> dict[str, Any]:
    """Everything the overview shows for one window: headline numbers, one figure per chart,
    one table row per model version (JSON-ready)."""
    overview = usage_overview(range_key=range_key, now=now)
    return {
        "range": overview.time_range.key,
        "at": overview.now.isoformat(),
        "headline": _headline(overview.total),
        "figures": {chart.key: _figure(chart, overview) for chart in CHARTS},
        "rows": [_row(series) for series in overview.series],
    }


# What a version's own page charts (the overview's charts, for that version alone).
VERSION_CHARTS = ("requests", "latency", "errors")


def version_figures(*, model: str, version: str, range_key: str = "day", now: datetime | None = None) -> dict[str, Any]:
    """One version's figures over ``range_key``: its headline numbers and requests, latency
    and error charts, from the rollups (the overview's, for that version alone)."""
    overview = usage_overview(range_key=range_key, now=now, model=model, version=version)
    return {
        "range": overview.time_range,
        "requests": overview.total.requests,
        "headline": _headline(overview.total),
        "figures": {chart.key: _figure(chart, overview) for chart in CHARTS if chart.key in VERSION_CHARTS},
        "titles": {chart.key: chart.title for chart in CHARTS if chart.key in VERSION_CHARTS},
    }


# --- The gateways' counters -----------------------------------------------------------
# Rollups lag the traffic by a minute or so (billing.rollups runs every minute); the
# gateways count every answer as it happens. Reading this host's Prometheus samples costs
# no query: with PROMETHEUS_MULTIPROC_DIR (``make run``) they are every gateway process's
# files, else this process's own registry (daphne serving the API and the console alike).


@dataclass(frozen=True)
class GatewaySample:
    at: float  # time.monotonic()
    requests: float = 0.0
    errors: float = 0.0  # not 2xx, but for a client's cancel
    cancelled: float = 0.0  # status 499: the client went away first (billing.outcomes)
    completion_tokens: float = 0.0
    in_flight: float = 0.0
    by_version: dict[str, float] = field(default_factory=dict)


def _registry() -> Any:
    from prometheus_client import REGISTRY, CollectorRegistry, multiprocess

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return registry
    return REGISTRY


def replica_in_flight() -> dict[str, float]:
    """Requests this host's gateways have running on each replica (by replica id, as text)."""
    found: dict[str, float] = {}
    for metric in _registry().collect():
        for sample in metric.samples:
            if sample.name == "inference_replica_in_flight":
                replica = str(sample.labels.get("replica", ""))
                found[replica] = found.get(replica, 0.0) + sample.value
    return found


def gateway_sample() -> GatewaySample:
    """The counters' totals now, over every model version this host's gateways served."""
    registry = _registry()
    requests = errors = cancelled = tokens = in_flight = 0.0
    by_version: dict[str, float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == "inference_requests_total":
                requests += sample.value
                label = f"{sample.labels.get('model', '')}:{sample.labels.get('version', '')}"
                by_version[label] = by_version.get(label, 0.0) + sample.value
                status = str(sample.labels.get("status", ""))
                if not status.isdigit():
                    continue
                if outcomes.cancelled_by_client(int(status)):
                    cancelled += sample.value
                elif outcomes.failed(int(status)):
                    errors += sample.value
            elif sample.name == "inference_tokens_total" and sample.labels.get("kind") == "completion":
                tokens += sample.value
            elif sample.name == "inference_in_flight":
                in_flight += sample.value
    return GatewaySample(
        at=time.monotonic(),
        requests=requests,
        errors=errors,
        cancelled=cancelled,
        completion_tokens=tokens,
        in_flight=in_flight,
        by_version=by_version,
    )


def gateway_rates(before: GatewaySample | None, after: GatewaySample) -> dict[str, str]:
    """What the gateways did between two samples, per second; dashes before a second sample."""
    elapsed = after.at - before.at if before is not None else 0.0
    if before is None or elapsed <= 0:
        return {"requests_per_second": "—", "output_tokens_per_second": "—", "errors": "—", "cancelled": "—",
                "in_flight": _number(after.in_flight, 0), "at": datetime.now(UTC).isoformat()}  # fmt: skip
    return {
        "requests_per_second": _number(max(after.requests - before.requests, 0) / elapsed, 2),
        "output_tokens_per_second": _number(max(after.completion_tokens - before.completion_tokens, 0) / elapsed, 1),
        "errors": _number(max(after.errors - before.errors, 0), 0),
        "cancelled": _number(max(after.cancelled - before.cancelled, 0), 0),
        "in_flight": _number(after.in_flight, 0),
        "at": datetime.now(UTC).isoformat(),
    }
