"""Reads of the semantic cache: policies by model, quality against the error budget, entry counts."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from django.conf import settings
from django.db import connection
from django.db.models import Count

from serving.gateway.models import CachePolicy
from serving.semcache.budget import ModelQuality, quality_of
from serving.semcache.models import CacheEntry, CacheFeedback


def cache_policies_by_model() -> dict[int, CachePolicy]:
    """Every model's semantic-cache policy, by model id (a model without one gets the defaults)."""
    return {policy.model_id: policy for policy in CachePolicy.objects.all()}


def cache_quality(*, models: Collection[str], organization_id: int | None = None) -> list[ModelQuality]:
    """Each model's semantic hits, wrong-hit estimate (95 % interval) and budget, whether its
    rules let the paraphrase tier serve, and the wrong answers reported (by ``organization_id``
    only, when given)."""
    policies = CachePolicy.objects.filter(model__name__in=models)
    rules = policies.values_list("model__name", "wrong_hit_budget", "paraphrases")
    budgets = {name: float(percent) / 100 for name, percent, _ in rules if percent is not None}
    paraphrases = {name: allowed for name, _, allowed in rules if allowed is not None}
    reports = CacheFeedback.objects.filter(model__in=models)
    if organization_id is not None:
        reports = reports.filter(organization_id=organization_id)
    counted = dict(reports.values_list("model").annotate(n=Count("id")).values_list("model", "n"))
    out = []
    for model in sorted(models):
        found = quality_of(model, wrong_hit_budget=budgets.get(model, settings.SEMANTIC_CACHE_WRONG_HIT_BUDGET))
        allowed = paraphrases.get(model, settings.SEMANTIC_CACHE_PARAPHRASES)
        out.append(dataclasses.replace(found, feedback=int(counted.get(model, 0)), paraphrases=allowed))
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


# Entries looked at per model when counting those a mismatch tightened: the count reads each
# entry's evidence (no index can answer it), so a model with more entries is counted on its
# first ENTRIES_SCANNED_CAP live ones only, and says so.
ENTRIES_SCANNED_CAP = 100_000


@dataclasses.dataclass(frozen=True)
class RaisedEntries:
    """A model's live entries whose own paraphrase threshold a mismatch raised (``serving.semcache.bound``:
    a disagreement in their evidence), among the ``scanned`` looked at."""

    raised: int
    scanned: int
    capped: bool  # ``cap`` entries were read, the model may have more: ``raised`` is a lower bound


def entries_raised_by_mismatch(*, models: Collection[str], cap: int = ENTRIES_SCANNED_CAP) -> dict[str, RaisedEntries]:
    """Per model, its live entries with a disagreement in their evidence, in one query that reads
    at most ``cap`` entries of each model (by the index on model and version). The path is strict:
    lax mode would unwrap each ``[score, agreed]`` pair and find nothing; silent: a malformed
    observation is no match, not an error."""
    if not models:
        return {}
    sql = f"""
        SELECT m.model, s.scanned, s.raised
        FROM unnest(%s::text[]) AS m(model)
        CROSS JOIN LATERAL (
            SELECT count(*) AS scanned,
                   count(*) FILTER (WHERE jsonb_path_exists(e.evidence, 'strict $[*] ? (@[1] == 0)', '{{}}', true))
                       AS raised
            FROM (SELECT evidence FROM {CacheEntry._meta.db_table}
                  WHERE model = m.model AND expires_at > now() LIMIT %s) AS e
        ) AS s
    """  # the table's own name in the text; the values as parameters
    with connection.cursor() as cursor:
        cursor.execute(sql, [sorted(models), cap])
        found = cursor.fetchall()
    return {
        model: RaisedEntries(raised=int(raised), scanned=int(scanned), capped=int(scanned) >= cap)
        for model, scanned, raised in found
    }
