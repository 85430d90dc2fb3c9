"""Reads of the semantic cache: policies by model, quality against the error budget, entry counts."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from django.conf import settings
from django.db.models import Count

from serving.gateway.models import CachePolicy
from serving.semcache.budget import ModelQuality, quality_of
from serving.semcache.models import CacheEntry, CacheFeedback


def cache_policies_by_model() -> dict[int, CachePolicy]:
    """Every model's semantic-cache policy, by model id (a model without one gets the defaults)."""
    return {policy.model_id: policy for policy in CachePolicy.objects.all()}


def cache_quality(*, models: Collection[str], organization_id: int | None = None) -> list[ModelQuality]:
    """Each model's semantic hits, wrong-hit estimate (95 % interval) and budget, and the
    wrong answers reported (by ``organization_id`` only, when given)."""
    policies = CachePolicy.objects.filter(model__name__in=models, wrong_hit_budget__isnull=False)
    pairs = policies.values_list("model__name", "wrong_hit_budget")
    budgets = {name: float(percent or 0) / 100 for name, percent in pairs}
    reports = CacheFeedback.objects.filter(model__in=models)
    if organization_id is not None:
        reports = reports.filter(organization_id=organization_id)
    counted = dict(reports.values_list("model").annotate(n=Count("id")).values_list("model", "n"))
    out = []
    for model in sorted(models):
        found = quality_of(model, wrong_hit_budget=budgets.get(model, settings.SEMANTIC_CACHE_WRONG_HIT_BUDGET))
        out.append(dataclasses.replace(found, feedback=int(counted.get(model, 0))))
    return out


def cache_entries_count(
    *, model: str | None = None, version: str | None = None, organization_id: int | None = None
) -> int:
    """How many cache entries match every filter given (what ``serving.semcache.services.cache_purge``
    with the same filters would delete, entries stored meanwhile aside)."""
    entries = CacheEntry.objects.all()
    if model is not None:
        entries = entries.filter(model=model)
    if version is not None:
        entries = entries.filter(model_version=version)
    if organization_id is not None:
        entries = entries.filter(organization_id=organization_id)
    return entries.count()
