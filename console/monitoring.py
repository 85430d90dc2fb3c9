"""The platform's own state: for Prometheus (``GET /metrics/platform``) and for the console's
overview ("Needs attention"), read once per scrape or page by ``platform_state``.

``/metrics`` (``serving.gateway.metrics``) is what each gateway process counts as requests pass
(latency, TTFT, statuses, fallbacks, the cache); it says nothing of what only the database and
Redis know. ``platform_state`` reads that, a few small queries, the same from any gateway
(scrape one, through the balancer): replicas ready against wanted per deployment, failed
replicas, the metering stream's backlog and its oldest event's age, the latest hourly
reconciliation, each organisation's monthly budget used, the batch queue's backlog and the
semantic cache's estimated wrong-hit rate per model. The alert rules
(deploy/prometheus/alerts.yml) and the dashboard (deploy/grafana/) read the gauges;
``attention`` turns the same state into the overview's list, with the alerts' thresholds
(``THRESHOLDS``; tests/ops/test_monitoring.py checks the two agree).

Guarded like /metrics (METRICS_ALLOWED_NETWORKS or METRICS_TOKEN). ``/metrics/engines`` is
Prometheus' HTTP service discovery of the engines, from the replica rows.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

from django.db.models import Count, Min, Q, Sum
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import reverse
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from accounts.models import Organization
from billing import invoicing
from billing.models import Reconciliation, UsageRollup
from core.formats import counted
from core.keys import usage_dead_letters, usage_stream
from core.redis import sync_redis
from registry.models import Replica
from registry.selectors import heartbeat_fresh_after, serving_deployments
from serving.batches.models import Batch, BatchLine
from serving.gateway.metrics import metrics_allowed, metrics_refused
from serving.semcache.selectors import cache_quality

# The alert rules' thresholds where the overview shows the same condition (deploy/prometheus/alerts.yml).
THRESHOLDS = {
    "MeteringLagging": 120.0,  # seconds the oldest usage event has waited
    "BudgetNearlySpent": 0.9,  # share of a monthly budget used
    "BatchBacklogOld": 6 * 3600.0,  # seconds the oldest batch with lines not started has waited
}
DEPLOYMENT_LABELS = ["model", "version", "deployment"]


@dataclass(frozen=True)
class DeploymentState:
    model: str
    version: str
    deployment_id: int
    wanted: int
    ready: int  # serving, ready, with a fresh heartbeat (standbys not counted)
    failed: int


@dataclass(frozen=True)
class BudgetState:
    organization_id: int
    organization: str  # its slug
    budget: str  # "spend" | "tokens"
    used_ratio: float


@dataclass(frozen=True)
class CacheState:
    model: str
    estimate: float
    upper: float
    budget: float


@dataclass(frozen=True)
class ReconciliationState:
    ok: bool
    events_records: int
    records_rollups: int
    cost: float
    age_seconds: float


@dataclass(frozen=True)
class PlatformState:
    deployments: list[DeploymentState]
    # None: Redis did not answer (the metering and cache figures are unknown then)
    usage_stream_length: int | None
    usage_oldest_age_seconds: float | None
    usage_dead_letters: int | None
    reconciliation: ReconciliationState | None
    budgets: list[BudgetState]
    batch_lines_waiting: int
    batch_backlog_age_seconds: float
    cache: list[CacheState] = field(default_factory=list)


def platform_state() -> PlatformState:
    """The platform's state now, from PostgreSQL and Redis."""
    length, age, dead = _metering()
    waiting, backlog = _batches()
    rows = _serving_rows()
    return PlatformState(
        deployments=[
            DeploymentState(d.version.model.name, d.version.version, d.pk, d.replicas, d.ready_now, d.failed_now)
            for d in rows
        ],
        usage_stream_length=length,
        usage_oldest_age_seconds=age,
        usage_dead_letters=dead,
        reconciliation=_reconciliation(),
        budgets=_budgets(),
        batch_lines_waiting=waiting,
        batch_backlog_age_seconds=backlog,
        cache=_cache({d.version.model.name for d in rows if d.version.model.task == "chat"}),
    )


