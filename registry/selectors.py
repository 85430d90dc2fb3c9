"""Reads from the registry."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, F, Prefetch, QuerySet
from django.db.models.functions import Now
from django.utils import timezone

from registry.adapters import GENERATIVE_TASKS, base_refusal, lora_name
from registry.models import (
    Adapter,
    AuditEntry,
    Deployment,
    HostLease,
    LoadedAdapter,
    Model,
    ModelVersion,
    Replica,
    Upstream,
)
from registry.upstreams import SealBroken, UpstreamTarget, unseal

logger = logging.getLogger(__name__)


def model_list_with_versions() -> QuerySet[Model]:
    return Model.objects.prefetch_related(
        Prefetch("versions", queryset=ModelVersion.objects.order_by("-created_at"))
    ).order_by("name")


def model_names() -> list[str]:
    """Every registered model's name, in order (a filter's choices)."""
    return list(Model.objects.order_by("name").values_list("name", flat=True))


def serving_deployments() -> QuerySet[Deployment]:
    """Deployments that should be serving (pending ones are starting up), with their version and model."""
    return (
        Deployment.objects.filter(status__in=[Deployment.Status.PENDING, Deployment.Status.RUNNING])
        .select_related("version__model")
        .order_by("id")
    )


def upstream_targets(*, version_ids: list[int]) -> dict[int, UpstreamTarget]:
    """The upstream of each external version among ``version_ids``, by version id, keys unsealed.
    A version whose key this SECRET_KEY cannot open is left out (and logged): never called
    with a wrong key."""
    targets = {}
    for upstream in Upstream.objects.filter(version_id__in=version_ids):
        try:
            api_key = unseal(upstream.api_key_sealed)
        except SealBroken as exc:
            logger.error("upstream of version %s: %s", upstream.version_id, exc)
            continue
        targets[upstream.version_id] = UpstreamTarget(upstream.url, upstream.served_model, api_key)
    return targets


def upstream_of(*, version: ModelVersion) -> Upstream | None:
    """An external version's upstream row (its key still sealed); None for any other version."""
    return Upstream.objects.filter(version=version).first()


def adapter_of(*, version: ModelVersion) -> Adapter | None:
    """An adapter version's row, with its base; None for any other version."""
    return Adapter.objects.select_related("base__model").filter(version=version).first()


def adapters_on(*, version: ModelVersion) -> list[Adapter]:
    """The adapters registered on ``version`` as their base, by model name and version."""
    return list(
        Adapter.objects.select_related("version__model")
        .filter(base=version)
        .order_by("version__model__name", "version__version")
    )


def adapter_bases() -> list[ModelVersion]:
    """The versions an adapter may name as its base (``registry.adapters.clean_base`` accepts
    them), by model name, newest version first."""
    candidates = (
        ModelVersion.objects.select_related("model")
        .filter(model__task__in=GENERATIVE_TASKS)
        .order_by("model__name", "-created_at", "-id")
    )
    return [version for version in candidates if base_refusal(version) is None]


def heartbeat_fresh_after(now: datetime | None = None) -> datetime:
    """The oldest heartbeat a replica may show and still count as alive (routed, promoted, counted
    ready): REPLICA_STALE_AFTER before ``now``. (The gateway's routing table applies the same
    rule on its own clock: serving.gateway.routing.)"""
    return (now or timezone.now()) - timedelta(seconds=settings.REPLICA_STALE_AFTER)


def ready_replicas(*, deployment_ids: list[int]) -> QuerySet[Replica]:
    """The replicas requests may be routed to: ready, and not a warm standby (never routed)."""
    return Replica.objects.filter(deployment_id__in=deployment_ids, state=Replica.State.READY, standby=False).order_by(
        "id"
    )


def adapter_replicas(*, version_ids: list[int]) -> dict[int, list[tuple[Replica, str]]]:
    """Where each of these adapter versions can be routed: the ready, routed replicas (of a
    serving deployment of its base) whose engine holds it, each with the adapter's name there."""
    serving = [Deployment.Status.PENDING, Deployment.Status.RUNNING]
    held: dict[int, list[tuple[Replica, str]]] = {}
    for loaded in (
        LoadedAdapter.objects.filter(
            version_id__in=version_ids,
            replica__state=Replica.State.READY,
            replica__standby=False,
            replica__deployment__status__in=serving,
            replica__pid=F("pid"),  # loaded into the engine running now, not one that restarted since
        )
        .select_related("replica", "version__model")
        .order_by("replica_id")
    ):
        held.setdefault(loaded.version_id, []).append((loaded.replica, lora_name(loaded.version)))
    return held


def bases_of_adapters(*, version_ids: list[int]) -> dict[int, ModelVersion]:
    """The base version of each of these adapter versions, by the adapter's version id."""
    return {
        a.version_id: a.base for a in Adapter.objects.filter(version_id__in=version_ids).select_related("base__model")
    }


