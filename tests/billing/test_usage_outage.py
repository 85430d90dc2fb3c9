"""The usage persister after an outage: a batch read while PostgreSQL was down is stored by
the next run at once, not PERSIST_RETRY_AFTER_SECONDS later (found by the chaos tests, tests/faults/test_store.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import redis
from django.db import OperationalError

from accounts.models import ApiKey
from accounts.services import api_key_create
from billing import usage
from billing.models import UsageRecord
from core import keys
from core.redis import sync_redis

pytestmark = pytest.mark.django_db


@pytest.fixture
def stream(settings) -> Iterator[redis.Redis]:
    """An empty usage stream; an entry that fails on its own is retried after a minute."""
    settings.PERSIST_RETRY_AFTER_SECONDS = 60
    client = sync_redis()
    names = [keys.usage_stream(), keys.usage_dead_letters()]
    client.delete(*names)
    yield client
    client.delete(*names)


@pytest.fixture
def key(alice_org) -> ApiKey:
    return api_key_create(organization=alice_org, name="k").api_key


def add_usage(client: redis.Redis, api_key_id: int, organization_id: int) -> str:
    request_id = str(uuid.uuid4())
    client.xadd(keys.usage_stream(), {
        "request_id": request_id, "api_key_id": str(api_key_id), "organization_id": str(organization_id),
        "model": "m", "model_version": "1", "endpoint": "chat", "prompt_tokens": "3", "completion_tokens": "4",
        "cached_tokens": "0", "latency_ms": "10", "ttft_ms": "", "status_code": "200",
        "created_at": datetime.now(UTC).isoformat(),
    })  # fmt: skip
    return request_id


def deliveries(client: redis.Redis) -> list[int]:
    pending = client.xpending_range(keys.usage_stream(), usage.GROUP, min="-", max="+", count=100)
    return [int(entry["times_delivered"]) for entry in pending]


def test_a_batch_read_during_an_outage_is_stored_by_the_next_run_at_once(stream, key, monkeypatch):
    request_ids = [add_usage(stream, key.pk, key.organization_id) for _ in range(3)]

    def down(records: list[UsageRecord]) -> None:
        raise OperationalError("couldn't get a connection after 10.00 sec")

    monkeypatch.setattr(usage, "_insert", down)
    with pytest.raises(OperationalError):
        usage.persist_usage_stream()  # read, then the database failed: the batch is left pending
    monkeypatch.undo()
    assert usage.persist_usage_stream() == 3  # the database is back: stored now, not a minute later
    assert UsageRecord.objects.filter(request_id__in=request_ids).count() == 3
    assert deliveries(stream) == []


def test_an_entry_that_fails_on_its_own_still_waits_for_its_retry(stream, key):
    add_usage(stream, 10**9, key.organization_id)  # an unknown key: its own failure, not an outage
    assert usage.persist_usage_stream() == 0
    assert usage.persist_usage_stream() == 0
    assert deliveries(stream) == [1]  # not delivered again before PERSIST_RETRY_AFTER_SECONDS