def _serving_rows() -> list[Any]:
    """The serving deployments with their model, and their ready (fresh, not standby) and failed replicas."""
    ready = Q(replica_set__state=Replica.State.READY, replica_set__standby=False,
              replica_set__last_heartbeat__gte=heartbeat_fresh_after())  # fmt: skip
    return list(
        serving_deployments().annotate(
            ready_now=Count("replica_set", filter=ready),
            failed_now=Count("replica_set", filter=Q(replica_set__state=Replica.State.FAILED)),
        )
    )


def _metering() -> tuple[int | None, float | None, int | None]:
    try:
        pipe = sync_redis().pipeline(transaction=False)
        pipe.xlen(usage_stream())
        pipe.xrange(usage_stream(), "-", "+", count=1)  # stored events are deleted: the oldest waits
        pipe.xlen(usage_dead_letters())
        length, first, dead = pipe.execute()
    except RedisError:
        return None, None, None
    age = 0.0
    if first:
        event_id = first[0][0]
        millis = int((event_id.decode() if isinstance(event_id, bytes) else str(event_id)).split("-")[0])
        age = max(0.0, time.time() - millis / 1000)
    return int(length), age, int(dead)


def _reconciliation() -> ReconciliationState | None:
    latest = Reconciliation.objects.order_by("-period_end", "-pk").first()
    if latest is None:
        return None
    return ReconciliationState(
        ok=latest.ok,
        events_records=latest.stream_events - latest.records,
        records_rollups=latest.records - latest.rollup_requests,
        cost=float(latest.records_cost - latest.rollup_cost),
        age_seconds=(timezone.now() - latest.period_end).total_seconds(),
    )


def _budgets() -> list[BudgetState]:
    capped = Organization.objects.filter(
        Q(monthly_spend_cap__isnull=False) | Q(monthly_token_quota__isnull=False)
    ).only("pk", "slug", "monthly_spend_cap", "monthly_token_quota")
    limits = {org.pk: org for org in capped}
    if not limits:
        return []
    first = invoicing.month_start(timezone.now().date())
    sums = (
        UsageRollup.objects.filter(
            period=UsageRollup.Period.DAY, start__date__gte=first, organization_id__in=list(limits)
        )
        .values("organization_id")
        .annotate(cost=Sum("cost"), tokens=Sum("input_tokens") + Sum("output_tokens"))
        .order_by()
    )
    month = {row["organization_id"]: row for row in sums}
    out = []
    for pk, org in limits.items():
        row = month.get(pk, {})
        if org.monthly_spend_cap:
            spent = Decimal(row.get("cost") or 0)
            out.append(BudgetState(pk, org.slug, "spend", float(spent / org.monthly_spend_cap)))
        if org.monthly_token_quota:
            out.append(BudgetState(pk, org.slug, "tokens", (row.get("tokens") or 0) / org.monthly_token_quota))
    return out


def _batches() -> tuple[int, float]:
    waiting = BatchLine.objects.filter(status=BatchLine.Status.PENDING, batch__status=Batch.Status.IN_PROGRESS)
    oldest = Batch.objects.filter(
        Q(status=Batch.Status.VALIDATING) | Q(status=Batch.Status.IN_PROGRESS, lines__status=BatchLine.Status.PENDING)
    ).aggregate(at=Min("created_at"))["at"]
    return waiting.count(), (timezone.now() - oldest).total_seconds() if oldest else 0.0


def _cache(models: set[str]) -> list[CacheState]:
    try:
        found = cache_quality(models=models)
    except RedisError:
        return []
    return [CacheState(q.model, q.estimate.rate, q.estimate.high, q.budget) for q in found]


# --- Prometheus ----------------------------------------------------------------------------


