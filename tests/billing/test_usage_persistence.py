"""Usage and budget alerts from Redis into PostgreSQL: poison entries are parked, never block."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.db import OperationalError
from django.test import Client

from accounts.models import ApiKey
from accounts.services import api_key_create
from billing import usage
from billing.models import BudgetAlert, UsageRecord
from billing.tasks import budget_alerts_persist, usage_persist
from core import keys
from core.redis import sync_redis

pytestmark = pytest.mark.django_db

MAX_DELIVERIES = 5
MONTH = datetime.now(UTC).strftime("%Y-%m")


@pytest.fixture(autouse=True)
def streams(settings):
    """Empty streams, and failed entries retried at once (not after a minute)."""
    settings.PERSIST_RETRY_AFTER_SECONDS = 0
    settings.PERSIST_MAX_DELIVERIES = MAX_DELIVERIES
    client = sync_redis()
    names = [keys.usage_stream(), keys.usage_dead_letters(), keys.budget_alerts(), keys.budget_alert_dead_letters()]
    client.delete(*names)
    yield client
    client.delete(*names)


@pytest.fixture
def key(alice_org) -> ApiKey:
    return api_key_create(organization=alice_org, name="k").api_key


def add_usage(client, key: ApiKey, **overrides: str) -> str:
    """A usage event with the fields serving writes (serving/metering.py)."""
    request_id = str(uuid.uuid4())
    fields = {
        "request_id": request_id,
        "api_key_id": str(key.pk),
        "organization_id": str(key.organization_id),
        "model": "m",
        "model_version": "1",
        "endpoint": "chat",
        "prompt_tokens": "3",
        "completion_tokens": "4",
        "cached_tokens": "0",
        "latency_ms": "10",
        "ttft_ms": "",
        "status_code": "200",
        "created_at": datetime.now(UTC).isoformat(),
        **overrides,
    }
    client.xadd(keys.usage_stream(), fields)
    return request_id


def add_alert(client, key: ApiKey, *, key_id: int | None = None, limit: int = 1000, used: int = 800) -> None:
    """A budget alert as the limiter raises it (billing/ledger.lua)."""
    client.xadd(
        keys.budget_alerts(),
        {
            "scope": "key", "id": str(key_id if key_id is not None else key.pk), "org": str(key.organization_id),
            "budget": "tokens", "month": MONTH, "threshold": "80", "limit": str(limit), "used": str(used),
        },
    )  # fmt: skip


def dead_letters(client, stream: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in client.xrange(stream)]


def pending(client, stream: str) -> int:
    return int(client.xpending(stream, usage.GROUP)["pending"])


class TestPoisonedAlerts:
    def test_usage_is_persisted_behind_alerts_that_always_fail(self, streams, key):
        add_alert(streams, key, key_id=999_999_999)  # its key does not exist
        add_alert(streams, key, limit=10**40, used=10**40)  # no column holds these
        request_ids = [add_usage(streams, key) for _ in range(3)]
        assert usage_persist() == 3  # usage never waits on alerts
        assert set(UsageRecord.objects.values_list("request_id", flat=True)) == {uuid.UUID(r) for r in request_ids}
        for run in range(1, MAX_DELIVERIES + 1):
            assert budget_alerts_persist() == 0
            parked = dead_letters(streams, keys.budget_alert_dead_letters())
            assert len(parked) == (2 if run == MAX_DELIVERIES else 0), run
        assert {entry["deliveries"] for entry in parked} == {str(MAX_DELIVERIES)}
        assert any("unknown api key 999999999" in entry["reason"] for entry in parked)
        assert pending(streams, keys.budget_alerts()) == 0
        assert streams.xlen(keys.budget_alerts()) == 0
        # The stream moves on: a good alert behind them is stored at once.
        add_alert(streams, key)
        assert budget_alerts_persist() == 1
        assert BudgetAlert.objects.get(api_key=key).limit == Decimal(1000)

    def test_one_failing_alert_does_not_stop_its_batch(self, streams, key, bob_org):
        other = api_key_create(organization=bob_org, name="other").api_key
        add_alert(streams, key, key_id=999_999_999)
        add_alert(streams, key)
        add_alert(streams, other)
        assert budget_alerts_persist() == 2
        assert BudgetAlert.objects.count() == 2
        assert pending(streams, keys.budget_alerts()) == 1  # the bad one, to be retried

    def test_the_old_combined_task_no_longer_fails_on_an_alert(self, streams, key):
        add_alert(streams, key, key_id=999_999_999)
        add_usage(streams, key)
        assert usage_persist() == 1


class TestBudgetAlertNumbers:
    @pytest.mark.parametrize("limit", [10**15, 2**63 - 1])
    def test_any_quota_fits(self, streams, key, limit):
        add_alert(streams, key, limit=limit, used=limit + 4096)
        assert budget_alerts_persist() == 1
        alert = BudgetAlert.objects.get(api_key=key)
        assert (alert.limit, alert.used) == (Decimal(limit), Decimal(limit + 4096))

    def test_the_largest_spend_cap_fits(self, streams, key):
        micros = 99_999_999_999_999  # 99999999.999999 in micro-units
        streams.xadd(
            keys.budget_alerts(),
            {"scope": "org", "id": str(key.organization_id), "org": str(key.organization_id), "budget": "spend",
             "month": MONTH, "threshold": "80", "limit": str(micros), "used": str(micros)},
        )  # fmt: skip
        assert budget_alerts_persist() == 1
        assert BudgetAlert.objects.get(api_key=None).limit == Decimal("99999999.999999")


class TestPoisonedUsage:
    def test_a_bad_event_is_parked_after_n_deliveries_and_blocks_nothing(self, streams, key):
        good = [add_usage(streams, key)]
        bad = add_usage(streams, key, prompt_tokens=str(10**12))  # the column refuses it
        good.append(add_usage(streams, key))
        assert usage_persist() == 2
        assert UsageRecord.objects.count() == 2
        for _ in range(MAX_DELIVERIES - 2):
            good.append(add_usage(streams, key))
            usage_persist()
            assert dead_letters(streams, keys.usage_dead_letters()) == []
        usage_persist()
        (parked,) = dead_letters(streams, keys.usage_dead_letters())
        assert parked["request_id"] == bad
        assert parked["deliveries"] == str(MAX_DELIVERIES)
        assert "not stored" in parked["reason"]
        assert set(UsageRecord.objects.values_list("request_id", flat=True)) == {uuid.UUID(r) for r in good}
        assert streams.xlen(keys.usage_stream()) == 0
        assert pending(streams, keys.usage_stream()) == 0

    def test_an_unknown_key_is_retried_before_it_is_parked(self, streams, key):
        add_usage(streams, key, api_key_id="999999999")
        for _ in range(MAX_DELIVERIES - 1):
            usage_persist()
        assert dead_letters(streams, keys.usage_dead_letters()) == []
        usage_persist()
        (parked,) = dead_letters(streams, keys.usage_dead_letters())
        assert "unknown api key" in parked["reason"]

    def test_an_unparseable_event_is_parked_at_once(self, streams, key):
        add_usage(streams, key, prompt_tokens="-1")
        add_usage(streams, key)
        assert usage_persist() == 1
        (parked,) = dead_letters(streams, keys.usage_dead_letters())
        assert "negative" in parked["reason"]

    def test_a_database_outage_parks_nothing(self, streams, key, monkeypatch, settings):
        settings.PERSIST_MAX_DELIVERIES = 1
        request_id = add_usage(streams, key)

        def down(records):
            raise OperationalError("connection refused")

        monkeypatch.setattr(usage, "_insert", down)
        for _ in range(3):
            with pytest.raises(OperationalError):
                usage_persist()
        monkeypatch.undo()
        assert usage_persist() == 1
        assert UsageRecord.objects.filter(request_id=request_id).exists()
        assert dead_letters(streams, keys.usage_dead_letters()) == []


class TestKeysAreNeverDeleted:
    def test_the_admin_has_no_delete_for_keys(self, key):
        admin = get_user_model().objects.create_superuser(username="root", password="pw-1234567890")
        client = Client()
        client.force_login(admin)
        assert client.get(f"/admin/accounts/apikey/{key.pk}/delete/").status_code == 403
        changelist = client.get("/admin/accounts/apikey/").content.decode()
        assert "delete_selected" not in changelist
        assert ApiKey.objects.filter(pk=key.pk).exists()

    def test_an_organisation_with_keys_cannot_be_deleted_in_the_admin(self, key):
        admin = get_user_model().objects.create_superuser(username="root", password="pw-1234567890")
        client = Client()
        client.force_login(admin)
        response = client.post(f"/admin/accounts/organization/{key.organization_id}/delete/", {"post": "yes"})
        assert response.status_code == 403
        assert ApiKey.objects.filter(pk=key.pk).exists()
