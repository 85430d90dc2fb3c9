"""The platform's own state for Prometheus: ``GET /metrics/platform``.

``/metrics`` (``serving.gateway.metrics``) is what each gateway process counts as requests pass
(latency, TTFT, statuses, fallbacks, the cache); it says nothing of what only the database and
Redis know. This endpoint reads that at scrape time, a few small queries, the same from any
gateway (scrape one, through the balancer): replicas ready against wanted per deployment,
failed replicas, the metering stream's backlog and its oldest event's age, the latest hourly
reconciliation, each organisation's monthly budget used, the batch queue's backlog and the
semantic cache's estimated wrong-hit rate per model. The
alert rules (deploy/prometheus/alerts.yml) and the dashboard (deploy/grafana/) read both.

Guarded like /metrics (METRICS_ALLOWED_NETWORKS or METRICS_TOKEN).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from urllib.parse import urlsplit

from django.conf import settings
from django.db.models import Count, Min, Q, Sum
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from accounts.models import Organization
from billing import invoicing
from billing.models import Reconciliation, UsageRollup
from core.keys import usage_dead_letters, usage_stream
from core.redis import sync_redis
from registry.models import Replica
from registry.selectors import serving_deployments
from serving.batches.models import Batch, BatchLine
from serving.gateway.metrics import metrics_allowed
from serving.semcache.selectors import cache_quality

DEPLOYMENT_LABELS = ["model", "version", "deployment"]


class PlatformCollector(Collector):
    """Gauges read from PostgreSQL and Redis when scraped (names ``platform_*``)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._deployments()
        yield from self._metering()
        yield from self._reconciliation()
        yield from self._budgets()
        yield from self._batches()
        yield from self._cache()

    def _deployments(self) -> Iterator[GaugeMetricFamily]:
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
        fresh_after = timezone.now() - timedelta(seconds=settings.REPLICA_STALE_AFTER)
        deployments = serving_deployments().annotate(
            ready_now=Count(
                "replica_set",
                filter=Q(
                    replica_set__state=Replica.State.READY,
                    replica_set__standby=False,
                    replica_set__last_heartbeat__gte=fresh_after,
                ),
            ),
            failed_now=Count("replica_set", filter=Q(replica_set__state=Replica.State.FAILED)),
        )
        for deployment in deployments:
            labels = [deployment.version.model.name, deployment.version.version, str(deployment.pk)]
            wanted.add_metric(labels, deployment.replicas)
            ready.add_metric(labels, deployment.ready_now)
            failed.add_metric(labels, deployment.failed_now)
        yield from (wanted, ready, failed)

    def _metering(self) -> Iterator[GaugeMetricFamily]:
        client = sync_redis()
        stream = usage_stream()
        pipe = client.pipeline(transaction=False)
        pipe.xlen(stream)
        pipe.xrange(stream, "-", "+", count=1)
        pipe.xlen(usage_dead_letters())
        length, first, dead = pipe.execute()
        age = 0.0
        if first:
            event_id = first[0][0]
            millis = int((event_id.decode() if isinstance(event_id, bytes) else str(event_id)).split("-")[0])
            age = max(0.0, time.time() - millis / 1000)
        yield GaugeMetricFamily(
            "platform_usage_stream_length", "Usage events waiting to be stored (the metering worker's backlog).",
            value=length,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "platform_usage_stream_oldest_age_seconds",
            "Age of the oldest usage event not yet stored (0 when none waits): the metering lag.",
            value=age,
        )
        yield GaugeMetricFamily(
            "platform_usage_dead_letters", "Usage events the metering worker could not store (with why).", value=dead
        )

    def _reconciliation(self) -> Iterator[GaugeMetricFamily]:
        latest = Reconciliation.objects.order_by("-period_end", "-pk").first()
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
            delta.add_metric(["events_records"], latest.stream_events - latest.records)
            delta.add_metric(["records_rollups"], latest.records - latest.rollup_requests)
            delta.add_metric(["cost"], float(latest.records_cost - latest.rollup_cost))
            age.add_metric([], (timezone.now() - latest.period_end).total_seconds())
        yield from (ok, delta, age)

    def _budgets(self) -> Iterator[GaugeMetricFamily]:
        used = GaugeMetricFamily(
            "platform_organization_budget_used_ratio",
            "This UTC month's use over the organisation's monthly cap (spend) or quota (tokens), from the daily "
            "rollups (the limiter counts requests in flight too, so it may be a little ahead).",
            labels=["organization", "budget"],
        )
        capped = Organization.objects.filter(
            Q(monthly_spend_cap__isnull=False) | Q(monthly_token_quota__isnull=False)
        ).only("pk", "slug", "monthly_spend_cap", "monthly_token_quota")
        limits = {org.pk: org for org in capped}
        if limits:
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
            for pk, org in limits.items():
                row = month.get(pk, {})
                if org.monthly_spend_cap:
                    spent = Decimal(row.get("cost") or 0)
                    used.add_metric([org.slug, "spend"], float(spent / org.monthly_spend_cap))
                if org.monthly_token_quota:
                    used.add_metric([org.slug, "tokens"], (row.get("tokens") or 0) / org.monthly_token_quota)
        yield used

    def _batches(self) -> Iterator[GaugeMetricFamily]:
        waiting = BatchLine.objects.filter(status=BatchLine.Status.PENDING, batch__status=Batch.Status.IN_PROGRESS)
        oldest = Batch.objects.filter(
            Q(status=Batch.Status.VALIDATING)
            | Q(status=Batch.Status.IN_PROGRESS, lines__status=BatchLine.Status.PENDING)
        ).aggregate(at=Min("created_at"))["at"]
        yield GaugeMetricFamily(
            "platform_batch_lines_waiting", "Batch lines not started in batches in progress.", value=waiting.count()
        )
        yield GaugeMetricFamily(
            "platform_batch_backlog_age_seconds",
            "Age of the oldest batch with lines still waiting (0 when none waits).",
            value=(timezone.now() - oldest).total_seconds() if oldest else 0.0,
        )

    def _cache(self) -> Iterator[GaugeMetricFamily]:
        rate = GaugeMetricFamily(
            "platform_cache_wrong_hit_rate",
            "The semantic cache's estimated wrong-hit rate per model (audits and reports over a prior): the "
            "estimate and the upper end of its 95 % interval.",
            labels=["model", "bound"],
        )
        budget = GaugeMetricFamily(
            "platform_cache_wrong_hit_budget", "The wrong-hit rate each model's cache accepts.", labels=["model"]
        )
        models = {d.version.model.name for d in serving_deployments() if d.version.model.task == "chat"}
        for quality in cache_quality(models=models):
            rate.add_metric([quality.model, "estimate"], quality.estimate.rate)
            rate.add_metric([quality.model, "upper"], quality.estimate.high)
            budget.add_metric([quality.model], quality.budget)
        yield from (rate, budget)


def engine_targets_view(request: HttpRequest) -> HttpResponse:
    """Prometheus HTTP service discovery (``http_sd_configs``) of the engines to scrape: every
    replica ready or starting, standbys included, with its model, version, replica and host as
    labels (vLLM's /metrics needs no key; the engines' own queue and cache figures come from there)."""
    if not metrics_allowed(request):
        return HttpResponse("Forbidden\n", status=403, content_type="text/plain")
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
        return HttpResponse(
            "Metrics are served to the monitoring network (METRICS_ALLOWED_NETWORKS) or with a bearer token "
            "(METRICS_TOKEN).\n",
            status=403,
            content_type="text/plain",
        )
    registry = CollectorRegistry()
    registry.register(PlatformCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
