"""Prometheus metrics of the data plane, and the /metrics endpoint.

With PROMETHEUS_MULTIPROC_DIR set (``make run`` sets it), every gateway process on the
host writes its samples there and /metrics on any of them shows the host's total.
"""

from __future__ import annotations

import os

from django.http import HttpRequest, HttpResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)

REQUESTS = Counter(
    "inference_requests", "Admitted API requests by outcome.", ["model", "version", "endpoint", "status"]
)
LATENCY = Histogram(
    "inference_request_latency_seconds", "Whole-request latency.", ["model", "version"], buckets=LATENCY_BUCKETS
)
TTFT = Histogram("inference_ttft_seconds", "Time to first token (streams).", ["model", "version"], buckets=TTFT_BUCKETS)
TOKENS = Counter("inference_tokens", "Tokens metered.", ["model", "version", "kind"])
IN_FLIGHT = Gauge("inference_in_flight", "Requests being served.", ["model"], multiprocess_mode="livesum")
REPLICA_IN_FLIGHT = Gauge(
    "inference_replica_in_flight", "Requests this gateway has running on a replica.", ["replica"],
    multiprocess_mode="livesum",
)  # fmt: skip
USAGE_EVENTS = Counter("inference_usage_events", "Usage events handed to the stream.", ["outcome"])


def metrics_view(request: HttpRequest) -> HttpResponse:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        payload = generate_latest(registry)
    else:
        payload = generate_latest()
    return HttpResponse(payload, content_type=CONTENT_TYPE_LATEST)
