"""Reads for accounts, always scoped to what the asking user may see."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal

from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from billing import invoicing, outcomes
from billing.models import BudgetAlert, FailedAttempt, Invoice, Price, Reconciliation, UsageRecord, UsageRollup

# A price that ended this recently is still loaded: a request admitted just before a switch
# is priced at its admission time, and the routing table it reads may have been reloaded
# after the switch (a request never comes out unpriced because its price just ended).
RECENTLY_ENDED = timedelta(hours=1)
# Request ids asked for per query when adding up many requests' usage (a batch has up to
# FILES_MAX_LINES): each query stays a few hundred kilobytes of SQL.
REQUEST_IDS_PER_QUERY = 5000


def prices_in_effect_or_later(*, model_ids: list[int]) -> QuerySet[Price]:
    """Prices of these models that apply now or will, and those that ended within the last
    hour (the routing table keeps them all and picks by each request's admission time)."""
    since = timezone.now() - RECENTLY_ENDED
    return Price.objects.filter(model_id__in=model_ids).exclude(effective_to__lte=since).order_by("-effective_from")


def month_so_far(*, today: date) -> tuple[Decimal, int]:
    """Every organisation's usage cost in the UTC month of ``today`` so far (from the daily
    rollups, rebuilt every minute: exact, not yet invoiced), and the budget alerts crossed."""
    first = invoicing.month_start(today)
    cost = UsageRollup.objects.filter(period=UsageRollup.Period.DAY, start__date__gte=first).aggregate(
        total=Sum("cost")
    )["total"]
    alerts = BudgetAlert.objects.filter(month=invoicing.period_label(first)).count()
    return Decimal(cost or 0), alerts


def budget_alerts_of(*, organization_id: int, month: str) -> QuerySet[BudgetAlert]:
    """The budget alerts an organisation (or one of its keys) crossed in ``month`` (YYYY-MM, UTC)."""
    return (
        BudgetAlert.objects.filter(organization_id=organization_id, month=month)
        .select_related("api_key")
        .order_by("-created_at")
    )


# --- The console's customer pages (platform admins: every organisation) ---------------


def invoices_listed(
    *, status: str = "", period: date | None = None, organization_id: int | None = None, organization_q: str = ""
) -> QuerySet[Invoice]:
    """Every organisation's invoices, newest month first, filtered by state, month and
    organisation (its id, or its name containing ``organization_q``)."""
    found = Invoice.objects.select_related("organization")
    if status:
        found = found.filter(status=status)
    if period is not None:
        found = found.filter(period=period)
    if organization_id is not None:
        found = found.filter(organization_id=organization_id)
    if organization_q:
        found = found.filter(organization__name__icontains=organization_q)
    return found.order_by("-period", "-number")


def invoice_get(*, invoice_id: int) -> Invoice | None:
    return Invoice.objects.select_related("organization", "reissue_of").filter(pk=invoice_id).first()


def prices_listed(*, model: str = "", include_ended: bool = False) -> QuerySet[Price]:
    """Prices by model, newest first: those in effect or scheduled, or every one."""
    prices = Price.objects.select_related("model", "version").order_by("model__name", "version_id", "-effective_from")
    if not include_ended:
        prices = prices.exclude(effective_to__lte=timezone.now())
    if model:
        prices = prices.filter(model__name__icontains=model)
    return prices


def price_get(*, price_id: int) -> Price | None:
    return Price.objects.select_related("model", "version").filter(pk=price_id).first()


def reconciliations_latest(*, ok: bool | None = None) -> QuerySet[Reconciliation]:
    """Reconciliations, newest first; only agreeing (``ok``) or only mismatching ones."""
    found = Reconciliation.objects.order_by("-created_at")
    return found if ok is None else found.filter(ok=ok)


def usage_record_for(*, request_id: uuid.UUID, organization_id: int | None = None) -> UsageRecord | None:
    """The usage record of one request (its x-request-id), in ``organization_id`` only when
    given (a customer never finds another organisation's)."""
    found = UsageRecord.objects.select_related("api_key", "organization", "price", "invoice").filter(
        request_id=request_id
    )
    if organization_id is not None:
        found = found.filter(organization_id=organization_id)
    return found.first()


# How a request ended, as the request log filters it (billing.outcomes: a cancel is no error).
OUTCOMES = {
    "answered": "Answered",
    "error": "Errors (any)",
    "client-error": "Refused (4xx)",
    "server-error": "Failed (5xx)",
    "cancelled": "Cancelled by the client",
}


def _outcome_filter(outcome: str) -> Q:
    cancelled = Q(status_code=outcomes.CLIENT_CLOSED)
    answered = Q(status_code__gte=200, status_code__lt=300)
    return {
        "answered": answered,
        "error": ~answered & ~cancelled,
        "client-error": Q(status_code__gte=400, status_code__lt=500) & ~cancelled,
        "server-error": Q(status_code__gte=500),
        "cancelled": cancelled,
    }[outcome]


def usage_records_listed(
    *,
    organization_id: int | None = None,
    api_key_id: int | None = None,
    model: str = "",
    model_version: str = "",
    outcome: str = "",
    cache: str = "",
    slower_than_ms: int | None = None,
    before: UsageRecord | None = None,
    limit: int = 50,
) -> list[UsageRecord]:
    """The request log: the newest requests first (``limit`` of them) that match every filter
    given, older than ``before`` when given (a cursor: pages never count the whole table).
    ``organization_id`` scopes it to one organisation (a customer never sees another's);
    ``outcome`` is one of ``OUTCOMES``. Usage records hold no prompt or answer."""
    found = UsageRecord.objects.select_related("api_key", "organization")
    if organization_id is not None:
        found = found.filter(organization_id=organization_id)
    if api_key_id is not None:
        found = found.filter(api_key_id=api_key_id)
    if model:
        found = found.filter(model=model)
    if model_version:
        found = found.filter(model_version=model_version)
    if outcome:
        found = found.filter(_outcome_filter(outcome))
    if cache:
        found = found.filter(cache=cache)
    if slower_than_ms is not None:
        found = found.filter(latency_ms__gt=slower_than_ms)
    if before is not None:
        found = found.filter(Q(created_at__lt=before.created_at) | Q(created_at=before.created_at, pk__lt=before.pk))
    return list(found.order_by("-created_at", "-pk")[:limit])


def usage_record_cursor(*, record_id: int, organization_id: int | None = None) -> UsageRecord | None:
    """The record a request log's page starts after (its ``before``), in ``organization_id``
    only when given."""
    found = UsageRecord.objects.filter(pk=record_id)
    if organization_id is not None:
        found = found.filter(organization_id=organization_id)
    return found.only("pk", "created_at").first()


def failed_attempt_for(*, request_id: uuid.UUID) -> FailedAttempt | None:
    """The attempt of one request that failed on a version before another answered it (the
    fallback), if there was one."""
    return FailedAttempt.objects.filter(request_id=request_id).first()


@dataclass(frozen=True)
class RequestsUsage:
    """Some requests' usage records added up: tokens (integers) and their exact cost."""

    requests: int = 0  # the records found: a request whose record is not written yet counts nothing
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of ``prompt_tokens``: served from a cache
    completion_tokens: int = 0
    cost: Decimal = Decimal(0)

    @property
    def input_tokens(self) -> int:
        """Prompt tokens not served from a cache (priced as input)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def usage_of_requests(*, organization_id: int, request_ids: Collection[uuid.UUID]) -> RequestsUsage:
    """The usage records of these requests of the organisation, added up (a batch's lines: see
    ``serving.batches.selectors.batch_usage``). Requests of another organisation count nothing."""
    ids = list(request_ids)
    requests = prompt = cached = completion = 0
    cost = Decimal(0)
    for start in range(0, len(ids), REQUEST_IDS_PER_QUERY):
        sums = UsageRecord.objects.filter(
            organization_id=organization_id, request_id__in=ids[start : start + REQUEST_IDS_PER_QUERY]
        ).aggregate(
            n=Count("pk"),
            prompt=Sum("prompt_tokens"),
            cached=Sum("cached_tokens"),
            completion=Sum("completion_tokens"),
            cost=Sum("cost"),
        )
        requests += sums["n"]
        prompt += sums["prompt"] or 0
        cached += sums["cached"] or 0
        completion += sums["completion"] or 0
        cost += sums["cost"] or Decimal(0)
    return RequestsUsage(
        requests=requests, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion, cost=cost
    )
