"""Writes to the registry: versions registered, status moves guarded by transition tables."""

from __future__ import annotations

from typing import Any, TypeVar

from django.db import models, transaction
from django.utils import timezone

from registry.models import Deployment, Model, ModelVersion, Replica, Task


class IllegalTransition(Exception):
    """A status change that the object's transition table does not allow."""

    def __init__(self, obj: models.Model, field: str, current: str, target: str) -> None:
        self.current = current
        self.target = target
        super().__init__(f"{type(obj).__name__} {obj.pk}: {field} cannot go from {current!r} to {target!r}")


_M = TypeVar("_M", ModelVersion, Deployment, Replica)


def _transition(obj: _M, *, field: str, target: str, extra: dict[str, Any] | None = None) -> _M:
    """Move ``obj.<field>`` to ``target`` if its table allows it, atomically.

    The row is locked while we read its current value, so two concurrent callers cannot both
    make a move that is only legal from the same starting state.
    """
    model_cls = type(obj)
    with transaction.atomic():
        locked = model_cls.objects.select_for_update().get(pk=obj.pk)
        current = getattr(locked, field)
        if target not in model_cls.TRANSITIONS.get(current, frozenset()):
            raise IllegalTransition(obj, field, current, target)
        updates = {field: target, **(extra or {})}
        model_cls.objects.filter(pk=obj.pk).update(**updates)
    for name, value in updates.items():
        setattr(obj, name, value)
    return obj


def model_version_transition(*, version: ModelVersion, status: str) -> ModelVersion:
    return _transition(version, field="status", target=status)


def deployment_transition(*, deployment: Deployment, status: str) -> Deployment:
    return _transition(deployment, field="status", target=status)


def replica_transition(*, replica: Replica, state: str, **fields: Any) -> Replica:
    """Move a replica's state; ``fields`` (endpoint, pid, ...) are written in the same update."""
    return _transition(replica, field="state", target=state, extra=fields)


def model_get_or_create(*, name: str, task: Task | str, description: str = "", owner: str = "") -> Model:
    model, _ = Model.objects.get_or_create(
        name=name, defaults={"task": task, "description": description, "owner": owner}
    )
    return model


def model_version_register(
    *,
    model: Model,
    version: str,
    framework: str,
    artifact_uri: str,
    artifact_sha256: str,
    artifact_size: int,
    config: dict[str, Any],
    gpu_type: str = "",
    gpu_count: int = 0,
) -> ModelVersion:
    """Register a version, or refresh the artifact fields of an existing registered one."""
    obj, created = ModelVersion.objects.get_or_create(
        model=model,
        version=version,
        defaults={
            "framework": framework,
            "artifact_uri": artifact_uri,
            "artifact_sha256": artifact_sha256,
            "artifact_size": artifact_size,
            "config": config,
            "gpu_type": gpu_type,
            "gpu_count": gpu_count,
        },
    )
    if not created:
        obj.framework = framework
        obj.artifact_uri = artifact_uri
        obj.artifact_sha256 = artifact_sha256
        obj.artifact_size = artifact_size
        obj.config = config
        obj.save(update_fields=["framework", "artifact_uri", "artifact_sha256", "artifact_size", "config"])
    return obj


def replica_heartbeat(*, replica: Replica) -> None:
    Replica.objects.filter(pk=replica.pk).update(last_heartbeat=timezone.now())


def replica_heartbeats(*, replica_ids: list[int]) -> int:
    """Heart-beat every ready replica of ``replica_ids`` in one statement (a supervisor's whole host).

    Only ``ready`` rows are touched: a replica drained or failed meanwhile never looks alive again.
    """
    if not replica_ids:
        return 0
    return Replica.objects.filter(pk__in=replica_ids, state=Replica.State.READY).update(last_heartbeat=timezone.now())


def replica_record_pid(*, replica_id: int, pid: int) -> bool:
    """Record the engine process now serving a replica; False when the row is gone."""
    return Replica.objects.filter(pk=replica_id).update(pid=pid) == 1


# Replicas that still hold a place in their deployment: live, or failed and awaiting restart.
_HOLDING_STATES = (Replica.State.STARTING, Replica.State.READY, Replica.State.FAILED)


def deployment_create(
    *,
    version: ModelVersion,
    replicas: int = 1,
    min_replicas: int = 1,
    max_replicas: int = 1,
    traffic_weight: int = 100,
    is_canary: bool = False,
) -> Deployment:
    if not 0 <= traffic_weight <= 100:
        raise ValueError("traffic_weight must be between 0 and 100")
    if not min_replicas <= replicas <= max_replicas:
        raise ValueError("replicas must lie between min_replicas and max_replicas")
    return Deployment.objects.create(
        version=version,
        replicas=replicas,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        traffic_weight=traffic_weight,
        is_canary=is_canary,
    )


def desired_replicas(deployment: Deployment) -> int:
    serving = deployment.status in (Deployment.Status.PENDING, Deployment.Status.RUNNING)
    return deployment.replicas if serving else 0


def replica_claim(*, deployment: Deployment, host: str) -> Replica | None:
    """Create a replica of ``deployment`` on ``host`` if the deployment wants one more.

    The deployment row is locked, so supervisors on several hosts never over-fill it.
    """
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        holding = Replica.objects.filter(deployment=locked, state__in=_HOLDING_STATES).count()
        if holding >= desired_replicas(locked):
            return None
        replica = Replica.objects.create(deployment=locked, host=host, state=Replica.State.STARTING)
        version = locked.version
        if version.status in (ModelVersion.Status.REGISTERED, ModelVersion.Status.DEPRECATED):
            model_version_transition(version=version, status=ModelVersion.Status.LOADING)
    return replica


def replica_surplus(*, deployment: Deployment) -> int:
    """How many replicas more than wanted the deployment holds (0 when not over)."""
    deployment.refresh_from_db(fields=["status", "replicas"])
    holding = Replica.objects.filter(deployment=deployment, state__in=_HOLDING_STATES).count()
    return max(0, holding - desired_replicas(deployment))


def replica_mark_ready(*, replica: Replica, endpoint: str, pid: int) -> Replica:
    """The engine answers /health: route to it, and mark its version and deployment live."""
    with transaction.atomic():
        replica_transition(
            replica=replica, state=Replica.State.READY, endpoint=endpoint, pid=pid, last_heartbeat=timezone.now()
        )
        deployment = Deployment.objects.select_related("version").get(pk=replica.deployment_id)
        if deployment.version.status == ModelVersion.Status.LOADING:
            model_version_transition(version=deployment.version, status=ModelVersion.Status.ACTIVE)
        if deployment.status == Deployment.Status.PENDING:
            deployment_transition(deployment=deployment, status=Deployment.Status.RUNNING)
    return replica


def replica_release_host(*, host: str, keep: list[int] | None = None) -> int:
    """Stop every replica recorded on ``host`` but those in ``keep`` (the ones its supervisor runs)."""
    released = 0
    for replica in Replica.objects.filter(host=host).exclude(state=Replica.State.STOPPED).exclude(pk__in=keep or []):
        if replica.state in (Replica.State.STARTING, Replica.State.READY):
            replica_transition(replica=replica, state=Replica.State.FAILED)
        replica_transition(replica=replica, state=Replica.State.STOPPED)
        released += 1
    return released
