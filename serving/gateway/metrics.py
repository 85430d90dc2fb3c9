"""Prometheus metrics of the data plane, and the /metrics endpoint.

With PROMETHEUS_MULTIPROC_DIR set (``make run`` sets it), every gateway process on the
host writes its samples there and /metrics on any of them shows the host's total.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from django.conf import settings
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

# By HTTP status, 499 included: a request whose client went away first (a cancel). It is not the
# server's error (billing.outcomes): an error rate or alert on this counter leaves status="499"
# out of both sides, e.g. sum(rate(inference_requests_total{status!~"2..|499"}[5m])) over
# sum(rate(inference_requests_total{status!="499"}[5m])).
REQUESTS = Counter(
    "inference_requests",
    "Admitted API requests by status (499: cancelled by the client, not an error).",
    ["model", "version", "endpoint", "status"],
)
LATENCY = Histogram(
    "inference_request_latency_seconds", "Whole-request latency.", ["model", "version"], buckets=LATENCY_BUCKETS
)
TTFT = Histogram("inference_ttft_seconds", "Time to first token (streams).", ["model", "version"], buckets=TTFT_BUCKETS)
TOKENS = Counter("inference_tokens", "Tokens metered.", ["model", "version", "kind"])
INFERENCES = Counter(
    "inference_predictions", "Items predicted by small models (rows of predict requests).",
    ["model", "version", "cache"],
)  # fmt: skip
IN_FLIGHT = Gauge("inference_in_flight", "Requests being served.", ["model"], multiprocess_mode="livesum")
REPLICA_IN_FLIGHT = Gauge(
    "inference_replica_in_flight", "Requests this gateway has running on a replica.", ["replica"],
    multiprocess_mode="livesum",
)  # fmt: skip
# Sampled by each gateway's routing refresher (serving.gateway.routing): a leak shows here first.
GATEWAY_TASKS = Gauge("gateway_asyncio_tasks", "asyncio tasks alive in a gateway process.", multiprocess_mode="livesum")
# Set by runworkers (its samples reach /metrics through PROMETHEUS_MULTIPROC_DIR under runplatform).
REPLICA_LOAD_SECONDS = Gauge(
    "inference_replica_load_seconds", "A replica's latest load time: engine start to its first good /health.",
    ["model", "version", "replica"], multiprocess_mode="mostrecent",
)  # fmt: skip
# The semantic cache (serving.semcache) and the embeddings cache.
CACHE_LOOKUPS = Counter(
    "inference_cache_lookups", "Cache lookups by outcome (hit, semantic-hit, miss, error, timeout).",
    ["model", "outcome"],
)  # fmt: skip
CACHE_LOOKUP_SECONDS = Histogram(
    "inference_cache_lookup_seconds", "Semantic cache lookup time: embedding, search and verification.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)  # fmt: skip
CACHE_REJECTIONS = Counter(
    "inference_cache_rejections", "Similar entries the verifier refused to serve, by why.", ["category"]
)
CACHE_STORED = Counter("inference_cache_stored", "Answers stored in the semantic cache.", ["model"])
CACHE_TOKENS_SAVED = Counter("inference_cache_tokens_saved", "Tokens answered from the cache.", ["model"])
CACHE_MONEY_SAVED = Counter(
    "inference_cache_money_saved", "What cache hits would have cost from an engine, less what they cost.",
    ["model", "currency"],
)  # fmt: skip
CACHE_WRONG_HIT_BUDGET = Gauge(
    "inference_cache_wrong_hit_budget", "The share of wrong hits the verifier is calibrated to stay under.",
    multiprocess_mode="max",
)  # fmt: skip
CACHE_WRONG_HIT_BUDGET.set(settings.SEMANTIC_CACHE_WRONG_HIT_BUDGET)
USAGE_EVENTS = Counter("inference_usage_events", "Usage events handed to the stream.", ["outcome"])
# Shadow traffic (serving.shadow.traffic): copies sent to a candidate version, by what became of
# them: ok, error (a non-2xx answer or a broken connection), timeout, dropped (this
# process already had its most copies in flight), unroutable (no ready candidate replica).
SHADOW_REQUESTS = Counter(
    "inference_shadow_requests", "Requests mirrored to a shadow candidate version, by outcome.",
    ["model", "version", "outcome"],
)  # fmt: skip


# Requests whose engine failed before the first byte and that were retried (serving.llm.call):
# from the version that failed to the one that answered, by the failure's code.
FALLBACKS = Counter(
    "inference_fallbacks", "Requests retried on another replica or version after an engine failure before the "
    "first byte.", ["model", "from_version", "to_version", "reason"],
)  # fmt: skip

# Prefix-aware routing (serving.gateway.prefixes): how each chat or completion request's replica was
# chosen among its version's. prefix: it held the longest known run of the prompt's leading
# blocks, within the load bound; load: the least busy (no replica under the bound held a block,
# prefix routing is off, or the prompt is shorter than a block).
PREFIX_ROUTING = Counter(
    "inference_prefix_routing", "Chat and completion requests by how their replica was chosen: prefix match or load.",
    ["model", "how"],
)  # fmt: skip


def _monitoring_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return [ipaddress.ip_network(n, strict=False) for n in settings.METRICS_ALLOWED_NETWORKS]


def metrics_allowed(request: HttpRequest) -> bool:
    """/metrics is for the monitoring system: a client on METRICS_ALLOWED_NETWORKS, or one
    presenting ``Authorization: Bearer <METRICS_TOKEN>`` (Prometheus' ``authorization``)."""
    token = settings.METRICS_TOKEN
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if token and scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token.encode()):
        return True
    try:
        address = ipaddress.ip_address(str(request.META.get("REMOTE_ADDR") or ""))
    except ValueError:
        return False
    return any(address in network for network in _monitoring_networks())


def metrics_refused() -> HttpResponse:
    """The 403 of every metrics path (/metrics, and the console's /metrics/platform and /metrics/engines)."""
    return HttpResponse(
        "Metrics are served to the monitoring network (METRICS_ALLOWED_NETWORKS) or with a bearer token "
        "(METRICS_TOKEN).\n",
        status=403,
        content_type="text/plain",
    )


def metrics_view(request: HttpRequest) -> HttpResponse:
    if not metrics_allowed(request):
        return metrics_refused()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        payload = generate_latest(registry)
    else:
        payload = generate_latest()
    return HttpResponse(payload, content_type=CONTENT_TYPE_LATEST)
