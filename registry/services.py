"""Writes to the registry: versions registered, deployments, traffic splits, status moves
guarded by transition tables, and the audit entry of each management write."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeAlias

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import IntegrityError, connection, models, transaction
from django.db.models.functions import Now
from django.utils import timezone

from core.errors import InvalidInput
from core.events import publish_routing_change
from core.transitions import transition
from registry.adapters import (
    ADAPTER_FRAMEWORK,
    AdapterFacts,
    base_label,
    clean_base,
    is_adapter_framework,
    read_adapter,
)
from registry.artifacts import get_artifact_store
from registry.models import (
    SMALL_COUNT_MAX,
    Adapter,
    AuditEntry,
    Deployment,
    HostLease,
    LoadedAdapter,
    Model,
    ModelVersion,
    Replica,
    Task,
    Upstream,
)
from registry.selectors import adapters_wanted
from registry.signatures import is_predict_framework, predict_config
from registry.upstreams import (
    UPSTREAM_FRAMEWORK,
    SealBroken,
    clean_api_key,
    clean_served_model,
    clean_url,
    is_upstream_framework,
    seal,
    unseal,
)


@dataclass(frozen=True)
class SystemActor:
    """A part of the platform acting on its own (the audit log names it): never a user."""

    name: str
    pk: None = None
    is_authenticated: bool = False

    def get_username(self) -> str:
        return self.name


CANARY_CONTROLLER = SystemActor("canary controller")
AUTOSCALER = SystemActor("autoscaler")
HOT_SWAP = SystemActor("hot-swap")
SUPERVISOR = SystemActor("engine supervisor")
# The names the audit log gives the parts of the platform, which the console marks as such.
SYSTEM_ACTOR_NAMES = frozenset(actor.name for actor in (CANARY_CONTROLLER, AUTOSCALER, HOT_SWAP, SUPERVISOR))

# Who acts: a platform admin through the API or the console, a part of the platform
# (``SystemActor``), or None for the operator (commands, bootstrap).
Actor: TypeAlias = AbstractBaseUser | AnonymousUser | SystemActor | None


def model_version_transition(*, version: ModelVersion, status: str) -> ModelVersion:
    return transition(version, status)


def deployment_transition(*, deployment: Deployment, status: str) -> Deployment:
    return transition(deployment, status)


def replica_transition(*, replica: Replica, state: str, **fields: Any) -> Replica:
    """Move a replica's state; ``fields`` (endpoint, pid, ...) are written in the same update.

    A move to starting or stopped settles any restart request: the engine it asked to restart
    is gone either way.
    """
    if state in (Replica.State.STARTING, Replica.State.STOPPED):
        fields.setdefault("restart_requested_at", None)
    return transition(replica, state, field="state", **fields)


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
    if is_predict_framework(framework):
        config = predict_config(framework, get_artifact_store().local_path(artifact_uri), config)
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


class VersionConflict(Exception):
    """The version is registered already with other values; a registered version never changes
    under the deployments that serve it, so a change is a new version."""

    def __init__(self, version: ModelVersion, fields: list[str]) -> None:
        self.version = version
        self.fields = fields
        super().__init__(
            f"{version.model.name}:{version.version} is registered already with another {', '.join(fields)}; "
            "register a new version instead."
        )


def _artifact_digest(uri: str) -> tuple[str, int]:
    """SHA-256 and size of the artifact at ``uri``, read through the artifact store."""
    store = get_artifact_store()
    try:
        found = store.digest(uri) if store.exists(uri) else None
    except OSError as exc:
        raise InvalidInput("artifact_uri", f"The artifact at {uri} cannot be read ({exc.strerror or exc}).") from exc
    except ValueError as exc:  # not this store's scheme, a key escaping the store, or no files
        raise InvalidInput("artifact_uri", f"{uri} is not a usable artifact: {exc}.") from exc
    if found is None:
        raise InvalidInput("artifact_uri", f"There is no artifact at {uri}.")
    return found


def model_version_create(
    *,
    actor: Actor,
    name: str,
    version: str,
    framework: str,
    artifact_uri: str,
    config: dict[str, Any],
    task: str | None = None,
    gpu_type: str = "",
    gpu_count: int = 0,
    gpu_vram_gb: int = 0,
) -> tuple[ModelVersion, bool]:
    """Register ``name``:``version`` from an artifact already in the store; True when created.

    The artifact is hashed first, outside any transaction (a large one takes a while). A new
    model gets ``task`` (default chat). Registering a version again with the same values
    returns the existing one unchanged (False, nothing audited), so a retried request is
    harmless; with other values it raises ``VersionConflict``.
    """
    if task is not None and task not in Task.values:
        raise InvalidInput("task", f"Must be one of {', '.join(Task.values)}.")
    _refuse_upstream_framework(framework)
    sha256, size = _artifact_digest(artifact_uri)
    if is_predict_framework(framework):
        # Loaded once here: a version whose signature does not load is never registered.
        config = predict_config(framework, get_artifact_store().local_path(artifact_uri), config)
    values: dict[str, Any] = {
        "framework": framework,
        "artifact_uri": artifact_uri,
        "artifact_sha256": sha256,
        "artifact_size": size,
        "config": config,
        "gpu_type": gpu_type,
        "gpu_count": gpu_count,
        "gpu_vram_gb": gpu_vram_gb,
    }
    try:
        with transaction.atomic():
            model = _model_for_version(actor=actor, name=name, task=task)
            existing = ModelVersion.objects.filter(model=model, version=version).first()
            if existing is None:
                created = ModelVersion.objects.create(model=model, version=version, **values)
                audit_record(
                    actor=actor,
                    action="model_version.register",
                    target_type="model_version",
                    target=str(created),
                    before=None,
                    after=_version_snapshot(created),
                )
                return created, True
    except IntegrityError:
        # A concurrent registration of the same version committed first: compare with it.
        existing = ModelVersion.objects.select_related("model").get(model__name=name, version=version)
    differing = [field for field, value in values.items() if getattr(existing, field) != value]
    if differing:
        raise VersionConflict(existing, differing)
    return existing, False


def _refuse_upstream_framework(framework: str) -> None:
    """An artifact's version is never of the external kind: that one has an upstream instead
    (``upstream_version_create``), and without it no replica could ever serve. Nor is it an
    adapter, which is registered with its base (``adapter_version_create``)."""
    if is_upstream_framework(framework):
        raise InvalidInput(
            "framework", f"An {UPSTREAM_FRAMEWORK} version has no artifact: register it with its upstream (URL, model)."
        )
    if is_adapter_framework(framework):
        raise InvalidInput(
            "framework", f"A {ADAPTER_FRAMEWORK} version is an adapter: register it with its base version (base)."
        )


def _model_for_version(*, actor: Actor, name: str, task: str | None) -> Model:
    """The model a version is registered under: created (and audited) if new, with ``task``
    (default chat); an existing one of another ``task`` is refused."""
    model, created = Model.objects.get_or_create(name=name, defaults={"task": task or Task.CHAT})
    if created:
        audit_record(actor=actor, action="model.create", target_type="model", target=model.name,
                     before=None, after={"name": model.name, "task": model.task})  # fmt: skip
    elif task is not None and task != model.task:
        raise InvalidInput("task", f"{name} is a {model.task} model.")
    return model


def model_version_create_from_upload(
    *,
    actor: Actor,
    name: str,
    version: str,
    framework: str,
    source: Path,
    config: dict[str, Any],
    task: str | None = None,
) -> ModelVersion:
    """Store the files under ``source`` (an uploaded artifact, unpacked) as ``local://<name>/<version>``
    or the store's equivalent, then register the version from it exactly as
    ``model_version_create`` registers one by URI (hashed, audited).

    Refuses a version that is registered already, and a store key some version points at:
    storing replaces what is there, and a registered artifact never changes under a deployment.
    """
    if ModelVersion.objects.filter(model__name=name, version=version).exists():
        raise InvalidInput("version", f"{name}:{version} is registered already; upload it as a new version.")
    _refuse_upstream_framework(framework)
    if task is not None and task not in Task.values:
        raise InvalidInput("task", f"Must be one of {', '.join(Task.values)}.")
    existing_model = Model.objects.filter(name=name).first()
    if existing_model is not None and task is not None and task != existing_model.task:
        raise InvalidInput("task", f"{name} is a {existing_model.task} model.")
    store = get_artifact_store()
    key = f"{name}/{version}"
    if ModelVersion.objects.filter(artifact_uri=store.uri_for(key)).exists():
        raise InvalidInput("version", f"{store.uri_for(key)} belongs to another version already.")
    try:
        stored = store.put_directory(source=source, key=key)
    except ValueError as exc:  # an empty folder, or a key the store refuses
        raise InvalidInput("artifact_files", f"The artifact cannot be stored: {exc}.") from exc
    created, _ = model_version_create(
        actor=actor, name=name, version=version, framework=framework, artifact_uri=stored.uri, config=config, task=task
    )
    return created


def upstream_version_create(
    *,
    actor: Actor,
    name: str,
    version: str,
    url: str,
    served_model: str,
    api_key: str = "",
    config: dict[str, Any],
    task: str | None = None,
) -> tuple[ModelVersion, bool]:
    """Register ``name``:``version`` as served by an external OpenAI-compatible server
    (``registry.upstreams``): no artifact, but the server's base URL, the name it serves the
    model under and its API key (stored sealed). True when created.

    A new model gets ``task`` (default chat); a classification model is never external (small
    models run in the platform's own workers). Registering again with the same URL, name and
    key returns the existing version (False); with others it raises ``VersionConflict``:
    an upstream that moves is a new version, as a changed artifact is (a rotated key is not:
    ``upstream_key_set``).
    """
    url, served_model, api_key = clean_url(url), clean_served_model(served_model), clean_api_key(api_key)
    if task is not None and task not in Task.values:
        raise InvalidInput("task", f"Must be one of {', '.join(Task.values)}.")
    if task == Task.CLASSIFICATION:
        raise InvalidInput("task", "A classification model runs in the platform's own workers, never upstream.")
    try:
        with transaction.atomic():
            model = _model_for_version(actor=actor, name=name, task=task)
            if model.task == Task.CLASSIFICATION:
                raise InvalidInput("name", f"{name} is a classification model: it runs in the platform's own workers.")
            existing = ModelVersion.objects.filter(model=model, version=version).select_related("model").first()
            if existing is None:
                created = ModelVersion.objects.create(
                    model=model, version=version, framework=UPSTREAM_FRAMEWORK, artifact_uri="", artifact_sha256="",
                    artifact_size=0, config=config,
                )  # fmt: skip
                Upstream.objects.create(
                    version=created, url=url, served_model=served_model, api_key_sealed=seal(api_key)
                )
                audit_record(
                    actor=actor, action="model_version.register", target_type="model_version", target=str(created),
                    before=None,
                    after={**_version_snapshot(created), "upstream": _upstream_snapshot(url, served_model, api_key)},
                )  # fmt: skip
                return created, True
    except IntegrityError:  # a concurrent registration of the same version committed first
        existing = ModelVersion.objects.select_related("model").get(model__name=name, version=version)
    upstream = Upstream.objects.filter(version=existing).first()
    if upstream is None:
        raise VersionConflict(existing, ["framework"])
    differing = [f for f, a, b in (("upstream.url", upstream.url, url),
                                   ("upstream.model", upstream.served_model, served_model),
                                   ("config", existing.config, config)) if a != b]  # fmt: skip
    if not _seals(upstream.api_key_sealed, api_key):
        differing.append("upstream.api_key")
    if differing:
        raise VersionConflict(existing, differing)
    return existing, False


def _adapter_config(config: dict[str, Any], facts: AdapterFacts, base: ModelVersion) -> dict[str, Any]:
    """An adapter version's config: what was given, and what the registry read of the adapter."""
    return {
        **config,
        "lora_rank": facts.rank,
        "lora_alpha": facts.alpha,
        "target_modules": list(facts.target_modules),
        "base": base_label(base),
    }


def adapter_register(
    *,
    model: Model,
    version: str,
    artifact_uri: str,
    artifact_sha256: str,
    artifact_size: int,
    base: ModelVersion,
    config: dict[str, Any],
) -> ModelVersion:
    """Register a LoRA adapter version (``registry.adapters``) on ``base`` from an artifact the
    caller stored and hashed (the bundled import), or refresh the artifact fields of an existing
    one, as ``model_version_register`` does for a full model. The adapter is read and its base
    checked first; the version and its ``Adapter`` row are written in one transaction."""
    clean_base(base)
    facts = read_adapter(get_artifact_store().local_path(artifact_uri))
    values: dict[str, Any] = {
        "framework": ADAPTER_FRAMEWORK,
        "artifact_uri": artifact_uri,
        "artifact_sha256": artifact_sha256,
        "artifact_size": artifact_size,
        "config": _adapter_config(config, facts, base),
    }
    with transaction.atomic():
        obj, created = ModelVersion.objects.get_or_create(model=model, version=version, defaults=values)
        if not created:
            for field, value in values.items():
                setattr(obj, field, value)
            obj.save(update_fields=list(values))
        Adapter.objects.update_or_create(version=obj, defaults={"base": base, "rank": facts.rank})
    return obj


def adapter_version_create(
    *,
    actor: Actor,
    name: str,
    version: str,
    artifact_uri: str,
    base: ModelVersion,
    config: dict[str, Any],
    task: str | None = None,
) -> tuple[ModelVersion, bool]:
    """Register ``name``:``version`` as a LoRA adapter on ``base`` from an adapter folder already
    in the store; True when created. Audited like ``model_version_create``.

    ``base`` must carry adapters (``registry.adapters.clean_base``: a chat or completion model
    served from an artifact); the folder must be a PEFT LoRA adapter of a rank the engines
    accept (``read_adapter``). A new model gets ``task`` (default: the base's). Registering
    again with the same artifact, base and config returns the existing version (False); with
    others it raises ``VersionConflict``.
    """
    if task is not None and task not in Task.values:
        raise InvalidInput("task", f"Must be one of {', '.join(Task.values)}.")
    clean_base(base)
    sha256, size = _artifact_digest(artifact_uri)
    facts = read_adapter(get_artifact_store().local_path(artifact_uri))
    values: dict[str, Any] = {
        "framework": ADAPTER_FRAMEWORK,
        "artifact_uri": artifact_uri,
        "artifact_sha256": sha256,
        "artifact_size": size,
        "config": _adapter_config(config, facts, base),
    }
    try:
        with transaction.atomic():
            model = _model_for_version(actor=actor, name=name, task=task or base.model.task)
            if model.task != base.model.task:
                raise InvalidInput("task", f"{name} is a {model.task} model; its base {base} is {base.model.task}.")
            existing = ModelVersion.objects.filter(model=model, version=version).select_related("model").first()
            if existing is None:
                created = ModelVersion.objects.create(model=model, version=version, **values)
                Adapter.objects.create(version=created, base=base, rank=facts.rank)
                audit_record(
                    actor=actor, action="model_version.register", target_type="model_version", target=str(created),
                    before=None, after={**_version_snapshot(created), "base": base_label(base)},
                )  # fmt: skip
                return created, True
    except IntegrityError:  # a concurrent registration of the same version committed first
        existing = ModelVersion.objects.select_related("model").get(model__name=name, version=version)
    differing = [field for field, value in values.items() if getattr(existing, field) != value]
    adapter = Adapter.objects.filter(version=existing).first()
    if adapter is None or adapter.base_id != base.pk:
        differing.append("base")
    if differing:
        raise VersionConflict(existing, differing)
    return existing, False


def upstream_key_set(*, actor: Actor, version: ModelVersion, api_key: str) -> Upstream:
    """Replace an external version's API key (a rotation: the same upstream, so the same version).
    Gateways and supervisors use the new key from their next routing snapshot, announced now."""
    api_key = clean_api_key(api_key)
    with transaction.atomic():
        upstream = Upstream.objects.select_for_update().filter(version=version).first()
        if upstream is None:
            raise InvalidInput("version", f"{version} is not served by an external upstream.")
        upstream.api_key_sealed = seal(api_key)
        upstream.save(update_fields=["api_key_sealed"])
        audit_record(actor=actor, action="upstream.key_set", target_type="model_version", target=str(version),
                     before=None, after={"api_key": "set" if api_key else "none"})  # fmt: skip
        publish_routing_change("upstream")
    return upstream


def _seals(sealed: str, api_key: str) -> bool:
    """Whether ``sealed`` holds ``api_key`` (a seal this SECRET_KEY cannot open holds none)."""
    try:
        return unseal(sealed) == api_key
    except SealBroken:
        return False


def _upstream_snapshot(url: str, served_model: str, api_key: str) -> dict[str, str]:
    """What the audit log keeps of an upstream: never the key, only whether there is one."""
    return {"url": url, "model": served_model, "api_key": "set" if api_key else "none"}


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


# Replicas that still hold a place in their deployment: live, or failed and awaiting restart,
# or draining for a restart someone asked for (the same replica starts again: no other is
# claimed in its place meanwhile).
_HOLDING_STATES = (Replica.State.STARTING, Replica.State.READY, Replica.State.FAILED)
HOLDING = models.Q(state__in=_HOLDING_STATES) | models.Q(
    state=Replica.State.DRAINING, restart_requested_at__isnull=False
)

# The most warm standby replicas a deployment may keep (the column is a small integer).
MAX_STANDBY = SMALL_COUNT_MAX


def standby_check(standby: object) -> None:
    """``standby`` is a count of standby replicas a deployment may keep, or an InvalidInput."""
    if isinstance(standby, bool) or not isinstance(standby, int) or not 0 <= standby <= MAX_STANDBY:
        raise InvalidInput("standby", f"Must be a whole number between 0 and {MAX_STANDBY}.")


MAX_ADAPTERS_PER_BATCH = 64


def adapters_check(version: ModelVersion, max_adapters: int) -> None:
    """``max_adapters`` for a deployment of ``version``: 0, or up to MAX_ADAPTERS_PER_BATCH for a
    generative model the platform's vLLM engines serve (the only engines that take adapters)."""
    if not 0 <= max_adapters <= MAX_ADAPTERS_PER_BATCH:
        raise InvalidInput("max_adapters", f"Must be between 0 and {MAX_ADAPTERS_PER_BATCH}.")
    if max_adapters and (
        version.model.task not in (Task.CHAT, Task.COMPLETION)
        or is_predict_framework(version.framework)
        or is_upstream_framework(version.framework)
    ):
        raise InvalidInput(
            "max_adapters", "Only a chat or completion model served by the platform's own vLLM engines takes adapters."
        )


def deployment_create(
    *,
    version: ModelVersion,
    replicas: int = 1,
    min_replicas: int = 1,
    max_replicas: int = 1,
    traffic_weight: int = 100,
    is_canary: bool = False,
    gpu_type: str = "",
    standby: int = 0,
    max_adapters: int = 0,
    actor: Actor = None,
) -> Deployment:
    """Deploy ``version``: audited, and the gateways reload their routing table once it commits.

    ``standby``: warm standby replicas kept beside ``replicas`` (``registry.warm_pool``). A
    deployment with no serving replica (``replicas`` 0, ``min_replicas`` 0) is a warm pool only,
    e.g. the new version readied before a hot-swap: it needs ``standby`` ≥ 1.

    ``max_adapters``: LoRA adapters each engine runs in one batch (0: its engines take none).
    A LoRA adapter's own deployment has no replicas: it is served by the ready replicas of its
    base's deployments that take adapters (``serving.supervisor.adapters`` loads it there), so
    its replica counts are 0 whatever was asked.
    """
    if not 0 <= traffic_weight <= 100:
        raise InvalidInput("traffic_weight", "Must be between 0 and 100.")
    standby_check(standby)
    if is_adapter_framework(version.framework):
        if standby or max_adapters:
            field = "standby" if standby else "max_adapters"
            raise InvalidInput(field, "A LoRA adapter runs on its base's replicas; set this on the base's deployment.")
        replicas = min_replicas = max_replicas = 0
    else:
        if replicas < 1 and not (replicas == 0 and standby >= 1):
            raise InvalidInput("replicas", "Must be at least 1 (or 0 with at least one standby replica).")
        if not min_replicas <= replicas <= max_replicas:
            raise InvalidInput(
                "replicas", f"Must lie between min_replicas ({min_replicas}) and max_replicas ({max_replicas})."
            )
        adapters_check(version, max_adapters)
    with transaction.atomic():
        deployment = Deployment.objects.create(
            version=version,
            replicas=replicas,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            traffic_weight=traffic_weight,
            is_canary=is_canary,
            gpu_type=gpu_type,
            standby=standby,
            max_adapters=max_adapters,
        )
        audit_record(
            actor=actor,
            action="deployment.create",
            target_type="deployment",
            target=str(deployment.pk),
            before=None,
            after=deployment_snapshot(deployment),
        )
        publish_routing_change("deployments")
    return deployment


def desired_replicas(deployment: Deployment) -> int:
    serving = deployment.status in (Deployment.Status.PENDING, Deployment.Status.RUNNING)
    return deployment.replicas if serving else 0


def replica_claim(
    *, deployment: Deployment, host: str, on_promoted: Callable[[list[int]], None] | None = None
) -> Replica | None:
    """Create a replica of ``deployment`` on ``host`` if the deployment wants one more: a
    serving one while it holds fewer than ``replicas``, else a standby while its warm pool
    holds fewer than ``standby``. A ready standby is promoted first instead of a serving one
    claimed cold (``registry.warm_pool.claim_role``); ``on_promoted`` is given their ids after
    the commit (the supervisor announces the routing change off its loop).

    The deployment row is locked, so supervisors on several hosts never over-fill it.
    """
    from registry.warm_pool import claim_role  # it builds on this module

    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        standby, promoted = claim_role(deployment=locked)
        if promoted and on_promoted is not None:
            transaction.on_commit(lambda: on_promoted(promoted))
        if standby is None:
            return None
        replica = Replica.objects.create(deployment=locked, host=host, state=Replica.State.STARTING, standby=standby)
        version = locked.version
        if version.status in (ModelVersion.Status.REGISTERED, ModelVersion.Status.DEPRECATED):
            model_version_transition(version=version, status=ModelVersion.Status.LOADING)
    return replica


def adapter_loaded(*, replica_id: int, version_id: int, pid: int) -> bool:
    """Record that the replica's engine process ``pid`` holds the adapter ``version_id`` (its
    supervisor asked the engine, which said yes): the adapter's requests may go there. Its
    version becomes active and its pending deployments running, as a replica's first ready
    does for a model of its own. False when the replica is gone meanwhile (nothing written).
    The caller announces the routing change (a supervisor does so off its loop)."""
    with transaction.atomic():
        if not Replica.objects.filter(pk=replica_id).exists():
            return False
        LoadedAdapter.objects.update_or_create(replica_id=replica_id, version_id=version_id, defaults={"pid": pid})
        version = ModelVersion.objects.select_for_update().get(pk=version_id)
        if version.status in (ModelVersion.Status.REGISTERED, ModelVersion.Status.DEPRECATED):
            model_version_transition(version=version, status=ModelVersion.Status.LOADING)
        if version.status == ModelVersion.Status.LOADING:
            model_version_transition(version=version, status=ModelVersion.Status.ACTIVE)
        for deployment in Deployment.objects.select_for_update().filter(
            version_id=version_id, status=Deployment.Status.PENDING
        ):
            deployment_transition(deployment=deployment, status=Deployment.Status.RUNNING)
    return True


def adapter_unloaded(*, replica_id: int, version_id: int) -> bool:
    """The replica's engine no longer holds the adapter: its row goes. True when there was one."""
    deleted, _ = LoadedAdapter.objects.filter(replica_id=replica_id, version_id=version_id).delete()
    return deleted > 0


def replica_surplus(*, deployment: Deployment) -> int:
    """How many replicas more than wanted (serving and standby) the deployment holds (0 when not over)."""
    return max(0, _holding_beyond_wanted(deployment))


def _holding_beyond_wanted(deployment: Deployment) -> int:
    from registry.warm_pool import desired_standby  # it builds on this module

    deployment.refresh_from_db(fields=["status", "replicas", "standby"])
    holding = Replica.objects.filter(HOLDING, deployment=deployment).count()
    return holding - desired_replicas(deployment) - desired_standby(deployment)


def replica_shortfall(*, deployment: Deployment) -> int:
    """How many replicas (serving and standby) the deployment wants beyond those it holds: a
    read, not a claim (``replica_claim`` decides, with the row locked). A supervisor asks before
    fetching a version's weights for a replica it might claim."""
    return max(0, -_holding_beyond_wanted(deployment))


def replica_mark_ready(*, replica: Replica, endpoint: str, pid: int | None) -> Replica:
    """The engine answers /health: route to it, and mark its version and deployment live.
    ``pid`` is None for a replica with no process of ours (an external upstream)."""
    with transaction.atomic():
        # The deployment's row first (the order replica_claim and promotions take): two replicas
        # of a new version on two hosts becoming ready at once are marked one after the other,
        # the second reading the version and deployment the first made live (read before the
        # lock, it moved them again: an illegal move that left the replica starting for good).
        deployment = Deployment.objects.select_for_update().get(pk=replica.deployment_id)
        replica_transition(
            replica=replica, state=Replica.State.READY, endpoint=endpoint, pid=pid, last_heartbeat=timezone.now()
        )
        version = ModelVersion.objects.select_for_update().get(pk=deployment.version_id)
        if version.status == ModelVersion.Status.LOADING:
            model_version_transition(version=version, status=ModelVersion.Status.ACTIVE)
        if deployment.status == Deployment.Status.PENDING:
            deployment_transition(deployment=deployment, status=Deployment.Status.RUNNING)
    return replica


# Why a replica in each other state cannot be restarted on request.
_NOT_RESTARTABLE: dict[str, str] = {
    Replica.State.STARTING: "it is starting already",
    Replica.State.FAILED: "its supervisor restarts a failed replica by itself",
    Replica.State.DRAINING: "it is draining: it is leaving its deployment",
    Replica.State.STOPPED: "it is stopped",
}


def replica_restart_refusal(*, replica: Replica, deployment_status: str) -> str | None:
    """Why ``replica_restart_request`` would refuse ``replica`` now, or None when it would
    accept it: only a ready replica of a serving deployment, once at a time. The console
    offers its Restart button by this same rule."""
    if replica.restart_requested_at is not None:
        return f"A restart of replica {replica.pk} is requested already."
    if replica.state != Replica.State.READY:
        why = _NOT_RESTARTABLE.get(replica.state, f"it is {replica.state}")
        return f"Replica {replica.pk} cannot be restarted: {why}."
    if deployment_status not in SERVING_STATUSES:
        deployment = replica.deployment_id
        return f"Replica {replica.pk} cannot be restarted: its deployment {deployment} is {deployment_status}."
    return None


def replica_restart_request(*, actor: Actor, replica: Replica) -> Replica:
    """Ask the supervisor of ``replica``'s host to restart its engine. Audited (``replica.restart``).

    On its next pass the supervisor drains the replica (no new requests are routed to it; those
    in flight finish), stops the engine, then starts it again through its normal start path:
    draining → starting → ready, with a new process. The request is cleared when the replica
    moves to starting (or stopped). Only a ready replica of a serving deployment can be asked,
    once at a time; anything else is an ``InvalidInput`` on ``replica``.
    """
    with transaction.atomic():
        locked = (
            Replica.objects.select_for_update(of=("self",))
            .select_related("deployment__version__model")
            .get(pk=replica.pk)
        )
        deployment = locked.deployment
        refusal = replica_restart_refusal(replica=locked, deployment_status=deployment.status)
        if refusal is not None:
            raise InvalidInput("replica", refusal)
        requested_at = timezone.now()
        Replica.objects.filter(pk=locked.pk).update(restart_requested_at=requested_at)
        audit_record(
            actor=actor,
            action="replica.restart",
            target_type="replica",
            target=str(locked.pk),
            before={"state": locked.state, "pid": locked.pid, "restart_requested_at": None},
            after={
                "restart_requested_at": requested_at.isoformat(),
                "host": locked.host,
                "deployment": deployment.pk,
                "model": deployment.version.model.name,
                "version": deployment.version.version,
            },
        )
    locked.restart_requested_at = replica.restart_requested_at = requested_at
    return locked


# A replica of a deployment that is not serving steadily: starting, draining, failed (its
# supervisor restarts it), or asked to restart. A roll waits until the deployment has none.
_UNSETTLED_STATES = (Replica.State.STARTING, Replica.State.DRAINING, Replica.State.FAILED)
_UNSETTLED = models.Q(state__in=_UNSETTLED_STATES) | models.Q(restart_requested_at__isnull=False)


def replica_roll_request(*, deployment_id: int, running: Mapping[int, int]) -> int | None:
    """Ask for the restart of the next replica of ``deployment_id`` whose engine runs with a
    ``max_adapters`` other than the deployment's now (changed since it started:
    ``deployment_adapters_set``). ``running``: the ready replicas of the deployment on the
    caller's host, each with the value its engine was started with. Returns the replica asked
    (the lowest id), or None.

    One replica of a deployment at a time, on every host: nothing is asked while any replica of
    the deployment is starting, draining, failed or asked to restart, which the deployment's row
    lock makes true of two supervisors asking at once. An engine that fails with the new value
    holds the roll there. Audited ``replica.restart`` by the engine supervisor, with the
    change; the supervisor then carries it out as any requested restart (drained, stopped,
    started again with the deployment's value).
    """
    if Replica.objects.filter(_UNSETTLED, deployment_id=deployment_id).exists():
        return None  # read first without the lock: a roll held up is asked again every pass
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().filter(pk=deployment_id).first()
        if locked is None or locked.status not in SERVING_STATUSES:
            return None
        stale = sorted(replica_id for replica_id, value in running.items() if value != locked.max_adapters)
        if not stale or Replica.objects.filter(_UNSETTLED, deployment=locked).exists():
            return None
        replica = (
            Replica.objects.filter(pk__in=stale, deployment=locked, state=Replica.State.READY).order_by("pk").first()
        )
        if replica is None:
            return None
        requested_at = timezone.now()
        Replica.objects.filter(pk=replica.pk).update(restart_requested_at=requested_at)
        audit_record(
            actor=SUPERVISOR,
            action="replica.restart",
            target_type="replica",
            target=str(replica.pk),
            before={"state": replica.state, "pid": replica.pid, "max_adapters": running[replica.pk]},
            after={
                "restart_requested_at": requested_at.isoformat(),
                "host": replica.host,
                "deployment": locked.pk,
                "max_adapters": locked.max_adapters,
                "reason": "max_adapters changed",
            },
        )
    return replica.pk


def replica_release_host(*, host: str, keep: list[int] | None = None) -> int:
    """Stop every replica recorded on ``host`` but those in ``keep`` (the ones its supervisor runs)."""
    released = 0
    for replica in Replica.objects.filter(host=host).exclude(state=Replica.State.STOPPED).exclude(pk__in=keep or []):
        if replica.state in (Replica.State.STARTING, Replica.State.READY):
            replica_transition(replica=replica, state=Replica.State.FAILED)
        replica_transition(replica=replica, state=Replica.State.STOPPED)
        released += 1
    return released


def replica_release_lost_hosts(*, exclude: str, by: str) -> dict[str, int]:
    """Release the live replicas of every host, but ``exclude``, whose supervisor's lease has
    expired: a host that died, or was cut off from the database, for longer than the lease.
    Its replicas stop holding their places in their deployments, so supervisors of hosts with
    free slots claim replacements. ``{host: replicas released}``; audited ``host.lost`` (by
    ``by``, the supervisor that noticed), one entry per host.

    Each host is handled with its lease row locked and re-checked as expired (on the
    database's clock), so a supervisor renewing its lease at that moment either renews first
    (and nothing is released) or finds its rows stopped, stops its engines, and claims again
    only what its deployments still want: a host that rejoins never doubles a deployment.
    The lease row stays (a stopped row is all it leaves behind); its holder, back, renews it.
    """
    expired = HostLease.objects.filter(expires_at__lte=Now()).exclude(host=exclude).values_list("host", flat=True)
    live = Replica.objects.filter(host__in=list(expired)).exclude(state=Replica.State.STOPPED)
    hosts = set(live.values_list("host", flat=True))
    released: dict[str, int] = {}
    for host in sorted(hosts):
        with transaction.atomic():
            lease = (
                HostLease.objects.select_for_update(skip_locked=True).filter(host=host, expires_at__lte=Now()).first()
            )
            if lease is None:  # renewed meanwhile, or being handled by another supervisor
                continue
            replicas = list(
                Replica.objects.filter(host=host).exclude(state=Replica.State.STOPPED).values_list("pk", flat=True)
            )
            count = replica_release_host(host=host)
            if count:
                audit_record(
                    actor=SUPERVISOR, action="host.lost", target_type="host", target=host, before=None,
                    after={"replicas": replicas, "lease_expired_at": lease.expires_at.isoformat(),
                           "holder": lease.holder, "noticed_by": by},
                )  # fmt: skip
                released[host] = count
    return released


def host_lease_take(*, host: str, holder: str, seconds: float) -> bool:
    """Take ``host``'s lease for ``holder`` for ``seconds``; True when ``holder`` holds it now.

    Free (no row), expired, or already ``holder``'s: it is taken. Held by another: nothing
    changes. One statement, so of two supervisors taking it at once exactly one wins: the
    insert is decided by the unique host, the take-over of an expired lease by PostgreSQL
    re-checking the ``WHERE`` on the row it has locked. Expiry is judged by the database's
    clock (``statement_timestamp()``), never by a host's.
    """
    table = connection.ops.quote_name(HostLease._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {table} (host, holder, taken_at, expires_at)
            VALUES (%s, %s, statement_timestamp(), statement_timestamp() + make_interval(secs => %s))
            ON CONFLICT (host) DO UPDATE
                SET holder = EXCLUDED.holder, taken_at = EXCLUDED.taken_at, expires_at = EXCLUDED.expires_at
                WHERE {table}.expires_at <= EXCLUDED.taken_at OR {table}.holder = EXCLUDED.holder
            RETURNING holder
            """,
            [host, holder, float(seconds)],
        )
        return cursor.fetchone() is not None


def host_lease_renew(*, host: str, holder: str, seconds: float) -> bool:
    """Extend ``holder``'s lease of ``host`` to ``seconds`` from now; False when it is no longer
    ``holder``'s (another supervisor took it over once it had expired, or it was deleted).

    An expired lease nobody took over is still its holder's (a supervisor cut off from the
    database for a while keeps its host).
    """
    until = Now() + timedelta(seconds=seconds)
    return HostLease.objects.filter(host=host, holder=holder).update(expires_at=until) == 1


def host_lease_release(*, host: str, holder: str) -> bool:
    """Give ``host``'s lease up (a clean shutdown): the next supervisor starts at once. Only
    ``holder``'s own lease is released; False when it held none."""
    deleted, _ = HostLease.objects.filter(host=host, holder=holder).delete()
    return deleted > 0


# Deployments that take traffic: the router serves pending and running ones.
SERVING_STATUSES = (Deployment.Status.PENDING, Deployment.Status.RUNNING)


def traffic_set(*, actor: Actor, model: Model, weights: Mapping[str, object]) -> dict[str, int]:
    """Split ``model``'s traffic between its versions: ``{version: percent}``, summing to 100.

    Each version named needs a pending or running deployment, and shares its percentage
    between them (the oldest takes any remainder); every other deployment of the model gets
    0. The model's deployments stay locked until the change commits, then the gateways
    reload their routing table. Returns the split now in force, 0 for versions not named.
    """
    percents: dict[str, int] = {}
    for version, weight in weights.items():
        # A bool is an int to Python, and 50.0 is no whole percentage: both are refused.
        if isinstance(weight, bool) or not isinstance(weight, int):
            raise InvalidInput(version, "Must be an integer percentage.")
        if not 0 <= weight <= 100:
            raise InvalidInput(version, "Must be between 0 and 100.")
        percents[version] = weight
    total = sum(percents.values())
    if total != 100:
        raise InvalidInput("traffic", f"The percentages must sum to 100, not {total}.")
    with transaction.atomic():
        deployments = list(
            Deployment.objects.select_for_update(of=("self",))
            .filter(version__model=model)
            .select_related("version")
            .order_by("id")
        )
        serving: dict[str, list[Deployment]] = defaultdict(list)
        for deployment in deployments:
            if deployment.status in SERVING_STATUSES:
                serving[deployment.version.version].append(deployment)
        known = set(ModelVersion.objects.filter(model=model).values_list("version", flat=True))
        for version in percents:
            if version not in known:
                raise InvalidInput(version, f"{model.name} has no version {version!r}.")
            if version not in serving:
                raise InvalidInput(version, f"{model.name}:{version} has no pending or running deployment.")
        new_weights = {deployment.pk: 0 for deployment in deployments}
        for version, weight in percents.items():
            share, remainder = divmod(weight, len(serving[version]))
            for index, deployment in enumerate(serving[version]):
                new_weights[deployment.pk] = share + (1 if index < remainder else 0)
        for deployment in deployments:
            if deployment.traffic_weight != new_weights[deployment.pk]:
                Deployment.objects.filter(pk=deployment.pk).update(traffic_weight=new_weights[deployment.pk])
        before = {version: sum(d.traffic_weight for d in group) for version, group in serving.items()}
        after = {version: sum(new_weights[d.pk] for d in group) for version, group in serving.items()}
        audit_record(
            actor=actor, action="traffic.set", target_type="model", target=model.name, before=before, after=after
        )
        publish_routing_change("traffic")
    return after


def audit_record(
    *,
    actor: Actor,
    action: str,
    target_type: str,
    target: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    always: bool = False,
) -> AuditEntry | None:
    """Record a management write. Call inside the write's transaction.atomic, so that the
    entry commits with the write and a write that rolls back leaves none.

    A write that changed nothing (``before`` given and equal to ``after``: the same traffic
    split, bounds or policy set again) records nothing and returns None, so no caller needs its
    own check. An entry with no ``before`` (a creation, an event) is always recorded; so is one
    with ``always``, for an entry other code reads as a marker (a hot-swap's steps).
    """
    if before is not None and before == after and not always:
        return None
    user = actor if actor is not None and actor.is_authenticated else None
    return AuditEntry.objects.create(
        actor_id=user.pk if user is not None else None,
        actor_name=user.get_username() if user is not None else actor.name if isinstance(actor, SystemActor) else "",
        action=action,
        target_type=target_type,
        target=target,
        before=before,
        after=after,
    )


def _version_snapshot(version: ModelVersion) -> dict[str, Any]:
    return {
        "model": version.model.name,
        "version": version.version,
        "framework": version.framework,
        "artifact_uri": version.artifact_uri,
        "artifact_sha256": version.artifact_sha256,
        "artifact_size": version.artifact_size,
        "gpu_type": version.gpu_type,
        "gpu_count": version.gpu_count,
        "gpu_vram_gb": version.gpu_vram_gb,
        "config": version.config,
        "status": version.status,
    }


def deployment_snapshot(deployment: Deployment) -> dict[str, Any]:
    return {
        "id": deployment.pk,
        "model": deployment.version.model.name,
        "version": deployment.version.version,
        "replicas": deployment.replicas,
        "min_replicas": deployment.min_replicas,
        "max_replicas": deployment.max_replicas,
        "traffic_weight": deployment.traffic_weight,
        "is_canary": deployment.is_canary,
        "gpu_type": deployment.gpu_type,
        "standby": deployment.standby,
        "max_adapters": deployment.max_adapters,
        "status": deployment.status,
    }


# --- Scaling ---------------------------------------------------------------------------


def deployment_scale(
    *,
    actor: Actor,
    deployment: Deployment,
    replicas: int,
    reasons: list[str],
    observations: dict[str, Any] | None = None,
    expected: int | None = None,
    action: str = "autoscale",
) -> Deployment | None:
    """Set how many replicas ``deployment`` wants; supervisors with free slots follow.

    Audited with the reasons (and the figures that drove it): for the autoscaler that entry
    is the stored decision. ``expected``: the replica count the decision was made from; if
    the row has another by now (a concurrent change), nothing is written and None returned.
    """
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().select_related("version__model").get(pk=deployment.pk)
        if expected is not None and locked.replicas != expected:
            return None
        floor = max(1, locked.min_replicas)
        if not floor <= replicas <= locked.max_replicas:
            raise InvalidInput(
                "replicas", f"Must lie between {floor} (min_replicas, at least 1) and {locked.max_replicas}."
            )
        if replicas == locked.replicas:
            return locked
        before = {"replicas": locked.replicas}
        Deployment.objects.filter(pk=locked.pk).update(replicas=replicas)
        locked.replicas = replicas
        audit_record(
            actor=actor,
            action=action,
            target_type="deployment",
            target=str(locked.pk),
            before=before,
            after={"replicas": replicas, "reasons": reasons, "observations": observations or {}},
        )
        if replicas > before["replicas"]:
            from registry.warm_pool import standby_promote  # it builds on this module

            # Warm standbys serve the new places at once (announced on commit); the rest start cold.
            standby_promote(deployment=locked, reason="scale-up", actor=actor)
    deployment.replicas = replicas
    return locked


def replica_record_load_time(*, replica: Replica, seconds: float, host: str) -> AuditEntry | None:
    """Record how long a replica's engine took from its start to its first good /health (the
    model's load time; target: ready within 60 s). Call inside the transaction that marks
    it ready, so the two commit together."""
    deployment = Deployment.objects.select_related("version__model").get(pk=replica.deployment_id)
    return audit_record(
        actor=SUPERVISOR,
        action="replica.ready",
        target_type="replica",
        target=str(replica.pk),
        before=None,
        after={
            "load_seconds": round(seconds, 3),
            "host": host,
            "deployment": deployment.pk,
            "model": deployment.version.model.name,
            "version": deployment.version.version,
        },
    )


def deployment_bounds_set(
    *, actor: Actor, deployment: Deployment, min_replicas: int | None = None, max_replicas: int | None = None
) -> Deployment:
    """Set the range the autoscaler keeps ``deployment``'s replica count in (1 ≤ min ≤ max);
    a count now outside it moves to the nearest bound. Audited; supervisors follow the count."""
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        low = locked.min_replicas if min_replicas is None else min_replicas
        high = locked.max_replicas if max_replicas is None else max_replicas
        if low < 1:
            raise InvalidInput("min_replicas", "Must be at least 1: a deployment always keeps a replica.")
        if high < low:
            raise InvalidInput("max_replicas", f"Must be at least min_replicas ({low}).")
        replicas = min(max(locked.replicas, low), high)
        before = {"min_replicas": locked.min_replicas, "max_replicas": locked.max_replicas, "replicas": locked.replicas}
        after = {"min_replicas": low, "max_replicas": high, "replicas": replicas}
        if before == after:
            return locked
        Deployment.objects.filter(pk=locked.pk).update(min_replicas=low, max_replicas=high, replicas=replicas)
        locked.min_replicas, locked.max_replicas, locked.replicas = low, high, replicas
        audit_record(
            actor=actor, action="deployment.bounds", target_type="deployment", target=str(locked.pk),
            before=before, after=after,
        )  # fmt: skip
        if replicas > before["replicas"]:
            from registry.warm_pool import standby_promote  # it builds on this module

            standby_promote(deployment=locked, reason="scale-up", actor=actor)
    deployment.min_replicas, deployment.max_replicas, deployment.replicas = low, high, replicas
    return locked


# --- LoRA adapters per batch, after deploy -----------------------------------------------


def deployment_adapters_set(*, actor: Actor, deployment: Deployment, max_adapters: int) -> Deployment:
    """Set how many LoRA adapters each engine of ``deployment`` runs in one batch (vLLM's
    ``--max-loras``; 0 turns LoRA off). Audited (``deployment.adapters``, before and after).

    LoRA's layers are built when an engine starts, so running engines keep the value they were
    started with: their supervisors restart them one replica of the deployment at a time
    (``replica_roll_request``), each drained first, and each starts again with the new value.
    Only a serving (pending or running) deployment of a model that can carry adapters; 0 is
    refused while adapters deployed on its version have no other deployment taking adapters to
    run on. A value below the number of adapters deployed is allowed: as with more adapters
    deployed than slots, an engine keeps at most ``max_adapters`` of them in memory and loads
    the one a request names again from its files when it was evicted (vLLM's LRU cache).
    """
    if isinstance(max_adapters, bool) or not isinstance(max_adapters, int):
        raise InvalidInput("max_adapters", f"Must be a whole number between 0 and {MAX_ADAPTERS_PER_BATCH}.")
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().select_related("version__model").get(pk=deployment.pk)
        if locked.status not in SERVING_STATUSES:
            raise InvalidInput(
                "max_adapters", f"Deployment {locked.pk} is {locked.status}: it runs no engines to change."
            )
        if is_adapter_framework(locked.version.framework):
            raise InvalidInput(
                "max_adapters", "A LoRA adapter runs on its base's replicas; set this on the base's deployment."
            )
        adapters_check(locked.version, max_adapters)
        if locked.max_adapters == max_adapters:
            return locked
        if max_adapters == 0:
            _adapters_keep_a_carrier(locked)
        before = {"max_adapters": locked.max_adapters}
        Deployment.objects.filter(pk=locked.pk).update(max_adapters=max_adapters)
        locked.max_adapters = max_adapters
        audit_record(
            actor=actor, action="deployment.adapters", target_type="deployment", target=str(locked.pk),
            before=before, after={"max_adapters": max_adapters},
        )  # fmt: skip
    deployment.max_adapters = max_adapters
    return locked


def _adapters_keep_a_carrier(deployment: Deployment) -> None:
    """Refuse to turn LoRA off on ``deployment`` (row locked) while adapters deployed on its
    version would be left with no engine to run on: no other serving deployment of the version
    takes adapters."""
    deployed = adapters_wanted(base_ids=[deployment.version_id])
    if not deployed:
        return
    others = (
        Deployment.objects.filter(version_id=deployment.version_id, status__in=SERVING_STATUSES, max_adapters__gt=0)
        .exclude(pk=deployment.pk)
        .exists()
    )
    if others:
        return
    names = ", ".join(adapter.lora_name for adapter in deployed[:5]) + (", …" if len(deployed) > 5 else "")
    raise InvalidInput(
        "max_adapters",
        f"{len(deployed)} LoRA adapter{'s are' if len(deployed) != 1 else ' is'} deployed on {deployment.version} "
        f"({names}) and only this deployment's engines take adapters: stop "
        f"{'their deployments' if len(deployed) != 1 else 'its deployment'} first, or keep at least 1.",
    )