@dataclass(frozen=True)
class AdapterWanted:
    """An adapter version some serving deployment wants, on the base version it needs."""

    version_id: int
    base_id: int
    lora_name: str
    artifact_uri: str


def adapters_wanted(*, base_ids: list[int]) -> list[AdapterWanted]:
    """The adapters of these base versions that a serving (pending or running) deployment wants."""
    serving = [Deployment.Status.PENDING, Deployment.Status.RUNNING]
    rows = (
        Adapter.objects.filter(base_id__in=base_ids, version__deployments__status__in=serving)
        .select_related("version__model")
        .distinct()
        .order_by("version_id")
    )
    return [AdapterWanted(a.version_id, a.base_id, lora_name(a.version), a.version.artifact_uri) for a in rows]


@dataclass(frozen=True)
class AdapterHeld:
    pid: int  # the engine process it was loaded into
    lora_name: str


def adapters_loaded(*, replica_ids: list[int]) -> dict[int, dict[int, AdapterHeld]]:
    """The adapter versions each of these replicas' engines was given (the rows its supervisor
    wrote), by version id: into which engine process, under which name."""
    loaded: dict[int, dict[int, AdapterHeld]] = {replica_id: {} for replica_id in replica_ids}
    for row in LoadedAdapter.objects.filter(replica_id__in=replica_ids).select_related("version__model"):
        loaded[row.replica_id][row.version_id] = AdapterHeld(row.pid, lora_name(row.version))
    return loaded


def replica_states(*, replica_ids: list[int]) -> dict[int, str]:
    """The current state of each of these replicas; a deleted one is absent."""
    return dict(Replica.objects.filter(pk__in=replica_ids).values_list("id", "state"))


def replicas_restart_requested(*, replica_ids: list[int]) -> list[int]:
    """Those of these replicas whose restart was asked for (``registry.services.replica_restart_request``)."""
    return list(
        Replica.objects.filter(pk__in=replica_ids, restart_requested_at__isnull=False).values_list("id", flat=True)
    )


def replica_get(*, replica_id: int) -> Replica | None:
    return Replica.objects.filter(pk=replica_id).first()


def deployment_with_version(*, deployment_id: int) -> Deployment | None:
    return Deployment.objects.select_related("version__model").filter(pk=deployment_id).first()


def live_replica_pids(*, host: str) -> list[int]:
    """Engine pids recorded on ``host`` by replicas that are not stopped."""
    pids = Replica.objects.filter(host=host, pid__isnull=False).exclude(state=Replica.State.STOPPED)
    return [pid for pid in pids.values_list("pid", flat=True) if pid is not None]


def host_lease_held(*, host: str) -> HostLease | None:
    """``host``'s lease while it runs (by the database's clock); None when free or expired."""
    return HostLease.objects.filter(host=host, expires_at__gt=Now()).first()


def models_with_deployments(*, name: str | None = None) -> QuerySet[Model]:
    """Models (or the one named) with their versions, newest first, and each version's deployments."""
    versions = (
        ModelVersion.objects.select_related("upstream", "adapter__base__model")
        .order_by("-created_at", "-id")
        .prefetch_related(Prefetch("deployments", queryset=Deployment.objects.order_by("id")))
    )
    models = Model.objects.prefetch_related(Prefetch("versions", queryset=versions)).order_by("name")
    return models.filter(name=name) if name is not None else models


def deployments_with_replicas(*, model: str | None = None) -> QuerySet[Deployment]:
    """Deployments, newest first, with their version, model and replicas (of one model if named)."""
    deployments = (
        Deployment.objects.select_related("version__model")
        .prefetch_related(Prefetch("replica_set", queryset=Replica.objects.order_by("id")))
        .order_by("-created_at", "-id")
    )
    return deployments.filter(version__model__name=model) if model is not None else deployments


def model_traffic_split(*, model: Model) -> dict[str, int]:
    """Each serving version of ``model`` and its traffic percentage (its deployments' weights added)."""
    split: dict[str, int] = {}
    for version, weight in (
        serving_deployments().filter(version__model=model).values_list("version__version", "traffic_weight")
    ):
        split[version] = split.get(version, 0) + weight
    return split


# --- The console's deployment pages -------------------------------------------

# Audit actions that changed a deployment's replica count: the autoscaler's decisions and a person's.
SCALE_ACTIONS = ("autoscale", "deployment.scale")


def model_named(*, name: str) -> Model | None:
    return Model.objects.filter(name=name).first()


def model_version_named(*, model: Model, version: str) -> ModelVersion | None:
    return ModelVersion.objects.select_related("model").filter(model=model, version=version).first()


def version_counts(*, model_ids: list[int]) -> dict[int, int]:
    """How many versions each of the models has, by model id (one with none is left out)."""
    rows = ModelVersion.objects.filter(model_id__in=model_ids).values("model_id").annotate(n=Count("id"))
    return {row["model_id"]: row["n"] for row in rows}


