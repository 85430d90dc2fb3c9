"""Accounts moved out of billing (issue 19) by state alone: a database made before the move
migrates in place and keeps every row, key and link."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE: list[tuple[str, str | None]] = [("billing", "0009_invoice_billed_to"), ("accounts", None)]


def migrate(targets: list[tuple[str, str | None]]) -> MigrationExecutor:
    executor = MigrationExecutor(connection)
    executor.migrate(targets)  # (app, None): the app unapplied, as `migrate app zero`
    return MigrationExecutor(connection)  # a fresh loader sees what is applied now


@pytest.mark.django_db  # one transaction, rolled back: a flush would wipe what other tests committed
def test_a_database_from_before_the_move_keeps_its_data():
    latest = MigrationExecutor(connection).loader.graph.leaf_nodes()
    try:
        old = migrate(BEFORE).loader.project_state([("billing", "0009_invoice_billed_to")]).apps
        Organization = old.get_model("billing", "Organization")
        ApiKey = old.get_model("billing", "ApiKey")
        UsageRecord = old.get_model("billing", "UsageRecord")
        org = Organization.objects.create(name="Before Co", slug="before-co", tier="free", rate_limit_rpm=7)
        key = ApiKey.objects.create(key_hash="a" * 64, prefix="sk-before", organization=org, name="old key")
        request_id = uuid.uuid4()
        UsageRecord.objects.create(
            request_id=request_id, api_key=key, organization=org, model="m", model_version="1", prompt_tokens=3,
            completion_tokens=4, total_tokens=7, latency_ms=1, status_code=200, created_at=datetime.now(UTC),
            cost=Decimal("0.5"),
        )  # fmt: skip
    finally:
        # The rows above leave deferred foreign-key checks pending in this transaction, and
        # PostgreSQL alters no table with pending trigger events: run them now.
        with connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        migrate(latest)

    from accounts.models import ApiKey as MovedApiKey
    from accounts.models import Organization as MovedOrganization
    from billing.models import UsageRecord as CurrentUsageRecord

    moved = MovedOrganization.objects.get(slug="before-co")
    assert (moved.name, moved.tier, moved.rate_limit_rpm) == ("Before Co", "free", 7)
    assert MovedApiKey.objects.get(organization=moved).name == "old key"
    record = CurrentUsageRecord.objects.select_related("api_key__organization").get(request_id=request_id)
    assert record.api_key.organization == moved
    assert record.cost == Decimal("0.5")
