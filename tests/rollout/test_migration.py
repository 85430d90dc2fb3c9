"""Canaries moved out of the registry (issue 19) by state alone: a database made before the
move migrates in place and keeps every canary, decision and link."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.migrations.executor import MigrationExecutor

BEFORE: list[tuple[str, str | None]] = [("registry", "0005_replica_restart_requested_at"), ("rollout", None)]


def migrate(targets: list[tuple[str, str | None]]) -> MigrationExecutor:
    executor = MigrationExecutor(connection)
    executor.migrate(targets)  # (app, None): the app unapplied, as `migrate app zero`
    return MigrationExecutor(connection)  # a fresh loader sees what is applied now


@pytest.mark.django_db  # one transaction, rolled back: a flush would wipe what other tests committed
def test_a_database_from_before_the_move_keeps_its_canaries():
    latest = MigrationExecutor(connection).loader.graph.leaf_nodes()
    now = datetime.now(UTC)
    try:
        old = migrate(BEFORE).loader.project_state([("registry", "0005_replica_restart_requested_at")]).apps
        Model = old.get_model("registry", "Model")
        ModelVersion = old.get_model("registry", "ModelVersion")
        Canary = old.get_model("registry", "Canary")
        CanaryDecision = old.get_model("registry", "CanaryDecision")
        model = Model.objects.create(name="before-move", task="chat")
        base, candidate = (
            ModelVersion.objects.create(
                model=model, version=v, framework="transformers", artifact_uri=f"file:///{v}", artifact_sha256="0" * 64,
                artifact_size=1,
            )
            for v in ("1", "2")
        )  # fmt: skip
        canary = Canary.objects.create(
            model=model, base_version=base, canary_version=candidate, steps=[5, 50], interval_seconds=60,
            step_started_at=now, next_decision_at=now, status="paused",
        )  # fmt: skip
        CanaryDecision.objects.create(canary=canary, at=now, step=0, canary_percent=5, verdict="hold", reasons=["x"])
    finally:
        migrate(latest)

    from rollout.models import Canary as MovedCanary
    from rollout.selectors import canary_latest

    moved = MovedCanary.objects.select_related("model", "canary_version").get(model__name="before-move")
    assert (moved.status, moved.steps, moved.canary_version.version) == ("paused", [5, 50], "2")
    assert canary_latest(model=moved.model) == moved
    assert [(d.verdict, d.reasons) for d in moved.decisions.all()] == [("hold", ["x"])]
    # The one-active-canary constraint is still the database's.
    with pytest.raises(IntegrityError), transaction.atomic():
        MovedCanary.objects.create(
            model=moved.model, base_version=moved.canary_version, canary_version=moved.base_version, steps=[5],
            interval_seconds=60, step_started_at=now, next_decision_at=now,
        )  # fmt: skip
