"""The bundled models' import as the console runs it: what is imported, and the state of the
last run (queued, running with its progress lines, done or failed), kept in Redis by the
Celery task ``registry.tasks.bundled_models_import`` and polled by the page.

One run at a time: queueing claims a Redis key that the run refreshes with each progress
line, so a worker that died mid-run frees it after ``STALE_AFTER`` without a progress line.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import transaction

from core import keys
from core.redis import sync_redis
from registry.bundled import BUNDLED_MODELS, BundledModel, import_bundled_models
from registry.models import ModelVersion
from registry.services import Actor, audit_record
from registry.signals import bundled_import_queued

STALE_AFTER = timedelta(minutes=15)
MAX_LINES = 200
IDLE: dict[str, Any] = {"state": "idle", "lines": [], "updated_at": None, "started_by": "", "error": ""}


def _state_key() -> str:
    return keys.namespaced("registry", "bundled_import", "state")


def _claim_key() -> str:
    return keys.namespaced("registry", "bundled_import", "active")


def _now() -> str:
    return datetime.now(UTC).isoformat()


def import_state() -> dict[str, Any]:
    """The last run: ``state`` (idle, queued, running, done, failed), its progress ``lines``,
    ``updated_at``, ``started_by`` and ``error``."""
    raw = sync_redis().get(_state_key())
    state: dict[str, Any] = {**IDLE, **json.loads(raw)} if raw else dict(IDLE)
    state["active"] = bool(sync_redis().exists(_claim_key()))
    return state


def _write(state: dict[str, Any]) -> None:
    state = {k: v for k, v in state.items() if k != "active"}
    sync_redis().set(
        _state_key(), json.dumps({**state, "updated_at": _now()}), ex=int(timedelta(days=30).total_seconds())
    )


def import_claim(*, started_by: str) -> bool:
    """Mark a run queued; False when one is queued or running already."""
    if not sync_redis().set(_claim_key(), started_by or "operator", nx=True, ex=int(STALE_AFTER.total_seconds())):
        return False
    _write({"state": "queued", "lines": [], "started_by": started_by, "error": ""})
    return True


def import_run(*, force: bool = False) -> list[ModelVersion]:
    """Import every bundled model (``registry.bundled``), recording progress; the task's body."""
    state = import_state()
    lines: list[str] = []
    redis = sync_redis()

    def progress(line: str) -> None:
        lines.append(line)
        del lines[:-MAX_LINES]
        redis.set(_claim_key(), state.get("started_by") or "operator", ex=int(STALE_AFTER.total_seconds()))
        _write({**state, "state": "running", "lines": lines})

    progress("starting the import")
    try:
        imported = import_bundled_models(progress=progress, force=force)
    except Exception as exc:
        _write({**state, "state": "failed", "lines": lines, "error": f"{exc.__class__.__name__}: {exc}"})
        raise
    finally:
        redis.delete(_claim_key())
    count = f"{len(imported)} model{'' if len(imported) == 1 else 's'}"
    _write({**state, "state": "done", "lines": [*lines, f"done: {count} imported or up to date"]})
    return imported


@dataclass(frozen=True)
class BundledStatus:
    bundled: BundledModel
    installed_version: str | None  # its source's wheel here, None when this host does not have it
    version: str | None  # the version an import registers; None when this host cannot tell
    registered: ModelVersion | None  # the registry's: ``version``, else the latest imported before

    @property
    def current(self) -> bool:
        """The registry holds the version an import would register now."""
        return self.registered is not None and self.registered.version == self.version


def bundled_models_status() -> list[BundledStatus]:
    """Each bundled model as the registry holds it, beside its source on this host.

    The registry decides: a model imported (on this host or another, from a wheel this host may
    lack) shows its version, the one an import registers now or, failing that, the latest an
    earlier import registered (``source_package`` in its config)."""
    names = [bundled.name for bundled in BUNDLED_MODELS]
    versions: dict[str, list[ModelVersion]] = {}
    for found in ModelVersion.objects.select_related("model").filter(model__name__in=names).order_by("-created_at"):
        versions.setdefault(found.model.name, []).append(found)
    rows = []
    for bundled in BUNDLED_MODELS:
        try:
            installed: str | None = importlib.metadata.version(bundled.distribution)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        # The version it is registered as: the wheel's, or its builder's (small models, adapters).
        try:
            version: str | None = bundled.version
        except importlib.metadata.PackageNotFoundError:  # the wheel (or an adapter's base's) is missing
            version = None
        held = versions.get(bundled.name, [])
        registered = next((v for v in held if v.version == version), None) or next(
            (v for v in held if v.config.get("source_package") == bundled.distribution), None
        )
        rows.append(BundledStatus(bundled=bundled, installed_version=installed, version=version, registered=registered))
    return rows


def bundled_import_start(*, actor: Actor, force: bool = False) -> bool:
    """Start the import of the bundled models (``registry.tasks.bundled_models_import``, queued
    on commit by the receiver of ``registry.signals.bundled_import_queued``); False when a run
    is queued or running already. Audited."""
    user = actor if actor is not None and actor.is_authenticated else None
    if not import_claim(started_by=user.get_username() if user is not None else ""):
        return False
    with transaction.atomic():
        audit_record(actor=actor, action="bundled.import", target_type="model", target="bundled models", before=None,
                     after={"force": force})  # fmt: skip

        def announce() -> None:
            bundled_import_queued.send(sender=ModelVersion, force=force)

        transaction.on_commit(announce)
    return True
