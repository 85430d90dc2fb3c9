"""Reads of the audit log: entries by target (a model with everything under it, a version, a
deployment with its replicas), actor and action, and where each entry's target lives now."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import CharField, Q, QuerySet
from django.db.models.functions import Cast

from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica

# The kinds of target an entry names that the console can show; the key is the target's id
# (deployment, replica) or name (model, canary: its model's name; model_version: name:version).
TARGET_TYPES = ("model", "model_version", "deployment", "replica", "canary")


@dataclass(frozen=True)
class AuditTarget:
    """What to filter the log by, written ``type:key`` (``deployment:12``, ``model:llama``,
    ``model_version:llama:2``)."""

    type: str
    key: str

    @classmethod
    def parse(cls, text: str) -> AuditTarget | None:
        """The target ``text`` names, or None when it has no known type (an exact target then)."""
        kind, colon, key = text.strip().partition(":")
        if not colon or kind not in TARGET_TYPES or not key:
            return None
        if kind in ("deployment", "replica") and not key.isdigit():
            return None
        return cls(kind, key)

    def __str__(self) -> str:
        return f"{self.type}:{self.key}"


def _keys(rows: QuerySet[Any]) -> QuerySet[Any]:
    """The rows' ids as the text an entry's ``target`` holds, for a subquery."""
    keys: QuerySet[Any] = rows.annotate(key=Cast("pk", CharField())).values("key")
    return keys


def _under(target: AuditTarget) -> Q:
    """The entries about ``target`` and everything under it: a model's versions, deployments,
    replicas and canaries; a version's deployments and their replicas; a deployment's replicas
    (and the hot-swap that created it, whose entry names the deployment it replaced)."""
    if target.type == "model":
        deployments = Deployment.objects.filter(version__model__name=target.key)
        return (
            Q(target_type__in=("model", "canary"), target=target.key)
            | Q(target_type="model_version", target__startswith=f"{target.key}:")
            | Q(target_type="deployment", target__in=_keys(deployments))
            | Q(target_type="replica", target__in=_keys(Replica.objects.filter(deployment__in=deployments)))
        )
    if target.type == "model_version":
        name, _, version = target.key.partition(":")
        deployments = Deployment.objects.filter(version__model__name=name, version__version=version)
        ids = list(deployments.values_list("pk", flat=True))
        return (
            Q(target_type="model_version", target=target.key)
            | Q(target_type="deployment", target__in=[str(pk) for pk in ids])
            | Q(target_type="deployment", action="deployment.swap", after__swap_to__in=ids)
            | Q(target_type="replica", target__in=_keys(Replica.objects.filter(deployment_id__in=ids)))
        )
    if target.type == "deployment":
        replicas = Replica.objects.filter(deployment_id=int(target.key))
        return (
            Q(target_type="deployment", target=target.key)
            | Q(target_type="deployment", action="deployment.swap", after__swap_to=int(target.key))
            | Q(target_type="replica", target__in=_keys(replicas))
        )
    return Q(target_type=target.type, target=target.key)


def audit_entries(
    *,
    action: str | None = None,
    actor: str | None = None,
    target: str | None = None,
    entry_id: int | None = None,
    q: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> QuerySet[AuditEntry]:
    """Audit entries, newest first. ``actor`` is a username (or a part of the platform, e.g.
    "autoscaler"); ``target`` a typed target with everything under it (``deployment:12``, see
    ``AuditTarget``), else an exact target of any type; ``q`` searches target, action and
    actor; ``since`` (inclusive) and ``until`` (exclusive) bound when they were written."""
    entries = AuditEntry.objects.order_by("-created_at", "-id")
    if entry_id is not None:
        entries = entries.filter(pk=entry_id)
    if since is not None:
        entries = entries.filter(created_at__gte=since)
    if until is not None:
        entries = entries.filter(created_at__lt=until)
    if action:
        entries = entries.filter(action=action)
    if actor:
        entries = entries.filter(actor_name=actor)
    target = (target or "").strip()
    if target:
        within = AuditTarget.parse(target)
        entries = entries.filter(_under(within) if within is not None else Q(target=target))
    if q:
        entries = entries.filter(Q(target__icontains=q) | Q(action__icontains=q) | Q(actor_name__icontains=q))
    return entries


def audit_actions() -> list[str]:
    """Every action the audit log holds, for a search form's choices."""
    return list(AuditEntry.objects.order_by("action").values_list("action", flat=True).distinct())


def audit_actors() -> list[str]:
    """Everyone (and every part of the platform) the log names, for a search form's choices."""
    names = AuditEntry.objects.exclude(actor_name="").order_by("actor_name").values_list("actor_name", flat=True)
    return list(names.distinct())


@dataclass(frozen=True)
class TargetPlace:
    """Where an entry's target lives now: its model (and version); a deployment that no longer
    serves is ``stopped``."""

    model: str
    version: str | None = None
    stopped: bool = False


def audit_target_places(*, entries: Iterable[AuditEntry]) -> dict[tuple[str, str], TargetPlace]:
    """Each (target type, target) of ``entries`` that still exists, with the model and version
    it belongs to; a deleted target (or one of another type) is absent. At most four queries."""
    wanted: dict[str, set[str]] = {kind: set() for kind in TARGET_TYPES}
    for entry in entries:
        if entry.target_type in wanted:
            wanted[entry.target_type].add(entry.target)
    places: dict[tuple[str, str], TargetPlace] = {}
    names = wanted["model"] | wanted["canary"]
    if names:
        for name in Model.objects.filter(name__in=names).values_list("name", flat=True):
            for kind in ("model", "canary"):
                places[(kind, name)] = TargetPlace(model=name)
    pairs = [key.partition(":") for key in wanted["model_version"]]
    if pairs:
        found = ModelVersion.objects.filter(
            model__name__in={name for name, _, _ in pairs}, version__in={version for _, _, version in pairs}
        ).values_list("model__name", "version")
        for name, version in found:
            places[("model_version", f"{name}:{version}")] = TargetPlace(model=name, version=version)
    deployment_ids = [int(key) for key in wanted["deployment"] if key.isdigit()]
    if deployment_ids:
        deployments = Deployment.objects.filter(pk__in=deployment_ids).values_list(
            "pk", "version__model__name", "version__version", "status"
        )
        for pk, name, version, status in deployments:
            places[("deployment", str(pk))] = TargetPlace(name, version, status == Deployment.Status.STOPPED)
    replica_ids = [int(key) for key in wanted["replica"] if key.isdigit()]
    if replica_ids:
        replicas = Replica.objects.filter(pk__in=replica_ids).values_list(
            "pk", "deployment__version__model__name", "deployment__version__version"
        )
        for pk, name, version in replicas:
            places[("replica", str(pk))] = TargetPlace(model=name, version=version)
    return {key: place for key, place in places.items() if key[1] in wanted[key[0]]}
