"""Batch jobs end to end: a real gateway, a real Celery batch worker (``celery worker -Q batch``)
and fake engines, driven by the unmodified openai SDK. Each line is answered, written and
metered once, even when the worker is killed with SIGKILL mid-batch or an engine dies."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import openai
import orjson
import pytest

from tests.support.batch_worker import (
    WORKER_ENV,
    inflight_of,
    results_of,
    sdk_client,
    usage_of,
    wait_for,
)
from tests.support.gateway import FakeModel, committed, register_fake_replica, start_fake_engine
from tests.support.processes import Gateway, start_gateway

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def batch_gateway(django_db_setup, tmp_path_factory) -> Iterator[Gateway]:
    gateway = start_gateway(tmp_path_factory.mktemp("batch-gateway"), **WORKER_ENV)
    yield gateway
    gateway.stop()


@pytest.fixture
def fake(django_db_setup, django_db_blocker) -> Iterator[FakeModel]:
    process, endpoint = start_fake_engine()
    name = f"fake-batch-{uuid.uuid4().hex[:8]}"
    replica_id = committed(django_db_blocker, lambda: register_fake_replica(name, endpoint))
    yield FakeModel(name, endpoint, process, replica_id)
    process.kill()
    process.wait(5)
    committed(django_db_blocker, lambda: _stop_batches_of(name))


def _stop_batches_of(model: str) -> None:
    """Leave no batch of a model whose engine is gone for later tests' workers to try."""
    from serving.models import Batch

    Batch.objects.filter(model=model, status="in_progress").update(stop_reason="cancelled")


def _chat_file(model: str, count: int, **body: Any) -> bytes:
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": f"Line {i}"}], "user": f"line-{i}",
                  **body}}
        for i in range(count)
    ]  # fmt: skip
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def _price(django_db_blocker, model: str, **amounts: str) -> None:
    from billing.services import price_set
    from registry.models import Model

    committed(django_db_blocker, lambda: price_set(model=Model.objects.get(name=model), **amounts))


# --- the OpenAI flow -------------------------------------------------------------------------


def test_the_sdk_runs_a_batch_each_line_once_at_half_price(
    batch_gateway, worker_factory, fake, api_key, django_db_blocker
):
    _price(django_db_blocker, fake.name, input_per_million="2", output_per_million="4")
    client = sdk_client(batch_gateway, api_key.secret)
    uploaded = client.files.create(file=("in.jsonl", _chat_file(fake.name, 12)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
        metadata={"job": "nightly"},
    )  # fmt: skip
    assert (batch.status, batch.endpoint, batch.metadata) == ("validating", "/v1/chat/completions", {"job": "nightly"})
    worker = worker_factory()
    done = wait_for(client, batch.id, worker, until={"completed", "failed"})
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 12, 0)
    assert done.error_file_id is None
    results = results_of(client, done.output_file_id)
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(12)]  # in line order
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["choices"] for r in results)
    assert fake.requests() == 12  # each line ran once
    assert batch.id in [b.id for b in client.batches.list()]

    records = usage_of(batch.id, 12)
    assert len(records) == 12
    assert all(r.batch and r.status_code == 200 for r in records)
    for record in records:  # half the interactive price, exactly
        full = (record.prompt_tokens * Decimal(2) + record.completion_tokens * Decimal(4)) / Decimal(1_000_000)
        assert record.cost == full / 2
    assert inflight_of(batch.id, 12) == 0


def test_a_batch_is_refused_with_a_reason(batch_gateway, fake, api_key, make_api_key):
    client = sdk_client(batch_gateway, api_key.secret)
    uploaded = client.files.create(file=("in.jsonl", _chat_file(fake.name, 2)), purpose="batch")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"endpoint": "/v1/images/generations"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"input_file_id": "file-nope"}, "input_file_id"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
    ]
    for changes, param in cases:
        fields: dict[str, Any] = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
                                  "completion_window": "24h", **changes}  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.create(**fields)
        assert refused.value.body["param"] == param, refused.value.body
    # Another organisation sees neither the file nor the batch.
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    stranger = sdk_client(batch_gateway, make_api_key().secret)
    with pytest.raises(openai.NotFoundError):
        stranger.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        stranger.batches.cancel(batch.id)
    assert batch.id not in [b.id for b in stranger.batches.list()]
    with pytest.raises(openai.BadRequestError):
        stranger.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    client.batches.cancel(batch.id)


def test_lines_that_do_not_match_the_batch_fail_its_validation(batch_gateway, worker_factory, fake, api_key):
    client = sdk_client(batch_gateway, api_key.secret)
    content = _chat_file(fake.name, 2) + orjson.dumps(
        {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {"model": fake.name, "input": "a"}}
    )
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, batch.id, worker_factory(), until={"failed", "completed"})
    assert done.status == "failed"
    assert done.errors.data[0].line == 3
    assert "url" in done.errors.data[0].message