def deployment_board(*, model_ids: list[int], include_stopped: bool = False) -> QuerySet[Deployment]:
    """The deployments of these models, oldest first, with their version and replicas; stopped
    ones only when asked."""
    deployments = _with_replicas(Deployment.objects.filter(version__model_id__in=model_ids))
    return deployments if include_stopped else deployments.exclude(status=Deployment.Status.STOPPED)


def _with_replicas(deployments: QuerySet[Deployment]) -> QuerySet[Deployment]:
    return (
        deployments.select_related("version__model")
        .prefetch_related(Prefetch("replica_set", queryset=Replica.objects.order_by("id")))
        .order_by("id")
    )


def replica_load_seconds(*, replica_ids: list[int]) -> dict[int, float]:
    """Each replica's latest load time (its ``replica.ready`` audit entry), in seconds."""
    found: dict[int, float] = {}
    entries = AuditEntry.objects.filter(action="replica.ready", target_type="replica", target__in=[
        str(pk) for pk in replica_ids
    ]).order_by("id").values_list("target", "after")  # fmt: skip
    for target, after in entries:
        seconds = (after or {}).get("load_seconds")
        if isinstance(seconds, int | float):
            found[int(target)] = float(seconds)
    return found


def scale_decisions(*, model: Model | None = None, deployment_ids: list[int] | None = None) -> QuerySet[AuditEntry]:
    """Replica-count changes (the autoscaler's, with reasons and figures, and people's), newest
    first; of one model's deployments, or of the ones given."""
    entries = AuditEntry.objects.filter(action__in=SCALE_ACTIONS, target_type="deployment").order_by(
        "-created_at", "-id"
    )
    if model is not None:
        ids = Deployment.objects.filter(version__model=model).values_list("pk", flat=True)
        entries = entries.filter(target__in=[str(pk) for pk in ids])
    if deployment_ids is not None:
        entries = entries.filter(target__in=[str(pk) for pk in deployment_ids])
    return entries


def deployments_live(*, deployment_ids: list[int]) -> QuerySet[Deployment]:
    """The deployments given, with their version, model and replicas (the live table's figures)."""
    return _with_replicas(Deployment.objects.filter(pk__in=deployment_ids))


def last_changes(*, deployments: list[Deployment]) -> dict[int, AuditEntry]:
    """Each deployment's latest audited change (by deployment id): an entry about the
    deployment itself or its model's traffic split, whichever is newer. Two queries."""
    own = AuditEntry.objects.filter(target_type="deployment", target__in=[str(d.pk) for d in deployments])
    latest: dict[int, AuditEntry] = {}
    for entry in own.order_by("target", "-created_at", "-id").distinct("target"):
        latest[int(entry.target)] = entry
    names = {d.version.model.name for d in deployments}
    splits = AuditEntry.objects.filter(action="traffic.set", target_type="model", target__in=names)
    split_of = {e.target: e for e in splits.order_by("target", "-created_at", "-id").distinct("target")}
    for deployment in deployments:
        split = split_of.get(deployment.version.model.name)
        mine = latest.get(deployment.pk)
        if (
            split is not None
            and split.created_at >= deployment.created_at
            and (mine is None or split.created_at > mine.created_at)
        ):
            latest[deployment.pk] = split
    return latest


def models_for_board(*, q: str = "") -> QuerySet[Model]:
    """Models (whose name contains ``q``) with their versions, newest first."""
    models = model_list_with_versions()
    return models.filter(name__icontains=q) if q else models


# --- The console's registry pages and audit log ------------------------------------------


def model_versions_listed(*, q: str = "", status: str = "", framework: str = "") -> QuerySet[ModelVersion]:
    """Every version, by model name then newest first, with its model and deployments; only
    those whose model name contains ``q``, in ``status``, of ``framework`` when given."""
    versions = (
        ModelVersion.objects.select_related("model")
        .prefetch_related(Prefetch("deployments", queryset=Deployment.objects.order_by("id")))
        .order_by("model__name", "-created_at", "-id")
    )
    if q:
        versions = versions.filter(model__name__icontains=q)
    if status:
        versions = versions.filter(status=status)
    if framework:
        versions = versions.filter(framework=framework)
    return versions


def model_version_frameworks() -> list[str]:
    return list(ModelVersion.objects.order_by("framework").values_list("framework", flat=True).distinct())


def model_version_with_replicas(*, name: str, version: str) -> ModelVersion | None:
    """One version with its model, and its deployments (newest first) with their replicas."""
    deployments = Deployment.objects.order_by("-created_at", "-id").prefetch_related(
        Prefetch("replica_set", queryset=Replica.objects.order_by("id"))
    )
    return (
        ModelVersion.objects.select_related("model")
        .prefetch_related(Prefetch("deployments", queryset=deployments))
        .filter(model__name=name, version=version)
        .first()
    )
