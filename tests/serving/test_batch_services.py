"""Batch jobs' services without processes: the enqueued-lines limit, request ids, the files'
retention, and the batch's own share of a model's replicas."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import orjson
import pytest
from django.utils import timezone

from accounts.services import api_key_create, organization_create
from serving.batches import services as batch_services
from serving.batches import worker as batch_worker
from serving.batches.files import file_create, files_purge_expired
from serving.models import Batch, BatchLine, StoredFile

pytestmark = pytest.mark.django_db


def _upload(tmp_path: Path, organization_id: int, lines: int) -> StoredFile:
    path = tmp_path / f"in-{lines}.jsonl"
    line = {"method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}}
    path.write_bytes(b"".join(orjson.dumps({"custom_id": f"c{i}", **line}) + b"\n" for i in range(lines)))
    return file_create(organization_id=organization_id, api_key_id=None, upload=path, filename="in.jsonl",
                       purpose="batch")  # fmt: skip


def test_an_organisation_cannot_queue_more_lines_than_its_limit(settings, store, tmp_path):
    settings.BATCH_MAX_ENQUEUED_LINES = 5
    org = organization_create(name="Batch limit")
    key = api_key_create(organization=org, name="k").api_key
    first = _upload(tmp_path, org.pk, 3)
    batch = batch_services.batch_create(organization_id=org.pk, api_key_id=key.pk, input_file_id=first.public_id,
                                 endpoint="/v1/embeddings")  # fmt: skip
    assert batch_services.enqueued_lines(org.pk) == 3
    with pytest.raises(batch_services.BadBatch) as refused:
        batch_services.batch_create(organization_id=org.pk, api_key_id=key.pk, input_file_id=first.public_id,
                             endpoint="/v1/embeddings")  # fmt: skip
    assert refused.value.status == 429
    assert refused.value.code == "enqueued_limit_exceeded"
    # Lines done no longer count: once validated and two finished, two more fit.
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.IN_PROGRESS)
    BatchLine.objects.bulk_create([
        BatchLine(batch=batch, index=i, custom_id=f"c{i}", body={}, status="succeeded" if i < 2 else "pending")
        for i in range(3)
    ])  # fmt: skip
    assert batch_services.enqueued_lines(org.pk) == 1
    batch_services.batch_create(organization_id=org.pk, api_key_id=key.pk, input_file_id=_upload(tmp_path, org.pk, 4)
                         .public_id, endpoint="/v1/embeddings")  # fmt: skip
    other = organization_create(name="Batch limit, another")
    other_file = _upload(tmp_path, other.pk, 5)  # another organisation's limit is its own
    other_key = api_key_create(organization=other, name="k").api_key
    batch_services.batch_create(organization_id=other.pk, api_key_id=other_key.pk, input_file_id=other_file.public_id,
                         endpoint="/v1/embeddings")  # fmt: skip


def test_each_attempt_of_each_line_has_its_own_request_id():
    ids = {batch_services.line_request_id("batch_a", i, k) for i in range(50) for k in range(1, 4)}
    assert len(ids) == 150
    assert batch_services.line_request_id("batch_a", 7, 2) == batch_services.line_request_id("batch_a", 7, 2)
    assert batch_services.line_request_id("batch_a", 7, 2) != batch_services.line_request_id("batch_b", 7, 2)


def test_output_files_are_deleted_after_their_retention(store, tmp_path):
    org = organization_create(name="Batch retention")
    kept, gone = _upload(tmp_path, org.pk, 1), _upload(tmp_path, org.pk, 2)
    StoredFile.objects.filter(pk=gone.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    StoredFile.objects.filter(pk=kept.pk).update(expires_at=timezone.now() + timedelta(days=1))
    path = store.local_path(gone.uri)
    assert path.exists()
    assert files_purge_expired() == 1
    assert not StoredFile.objects.filter(pk=gone.pk).exists()
    assert not path.exists()
    assert StoredFile.objects.filter(pk=kept.pk).exists()


async def test_the_batch_share_yields_to_interactive_requests(monkeypatch, settings):
    settings.BATCH_SLOTS_PER_REPLICA, settings.BATCH_MIN_SLOTS, settings.BATCH_YIELD_SECONDS = 4, 0, 0.2
    replicas = ["r1", "r2"]
    in_flight = {"n": 0}

    async def find(name: str) -> object:
        return type("Route", (), {"versions": ["v1"]})()

    async def interactive(model: str) -> int:
        return in_flight["n"]

    monkeypatch.setattr(batch_worker, "find_model", find)
    monkeypatch.setattr(batch_worker.router, "routable", lambda version: replicas)
    monkeypatch.setattr(batch_worker, "_interactive_in_flight", interactive)
    model = f"share-{id(in_flight)}"
    assert await batch_worker.batch_share(model) == 8  # two idle replicas, four lines each
    in_flight["n"] = 1
    assert await batch_worker.batch_share(model) == 4  # one replica's share given back
    in_flight["n"] = 3
    assert await batch_worker.batch_share(model) == 0  # every replica busy: the batch waits
    in_flight["n"] = 0
    assert await batch_worker.batch_share(model) == 0  # a gap between requests is not idle capacity
    await asyncio.sleep(0.25)
    assert await batch_worker.batch_share(model) == 8
    settings.BATCH_MIN_SLOTS = 1
    in_flight["n"] = 5
    assert await batch_worker.batch_share(model) == 1  # at least the minimum


async def test_an_interactive_arrival_stops_the_models_lines_without_waiting_for_a_look(monkeypatch, settings):
    """The ledger publishes a model's first interactive request at admission; the worker's
    listener stops that model's lines in flight beyond its share then (here its one replica's
    whole share), with its watcher and loop never looking, and leaves other models' lines be."""
    import uuid
    from dataclasses import replace
    from datetime import UTC, datetime
    from decimal import Decimal

    from accounts.grants import KeyGrant, ScopeLimits
    from billing import ledger
    from billing.ledger import UsageEvent
    from core import keys
    from core.redis import async_redis

    settings.BATCH_SLOTS_PER_REPLICA, settings.BATCH_MIN_SLOTS, settings.BATCH_PREEMPT = 4, 0, True

    async def find(name: str) -> object:
        return type("Route", (), {"versions": ["v1"]})()

    monkeypatch.setattr(batch_worker, "find_model", find)
    monkeypatch.setattr(batch_worker.router, "routable", lambda version: ["r1"])
    ident = 10**9 + uuid.uuid4().int % 10**8
    unlimited = ScopeLimits(None, None, None, None, None, 80)
    grant = KeyGrant(
        key_id=ident, organization_id=ident, prefix="sk-test", allowed_models=frozenset(), tier="paid",
        key_limits=unlimited, org_limits=unlimited, expires_at=None,
    )  # fmt: skip
    model, other = f"arrivals-{ident}", f"arrivals-other-{ident}"
    lines = [asyncio.ensure_future(asyncio.sleep(3600)) for _ in range(3)]
    running = {model: {lines[0]: 1.0, lines[1]: 2.0}, other: {lines[2]: 1.0}}
    listener = asyncio.ensure_future(batch_worker.listen_for_arrivals(running))
    try:
        channel = keys.model_arrivals_channel()
        for _ in range(100):  # subscribed
            if dict(await async_redis().pubsub_numsub(channel)).get(channel.encode()):
                break
            await asyncio.sleep(0.05)
        draft = UsageEvent(
            request_id=uuid.uuid4(), api_key_id=ident, organization_id=ident, model=model, model_version="1",
            endpoint="chat", prompt_tokens=10, completion_tokens=0, cached_tokens=0, latency_ms=0, ttft_ms=None,
            status_code=0, created_at=datetime.now(UTC),
        )  # fmt: skip
        await ledger.admit(grant=grant, draft=draft, tokens=10, spend=Decimal(0), model_limit=10)
        done, _ = await asyncio.wait(lines[:2], timeout=10)
        assert len(done) == 2
        assert all(line.cancelled() for line in done)
        assert not lines[2].done()  # another model's line runs on
        await ledger.settle(replace(draft, status_code=200))
    finally:
        listener.cancel()
        for line in lines:
            line.cancel()
        await asyncio.gather(listener, *lines, return_exceptions=True)