def test_cancel_stops_new_lines_and_keeps_what_was_done(batch_gateway, worker_factory, fake, api_key):
    fake.control(latency=0.3)
    client = sdk_client(batch_gateway, api_key.secret)
    uploaded = client.files.create(file=("in.jsonl", _chat_file(fake.name, 40)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    worker = worker_factory()
    wait_for(client, batch.id, worker, until={"in_progress"})
    while client.batches.retrieve(batch.id).request_counts.completed < 4:
        worker.poke()
        time.sleep(0.2)
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = wait_for(client, batch.id, worker, until={"cancelled"})
    ran = fake.requests()
    assert ran < 40
    output, errors = results_of(client, done.output_file_id), results_of(client, done.error_file_id)
    assert len(output) + len(errors) == 40 == done.request_counts.total
    assert len(output) == done.request_counts.completed == ran  # every line that ran is in the output
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert len({r["custom_id"] for r in output + errors}) == 40
    time.sleep(1.5)
    assert fake.requests() == ran  # nothing started after the cancel was answered... and finished


def test_an_expired_batch_keeps_its_answers_and_lists_the_rest(
    batch_gateway, worker_factory, fake, api_key, django_db_blocker
):
    fake.control(latency=0.3)
    client = sdk_client(batch_gateway, api_key.secret)
    uploaded = client.files.create(file=("in.jsonl", _chat_file(fake.name, 30)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    worker = worker_factory()
    while client.batches.retrieve(batch.id).request_counts.completed < 3:
        worker.poke()
        time.sleep(0.2)

    def expire_now() -> None:
        from django.utils import timezone

        from serving.models import Batch

        Batch.objects.filter(public_id=batch.id).update(expires_at=timezone.now())

    committed(django_db_blocker, expire_now)
    done = wait_for(client, batch.id, worker, until={"expired"})
    output, errors = results_of(client, done.output_file_id), results_of(client, done.error_file_id)
    assert len(output) >= 3
    assert len(output) + len(errors) == 30
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert done.expired_at is not None


# --- exactly once, whoever dies ------------------------------------------------------------------


def test_a_worker_killed_mid_batch_leaves_every_line_answered_and_metered_once(
    batch_gateway, worker_factory, fake, api_key
):
    fake.control(latency=0.25)
    client = sdk_client(batch_gateway, api_key.secret)
    uploaded = client.files.create(file=("in.jsonl", _chat_file(fake.name, 40)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    first = worker_factory()
    while client.batches.retrieve(batch.id).request_counts.completed < 8:
        first.poke()
        time.sleep(0.1)
    first.kill()  # SIGKILL, with lines in flight
    second = worker_factory()
    done = wait_for(client, batch.id, second, until={"completed"}, timeout=120)
    assert done.request_counts.completed == 40
    assert done.request_counts.failed == 0
    results = results_of(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in results) == sorted(f"req-{i}" for i in range(40))
    records = usage_of(batch.id, 40)
    assert len(records) == 40  # one usage record per line: in-flight attempts were given back, not metered
    assert sorted({r.request_id for r in records} - {uuid.UUID(r["id"].removeprefix("batch_req_")) for r in results})\
        == []  # the records are exactly the answers written  # fmt: skip
    assert inflight_of(batch.id, 40) == 0


def test_an_engine_killed_mid_batch_has_its_lines_run_again_elsewhere(
    batch_gateway, worker_factory, fake, api_key, django_db_blocker
):
    process, endpoint = start_fake_engine()  # a second replica of the same model
    committed(django_db_blocker, lambda: register_fake_replica(fake.name, endpoint, version="2"))
    try:
        for url in (fake.endpoint, endpoint):
            FakeModel(fake.name, url, process, 0).control(latency=0.3)
        client = sdk_client(batch_gateway, api_key.secret)
        uploaded = client.files.create(file=("in.jsonl", _chat_file(fake.name, 30)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        worker = worker_factory()
        while client.batches.retrieve(batch.id).request_counts.completed < 4:
            worker.poke()
            time.sleep(0.1)
        process.send_signal(signal.SIGKILL)  # mid-answer on some lines
        done = wait_for(client, batch.id, worker, until={"completed"}, timeout=120)
        assert (done.request_counts.completed, done.request_counts.failed) == (30, 0), worker.log()[-3000:]
        records = [r for r in usage_of(batch.id, 30) if r.status_code == 200]
        assert len(records) == 30
        assert len({r.request_id for r in records}) == 30
        assert len(usage_of(batch.id, 30)) == 30  # no record for an attempt its engine dropped
    finally:
        process.kill()
        process.wait(5)


def test_a_spend_cap_stops_the_batch_without_overspending(
    batch_gateway, worker_factory, fake, make_api_key, django_db_blocker
):
    _price(django_db_blocker, fake.name, input_per_million="10000", output_per_million="10000")
    key = make_api_key(rate_limit_rpm=100_000)

    def cap() -> None:
        from accounts.models import Organization

        Organization.objects.filter(pk=key.organization_id).update(monthly_spend_cap=Decimal("2.00"))

    committed(django_db_blocker, cap)
    client = sdk_client(batch_gateway, key.secret)
    # ~40 tokens reserved per line at the batch price (5,000 a million): about 0.2 each, so
    # roughly ten lines fit under the cap of 2.00.
    uploaded = client.files.create(file=("in.jsonl", _chat_file(fake.name, 40, max_tokens=5)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_for(client, batch.id, worker_factory(), until={"completed"})
    errors = results_of(client, done.error_file_id)
    assert errors
    assert {e["error"]["code"] for e in errors} == {"insufficient_quota"}
    assert 0 < done.request_counts.completed < 40
    spent = sum(r.cost for r in usage_of(batch.id, 40))
    assert 0 < spent <= Decimal("2.00")


def test_the_seeds_batch_calls_back_signed(batch_gateway, worker_factory, fake, api_key, tmp_path, django_db_blocker):
    import http.server
    import threading

    from serving.batches.webhooks import SIGNATURE_HEADER, verify

    received: list[tuple[bytes, str]] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((body, self.headers[SIGNATURE_HEADER]))
            self.send_response(200 if len(received) > 1 else 500)  # the first delivery fails: retried
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gateway = start_gateway(tmp_path, **WORKER_ENV, WEBHOOK_ALLOW_PRIVATE_ADDRESSES="true")
    try:
        import httpx

        callback = f"http://127.0.0.1:{server.server_address[1]}/hook"
        answer = httpx.post(
            f"{gateway.base_url}/api/v1/batch", headers={"Authorization": f"Bearer {api_key.secret}"},
            json={"model": fake.name, "inputs": ["one", "two", {"messages": [{"role": "user", "content": "3"}]}],
                  "params": {"max_tokens": 4}, "callback_url": callback},
            timeout=30,
        )  # fmt: skip
        assert answer.status_code == 202, answer.text
        created = answer.json()
        assert created["status"] == "validating"
        assert created["estimated_time"] >= 1
        worker = worker_factory(WEBHOOK_ALLOW_PRIVATE_ADDRESSES="true", WEBHOOK_BACKOFF_SECONDS="0.5")
        deadline = time.monotonic() + 90
        while len(received) < 2 and time.monotonic() < deadline:
            worker.poke()  # batch work sends the webhooks due as it goes
            time.sleep(0.5)
        assert len(received) == 2, worker.log()[-3000:]
        body, signature = received[-1]
        from accounts.services import organization_webhook_secret

        secret = committed(
            django_db_blocker, lambda: organization_webhook_secret(organization_id=api_key.organization_id)
        )
        assert verify(secret, body, signature)
        assert not verify(secret, body + b" ", signature)
        event = orjson.loads(body)
        assert event["type"] == "batch.completed"
        assert event["data"]["id"] == created["batch_id"]
        progress = httpx.get(f"{gateway.base_url}/api/v1/batch/{created['batch_id']}",
                             headers={"Authorization": f"Bearer {api_key.secret}"}, timeout=10).json()  # fmt: skip
        assert progress["progress"] == {"total": 3, "completed": 3, "failed": 0}
        refused = httpx.post(
            f"{batch_gateway.base_url}/api/v1/batch", headers={"Authorization": f"Bearer {api_key.secret}"},
            json={"model": fake.name, "inputs": ["x"], "callback_url": callback}, timeout=30,
        )  # fmt: skip
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "callback_url"
    finally:
        gateway.stop()
        server.shutdown()


def test_lines_yield_to_interactive_requests_and_still_run_once(batch_gateway, worker_factory, fake, api_key):
    """Interactive requests on the model stop the batch's lines in flight at once (their engine
    requests cancelled); those lines run again later, each answered and metered once."""
    import threading

    fake.control(latency=1.0)
    client = sdk_client(batch_gateway, api_key.secret)
    uploaded = client.files.create(file=("in.jsonl", _chat_file(fake.name, 12)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    worker = worker_factory(BATCH_YIELD_SECONDS="1")
    wait_for(client, batch.id, worker, until={"in_progress"})
    time.sleep(1.5)  # four lines in flight, a second from their answers
    answered: list[str] = []

    def interactive() -> None:
        reply = client.chat.completions.create(model=fake.name, messages=[{"role": "user", "content": "now"}])
        answered.append(reply.choices[0].message.content or "")

    users = [threading.Thread(target=interactive) for _ in range(2)]
    for user in users:
        user.start()
    for user in users:
        user.join(30)
    assert len(answered) == 2
    done = wait_for(client, batch.id, worker, until={"completed"}, timeout=120)
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
    assert fake.requests() > 12 + 2  # lines stopped mid-answer were sent again
    records = usage_of(batch.id, 12)
    assert len(records) == 12
    assert all(r.status_code == 200 for r in records)
    assert inflight_of(batch.id, 12) == 0


# --- issue 34: one tenant never stalls another's batches ---------------------------------------


def test_a_small_batch_is_not_held_behind_a_huge_one(batch_gateway, worker_factory, fake, make_api_key):
    """Organisation A has 5,000 lines in flight; organisation B's 10-line batch, created later,
    completes within 3x the time it takes alone (lines are claimed fairly between organisations,
    not oldest batch first: A alone would hold B behind ~500 s of lines)."""
    from serving.models import BatchLine

    fake.control(latency=0.4)
    huge_key, small_key = make_api_key(), make_api_key()
    small, huge = sdk_client(batch_gateway, small_key.secret), sdk_client(batch_gateway, huge_key.secret)
    worker = worker_factory()

    def run_small(timeout: float) -> float:
        uploaded = small.files.create(file=("small.jsonl", _chat_file(fake.name, 10)), purpose="batch")
        started = time.monotonic()
        batch = small.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")  # fmt: skip
        done = wait_for(small, batch.id, worker, until={"completed", "failed"}, timeout=timeout)
        assert done.status == "completed", done
        assert done.request_counts.completed == 10
        return time.monotonic() - started

    run_small(timeout=90)  # the worker's start is no part of a batch's time
    alone = run_small(timeout=60)
    uploaded = huge.files.create(file=("huge.jsonl", _chat_file(fake.name, 5000)), purpose="batch")
    big = huge.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while BatchLine.objects.filter(batch__public_id=big.id, status="running").count() < 4:
        assert time.monotonic() < deadline, worker.log()[-3000:]
        worker.poke()
        time.sleep(0.2)
    try:
        behind = run_small(timeout=3 * alone)
    finally:
        huge.batches.cancel(big.id)
    assert behind <= 3 * alone, (alone, behind)
    assert BatchLine.objects.filter(batch__public_id=big.id, status="succeeded").exists()  # A was served too


def test_a_broken_batch_of_one_organisation_stops_nobody_elses(
    batch_gateway, worker_factory, fake, api_key, make_api_key, django_db_blocker
):
    """A batch whose file the database refuses line by line (a NUL, a 513-character custom_id:
    stored before uploads checked them) fails with its reason; another organisation's 5-line
    batch created after it completes (before: both stayed validating, the tick raising)."""
    from accounts.models import ApiKey
    from serving.models import Batch
    from tests.support.batches import stored_file

    other = make_api_key()
    body = {"model": fake.name, "messages": [{"role": "user", "content": "a\u0000"}]}
    bad_line = orjson.dumps({"custom_id": "c" * 513, "method": "POST", "url": "/v1/chat/completions", "body": body})

    def broken() -> str:
        from datetime import timedelta

        from django.utils import timezone

        key = ApiKey.objects.select_related("organization").get(pk=other.key_id)
        file = stored_file(key.organization, _chat_file(fake.name, 2) + bad_line + b"\n")
        return Batch.objects.create(
            public_id=f"batch_{uuid.uuid4().hex[:24]}", organization=key.organization, api_key=key,
            endpoint="/v1/chat/completions", input_file=file, input_file_public_id=file.public_id, total=3,
            expires_at=timezone.now() + timedelta(hours=24),
        ).public_id  # fmt: skip

    bad_id = committed(django_db_blocker, broken)
    client = sdk_client(batch_gateway, api_key.secret)
    uploaded = client.files.create(file=("in.jsonl", _chat_file(fake.name, 5)), purpose="batch")
    good = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    worker = worker_factory()
    done = wait_for(client, good.id, worker, until={"completed", "failed"}, timeout=60)
    assert done.status == "completed", done
    bad = sdk_client(batch_gateway, other.secret).batches.retrieve(bad_id)
    assert bad.status == "failed"
    assert [e.line for e in bad.errors.data] == [3]
    assert "513 characters" in bad.errors.data[0].message


def test_creating_a_batch_is_charged_to_the_key_s_request_rate(batch_gateway, fake, make_api_key):
    key = make_api_key(rate_limit_rpm=2)
    client = sdk_client(batch_gateway, key.secret)
    uploaded = client.files.create(file=("in.jsonl", _chat_file(fake.name, 1)), purpose="batch")
    client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.RateLimitError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.RateLimitError):
        client.files.create(file=("in.jsonl", _chat_file(fake.name, 1)), purpose="batch")