class PlatformCollector(Collector):
    """Gauges read from PostgreSQL and Redis when scraped (names ``platform_*``)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = platform_state()
        wanted = GaugeMetricFamily(
            "platform_deployment_replicas_wanted", "Serving replicas a deployment wants.", labels=DEPLOYMENT_LABELS
        )
        ready = GaugeMetricFamily(
            "platform_deployment_replicas_ready",
            "Serving replicas ready with a fresh heartbeat (routable; standbys not counted).",
            labels=DEPLOYMENT_LABELS,
        )
        failed = GaugeMetricFamily(
            "platform_deployment_replicas_failed",
            "Replicas failed (their supervisor restarts them with backoff).",
            labels=DEPLOYMENT_LABELS,
        )
        for d in state.deployments:
            labels = [d.model, d.version, str(d.deployment_id)]
            wanted.add_metric(labels, d.wanted)
            ready.add_metric(labels, d.ready)
            failed.add_metric(labels, d.failed)
        yield from (wanted, ready, failed)
        if state.usage_stream_length is not None:  # else Redis did not answer: no figure, not a zero
            yield GaugeMetricFamily(
                "platform_usage_stream_length", "Usage events waiting to be stored (the metering worker's backlog).",
                value=state.usage_stream_length,
            )  # fmt: skip
            yield GaugeMetricFamily(
                "platform_usage_stream_oldest_age_seconds",
                "Age of the oldest usage event not yet stored (0 when none waits): the metering lag.",
                value=state.usage_oldest_age_seconds,
            )
            yield GaugeMetricFamily(
                "platform_usage_dead_letters", "Usage events the metering worker could not store (with why).",
                value=state.usage_dead_letters,
            )  # fmt: skip
        yield from self._reconciliation(state.reconciliation)
        used = GaugeMetricFamily(
            "platform_organization_budget_used_ratio",
            "This UTC month's use over the organisation's monthly cap (spend) or quota (tokens), from the daily "
            "rollups (the limiter counts requests in flight too, so it may be a little ahead).",
            labels=["organization", "budget"],
        )
        for b in state.budgets:
            used.add_metric([b.organization, b.budget], b.used_ratio)
        yield used
        yield GaugeMetricFamily(
            "platform_batch_lines_waiting", "Batch lines not started in batches in progress.",
            value=state.batch_lines_waiting,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "platform_batch_backlog_age_seconds",
            "Age of the oldest batch with lines still waiting (0 when none waits).",
            value=state.batch_backlog_age_seconds,
        )
        rate = GaugeMetricFamily(
            "platform_cache_wrong_hit_rate",
            "The semantic cache's estimated wrong-hit rate per model (audits and reports over a prior): the "
            "estimate and the upper end of its 95 % interval.",
            labels=["model", "bound"],
        )
        budget = GaugeMetricFamily(
            "platform_cache_wrong_hit_budget", "The wrong-hit rate each model's cache accepts.", labels=["model"]
        )
        for c in state.cache:
            rate.add_metric([c.model, "estimate"], c.estimate)
            rate.add_metric([c.model, "upper"], c.upper)
            budget.add_metric([c.model], c.budget)
        yield from (rate, budget)

    @staticmethod
    def _reconciliation(latest: ReconciliationState | None) -> Iterator[GaugeMetricFamily]:
        ok = GaugeMetricFamily(
            "platform_reconciliation_ok", "1 when the latest reconciliation found every delta zero, else 0."
        )
        delta = GaugeMetricFamily(
            "platform_reconciliation_delta",
            "The latest reconciliation's deltas: events - records, records - rollups (requests), records' cost - "
            "rollups' cost.",
            labels=["between"],
        )
        age = GaugeMetricFamily(
            "platform_reconciliation_age_seconds",
            "Seconds since the end of the period the latest reconciliation checked.",
        )
        if latest is not None:
            ok.add_metric([], 1 if latest.ok else 0)
            delta.add_metric(["events_records"], latest.events_records)
            delta.add_metric(["records_rollups"], latest.records_rollups)
            delta.add_metric(["cost"], latest.cost)
            age.add_metric([], latest.age_seconds)
        yield from (ok, delta, age)


# --- The console's overview ------------------------------------------------------------------


@dataclass(frozen=True)
class Attention:
    """A condition an operator should look at, with the console page that shows its detail."""

    alert: str  # the alert rule of the same condition (docs/monitoring.md explains each)
    title: str
    detail: str
    url: str


def attention(state: PlatformState) -> list[Attention]:
    """What the overview lists under "Needs attention", most urgent first."""
    out: list[Attention] = []
    deployments = reverse("console:deployments")
    for d in state.deployments:
        if d.ready < d.wanted:
            out.append(
                Attention(
                    "ReplicasBelowWanted",
                    f"{d.model}:{d.version} has {d.ready} of {d.wanted} replicas ready",
                    f"deployment {d.deployment_id}",
                    deployments,
                )
            )
        if d.failed:
            out.append(
                Attention(
                    "ReplicasFailing",
                    f"{d.model}:{d.version}: {counted(d.failed, 'replica')} failed",
                    "restarting with backoff; their engine logs say why",
                    deployments,
                )
            )
    reconciliation = reverse("console:reconciliation")
    if state.usage_stream_length is None:
        out.append(
            Attention("RedisUnreachable", "Redis did not answer", "metering and cache figures unknown", reconciliation)
        )
    if state.usage_oldest_age_seconds is not None and state.usage_oldest_age_seconds > THRESHOLDS["MeteringLagging"]:
        out.append(
            Attention(
                "MeteringLagging",
                f"Usage events have waited {state.usage_oldest_age_seconds:.0f} s to be stored",
                f"{state.usage_stream_length} waiting: is the metering worker running?",
                reconciliation,
            )
        )
    if state.usage_dead_letters:
        out.append(
            Attention(
                "MeteringDeadLetters",
                f"{counted(state.usage_dead_letters, 'usage event')} could not be stored",
                "kept with the reason in the dead-letter stream",
                reconciliation,
            )
        )
    if state.reconciliation is not None and not state.reconciliation.ok:
        out.append(
            Attention(
                "ReconciliationMismatch",
                "The latest hourly reconciliation disagrees",
                "events, records and rollups differ",
                reconciliation,
            )
        )
    for b in state.budgets:
        if b.used_ratio > THRESHOLDS["BudgetNearlySpent"]:
            out.append(
                Attention(
                    "BudgetNearlySpent",
                    f"{b.organization} has used {b.used_ratio:.0%} of its monthly {b.budget} budget",
                    "",
                    reverse("console:customer", args=[b.organization_id]),
                )
            )
    if state.batch_backlog_age_seconds > THRESHOLDS["BatchBacklogOld"]:
        hours = state.batch_backlog_age_seconds / 3600
        out.append(
            Attention(
                "BatchBacklogOld",
                f"A batch has waited {hours:.1f} h with lines not started",
                f"{state.batch_lines_waiting} lines waiting",
                reverse("console:batches"),
            )
        )
    for c in state.cache:
        if c.estimate > c.budget:
            out.append(
                Attention(
                    "SemanticCacheWrongHitsOverBudget",
                    f"{c.model}: the cache's estimated wrong-hit "
                    f"rate {c.estimate:.1%} is over its {c.budget:.1%} budget",
                    "",
                    reverse("console:cache"),
                )
            )
    return out


# --- Views -----------------------------------------------------------------------------------


def engine_targets_view(request: HttpRequest) -> HttpResponse:
    """Prometheus HTTP service discovery (``http_sd_configs``) of the engines to scrape: every
    replica ready or starting, standbys included, with its model, version, replica and host as
    labels (vLLM's /metrics needs no key; the engines' own queue and cache figures come from there)."""
    if not metrics_allowed(request):
        return metrics_refused()
    replicas = (
        Replica.objects.filter(
            state__in=[Replica.State.READY, Replica.State.STARTING], deployment__in=serving_deployments()
        )
        .exclude(endpoint="")
        .select_related("deployment__version__model")
        .order_by("pk")
    )
    groups = []
    for replica in replicas:
        address = urlsplit(replica.endpoint).netloc
        if not address:
            continue
        version = replica.deployment.version
        labels = {"model": version.model.name, "version": version.version, "replica": str(replica.pk),
                  "host": replica.host, "standby": str(replica.standby).lower()}  # fmt: skip
        groups.append({"targets": [address], "labels": labels})
    return JsonResponse(groups, safe=False)


def platform_metrics_view(request: HttpRequest) -> HttpResponse:
    if not metrics_allowed(request):
        return metrics_refused()
    registry = CollectorRegistry()
    registry.register(PlatformCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
