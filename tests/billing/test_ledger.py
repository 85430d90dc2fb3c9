"""The ledger on the real Redis: idempotent admission, and a sweeper that never closes live requests."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import orjson
import pytest

from accounts.grants import KeyGrant, ScopeLimits
from billing import ledger
from billing.ledger import Presence, UsageEvent
from core import keys
from core.redis import sync_redis


def _grant(*, rpm: int = 10, tpm: int = 1000, concurrent: int | None = 2) -> KeyGrant:
    # Ids far above the test database's: the limiter keys of these grants are theirs alone.
    ident = 10**9 + uuid.uuid4().int % 10**8
    limits = ScopeLimits(rpm=rpm, tpm=tpm, concurrent=concurrent, token_quota=None, spend_cap=None, alert_percent=80)
    unlimited = ScopeLimits(None, None, None, None, None, 80)
    return KeyGrant(
        key_id=ident, organization_id=ident, prefix="sk-test", allowed_models=frozenset(), tier="paid",
        key_limits=limits, org_limits=unlimited, expires_at=None,
    )  # fmt: skip


def _draft(grant: KeyGrant, *, created_at: datetime | None = None) -> UsageEvent:
    return UsageEvent(
        request_id=uuid.uuid4(), api_key_id=grant.key_id, organization_id=grant.organization_id,
        model=f"ledger-{grant.key_id}", model_version="1", endpoint="chat", prompt_tokens=10, completion_tokens=0,
        cached_tokens=0, latency_ms=0, ttft_ms=None, status_code=0, created_at=created_at or datetime.now(UTC),
    )  # fmt: skip


def _events_for(request_id: uuid.UUID) -> list[dict[bytes, bytes]]:
    entries: list[tuple[bytes, dict[bytes, bytes]]] = sync_redis().xrange(keys.usage_stream())  # type: ignore[assignment]
    return [f for _, f in entries if f[b"request_id"] == str(request_id).encode()]


def _remaining(headroom: ledger.Headroom) -> tuple[int, int]:
    assert headroom.requests is not None
    assert headroom.tokens is not None
    return headroom.requests.left, headroom.tokens.left


class TestTogether:
    """Concurrent admissions and settlements travel together (ledger.Coalesced): fewer script
    runs than requests, and each request's outcome exactly as if it had gone alone."""

    async def test_concurrent_admissions_share_runs_and_keep_their_own_outcomes(self, monkeypatch):
        grant = _grant(rpm=5, concurrent=None)
        runs = []
        real = ledger._script

        def counting(client):
            script = real(client)

            async def run(*, keys, args):
                runs.append(args[0])
                return await script(keys=keys, args=args)

            return run

        monkeypatch.setattr(ledger, "_script", counting)
        drafts = [_draft(grant) for _ in range(12)]
        outcomes = await asyncio.gather(
            *(ledger.admit(grant=grant, draft=d, tokens=10, spend=Decimal(0), model_limit=100) for d in drafts),
            return_exceptions=True,
        )
        admitted = [d for d, o in zip(drafts, outcomes, strict=True) if isinstance(o, ledger.Headroom)]
        refused = [o for o in outcomes if isinstance(o, ledger.Refused)]
        assert len(admitted) == 5  # the key's five requests a minute, not one more
        assert len(refused) == 7
        assert all(r.refusal.code == "rate_limit_exceeded" for r in refused)
        admissions = runs.count("admit_many")
        assert 1 <= admissions < len(drafts)

        settled = await asyncio.gather(*(ledger.settle(replace(d, status_code=200)) for d in drafts))
        assert sorted(settled) == [False] * 7 + [True] * 5  # the refused were never in flight
        assert runs.count("settle_many") < len(drafts)
        for draft in admitted:
            assert len(_events_for(draft.request_id)) == 1
        assert sync_redis().zcard(keys.model_queue(drafts[0].model)) == 0

    async def test_a_redis_error_reaches_every_request_of_the_run(self, monkeypatch):
        from redis.exceptions import ConnectionError as RedisConnectionError

        def broken(client):
            async def run(*, keys, args):
                await asyncio.sleep(0.01)
                raise RedisConnectionError("Redis went away")

            return run

        monkeypatch.setattr(ledger, "_script", broken)
        grant = _grant(concurrent=None)
        drafts = [_draft(grant) for _ in range(4)]
        outcomes = await asyncio.gather(
            *(ledger.admit(grant=grant, draft=d, tokens=10, spend=Decimal(0), model_limit=100) for d in drafts),
            *(ledger.settle(replace(d, status_code=200)) for d in drafts),
            return_exceptions=True,
        )
        assert all(isinstance(o, ledger.LedgerUnavailable) for o in outcomes[:4]), outcomes
        assert all(isinstance(o, RedisConnectionError) for o in outcomes[4:]), outcomes  # settle_or_defer's to judge


class TestAdmission:
    async def test_a_retried_admission_is_charged_once(self):
        grant = _grant()
        draft = _draft(grant)
        first = await ledger.admit(grant=grant, draft=draft, tokens=100, spend=Decimal(0), model_limit=10)
        # The same call again, as after a lost reply: answered the same, charged nothing more.
        again = await ledger.admit(grant=grant, draft=draft, tokens=100, spend=Decimal(0), model_limit=10)
        assert again == first
        assert _remaining(first) == (9, 900)
        assert _remaining(await ledger.peek(grant)) == (9, 900)
        client = sync_redis()
        assert client.zcard(keys.limit_scope("key", grant.key_id) + ":conc") == 1
        assert client.zcard(keys.model_queue(draft.model)) == 1

        assert await ledger.settle(replace(draft, status_code=200, completion_tokens=5))
        assert not await ledger.settle(replace(draft, status_code=200, completion_tokens=5))  # once
        assert _remaining(await ledger.peek(grant)) == (9, 1000 - 15)  # refunded to what was used
        assert client.zcard(keys.limit_scope("key", grant.key_id) + ":conc") == 0
        assert client.zcard(keys.model_queue(draft.model)) == 0
        [event] = _events_for(draft.request_id)
        assert UsageEvent.from_fields(event) == replace(draft, status_code=200, completion_tokens=5)

    async def test_a_models_first_interactive_request_in_flight_is_published(self):
        """Batch workers stop a model's lines when its interactive requests go from none to one
        in flight: the ledger publishes the model's name then, and only then (not for a second
        request in flight, nor for a batch line)."""
        grant = _grant(concurrent=None)
        pubsub = sync_redis().pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(keys.model_arrivals_channel())

        def published() -> list[bytes]:
            messages = []
            while (message := pubsub.get_message(timeout=0.3)) is not None:
                messages.append(message["data"])
            return messages

        try:
            first, second = _draft(grant), _draft(grant)
            line = replace(_draft(grant), batch=True)
            await ledger.admit(grant=grant, draft=line, tokens=10, spend=Decimal(0), model_limit=10)
            assert published() == []  # batch lines never join the model's queue
            await ledger.admit(grant=grant, draft=first, tokens=10, spend=Decimal(0), model_limit=10)
            await ledger.admit(grant=grant, draft=second, tokens=10, spend=Decimal(0), model_limit=10)
            assert published() == [first.model.encode()]
            await ledger.settle(replace(first, status_code=200))
            await ledger.settle(replace(second, status_code=200))
            again = _draft(grant)
            await ledger.admit(grant=grant, draft=again, tokens=10, spend=Decimal(0), model_limit=10)
            assert published() == [again.model.encode()]  # the next burst's first request
            await ledger.settle(replace(again, status_code=200))
            assert await ledger.release(line.request_id)
        finally:
            pubsub.close()

    async def test_a_refusal_charges_nothing(self):
        grant = _grant(concurrent=1)
        await ledger.admit(grant=grant, draft=_draft(grant), tokens=100, spend=Decimal(0), model_limit=10)
        with pytest.raises(ledger.Refused) as refused:
            await ledger.admit(grant=grant, draft=_draft(grant), tokens=100, spend=Decimal(0), model_limit=10)
        assert refused.value.refusal.code == "rate_limit_exceeded"
        assert "concurrent" in refused.value.refusal.message
        assert _remaining(await ledger.peek(grant)) == (9, 900)

    async def test_a_batch_line_meets_budgets_only_and_is_given_back_without_an_event(self):
        grant = _grant(rpm=1, tpm=50, concurrent=1)
        held = _draft(grant)  # the key's one request a minute and one place, taken
        await ledger.admit(grant=grant, draft=held, tokens=40, spend=Decimal(0), model_limit=10)
        line = replace(_draft(grant), batch=True)
        # Above the per-minute requests, tokens and concurrency: a batch line meets none of them.
        await ledger.admit(grant=grant, draft=line, tokens=500, spend=Decimal(0), model_limit=10)
        assert _remaining(await ledger.peek(grant)) == (0, 10)  # the interactive buckets untouched
        assert sync_redis().zcard(keys.model_queue(line.model)) == 1  # only the interactive request
        ledger.sweep_lost_requests()  # whatever its gateway: the sweeper leaves it to its batch
        assert _entry(line.request_id) is not None
        [budget_key] = sync_redis().keys(f"{keys.limit_scope('key', grant.key_id)}:b:*")
        budget = sync_redis().hgetall(budget_key)
        assert int(budget[b"rt"]) == 540  # reserved against the month's quota
        assert await ledger.release(line.request_id)
        assert not await ledger.release(line.request_id)  # once
        assert _entry(line.request_id) is None
        budget = sync_redis().hgetall(budget_key)
        assert (int(budget[b"rt"]), int(budget.get(b"ut", 0))) == (40, 0)  # returned whole, nothing used
        assert _events_for(line.request_id) == []  # and never metered
        assert not await ledger.settle(replace(line, status_code=200))  # nothing left to settle

    def test_the_event_schema_round_trips(self):
        draft = _draft(_grant())
        event = replace(draft, ttft_ms=12, cached_tokens=3, status_code=499)
        fields = {k.encode(): v.encode() for k, v in event.to_fields().items()}
        assert UsageEvent.from_fields(fields) == event
        assert event.to_fields()["ttft_ms"] == "12"
        assert replace(event, ttft_ms=None).to_fields()["ttft_ms"] == ""
        with pytest.raises(ValueError, match="negative"):
            UsageEvent.from_fields({**fields, b"prompt_tokens": b"-1"})


def _entry(request_id: uuid.UUID) -> dict[str, object] | None:
    raw = sync_redis().hget(keys.inflight_requests(), str(request_id))
    return orjson.loads(raw) if raw else None


def _set_gateway(request_id: uuid.UUID, gateway: str) -> None:
    entry = _entry(request_id)
    assert entry is not None
    sync_redis().hset(keys.inflight_requests(), str(request_id), orjson.dumps({**entry, "gateway": gateway}))


class TestSweeper:
    async def test_a_missing_heartbeat_is_suspected_before_it_is_judged(self, settings):
        """A Redis restart or a late beat must not close live requests: dead means missing
        for GATEWAY_LOST_AFTER as the sweeper sees it, on Redis's clock."""
        settings.GATEWAY_LOST_AFTER = 1.5
        grant = _grant()
        draft = _draft(grant)
        await ledger.admit(grant=grant, draft=draft, tokens=100, spend=Decimal(0), model_limit=10)
        gateway = f"gw-{uuid.uuid4().hex}"
        _set_gateway(draft.request_id, gateway)
        heartbeat = keys.gateway_heartbeat(gateway)

        # Other tests' entries may be swept too: look at this request's entry, not the count.
        ledger.sweep_lost_requests()
        assert _entry(draft.request_id) is not None  # missing once: only suspected
        sync_redis().set(heartbeat, "1")  # it beats again (Redis was back)
        await asyncio.sleep(1.6)
        ledger.sweep_lost_requests()
        assert _entry(draft.request_id) is not None
        assert sync_redis().hget(keys.gateway_suspects(), gateway) is None  # suspicion lifted
        sync_redis().delete(heartbeat)  # now it is really gone
        ledger.sweep_lost_requests()
        assert _entry(draft.request_id) is not None
        await asyncio.sleep(1.6)
        assert ledger.sweep_lost_requests() >= 1
        assert _entry(draft.request_id) is None
        [event] = _events_for(draft.request_id)
        closed = UsageEvent.from_fields(event)
        assert (closed.status_code, closed.prompt_tokens) == (ledger.GATEWAY_LOST, 10)
        ledger.sweep_lost_requests()
        assert len(_events_for(draft.request_id)) == 1  # settled once
        assert sync_redis().hget(keys.gateway_suspects(), gateway) is None  # forgotten with its last entry

    async def test_a_gateway_whose_clock_is_wrong_is_not_overdue(self):
        """Ages come from Redis's clock: a gateway host two hours behind is still live."""
        grant = _grant()
        draft = _draft(grant, created_at=datetime.now(UTC) - timedelta(hours=2))
        await ledger.admit(
            grant=grant, draft=draft, tokens=100, spend=Decimal(0), model_limit=10
        )  # this process: alive
        ledger.presence.beat()
        entry = _entry(draft.request_id)
        assert entry is not None
        assert abs(float(str(entry["t"])) - float(sync_redis().time()[0])) < 5
        ledger.sweep_lost_requests()
        assert _entry(draft.request_id) is not None
        await ledger.settle(replace(draft, status_code=200))

    async def test_the_heartbeat_survives_a_blocked_event_loop(self):
        presence = Presence(f"gw-{uuid.uuid4().hex}", interval=0.2, ttl=1)
        presence.ensure_started()
        try:
            await asyncio.sleep(0.3)
            time.sleep(3)  # noqa: ASYNC251 - the point: the loop blocked 3x longer than the heartbeat lives
            assert sync_redis().exists(keys.gateway_heartbeat(presence.gateway_id))
        finally:
            presence.stop()


def test_spend_is_counted_in_micro_units_rounded_up():
    from billing.pricing import micros_up

    assert micros_up(Decimal("0.000003")) == 3
    assert micros_up(Decimal("0.0000030001")) == 4  # never below the exact cost
    assert micros_up(Decimal(0)) == 0


class TestSettlements:
    async def test_the_worker_keeps_retrying_whatever_a_try_raises(self, monkeypatch):
        """An error that is not Redis's own (uvloop's closed transport was one) must not end
        the worker while settlements wait: they would wait for good."""
        grant = _grant()
        draft = _draft(grant)
        await ledger.admit(grant=grant, draft=draft, tokens=100, spend=Decimal(0), model_limit=10)
        real_settle, tries = ledger.settle, []

        async def flaky(event: UsageEvent) -> bool:
            tries.append(event.request_id)
            if len(tries) == 1:
                raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")
            return await real_settle(event)

        monkeypatch.setattr(ledger, "settle", flaky)
        pending = ledger.Settlements()
        pending.add(replace(draft, status_code=200, completion_tokens=5))
        assert pending._worker.task is not None
        await asyncio.wait_for(pending._worker.task, 10)  # it ends once nothing waits
        assert len(pending) == 0
        assert len(tries) == 2
        assert _entry(draft.request_id) is None
        assert len(_events_for(draft.request_id)) == 1

    async def test_settlements_of_unknown_admissions_are_bounded(self):
        """While Redis is down every request's admission fails with an unknown outcome, and each
        would wait in memory for as long as the outage lasts; those are kept up to a bound
        (nearly all never reached Redis; one that did is swept when overdue). Admitted
        requests are always kept."""
        grant = _grant()
        pending = ledger.Settlements()
        pending.UNKNOWN_KEPT = 2
        for _ in range(3):
            pending.add(replace(_draft(grant), status_code=503), admitted=False)
        assert (len(pending), pending.dropped) == (2, 1)
        pending.add(replace(_draft(grant), status_code=200))  # admitted: never dropped
        assert len(pending) == 3
        assert pending._worker.task is not None
        await asyncio.wait_for(pending._worker.task, 10)  # none was in flight: each settles to nothing
        assert len(pending) == 0
        pending.add(replace(_draft(grant), status_code=503), admitted=False)  # room again
        assert len(pending) == 1
        await asyncio.wait_for(pending._worker.task, 10)


async def test_a_write_on_a_closed_transport_is_a_lost_connection(monkeypatch):
    """uvloop raises RuntimeError for it; callers handle an outage as a ConnectionError."""
    import redis.asyncio as aioredis
    from redis.asyncio.connection import AbstractConnection
    from redis.exceptions import ConnectionError as RedisConnectionError

    from core.redis import async_redis

    async def closed(self: AbstractConnection, command: object, check_health: bool = True) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    monkeypatch.setattr(aioredis.Connection, "send_packed_command", closed)
    with pytest.raises(RedisConnectionError, match="Connection lost while writing"):
        await async_redis().ping()


@pytest.fixture
def own_redis(tmp_path, settings):
    """A Redis server of this test's own, for the ledger in this process: making it refuse
    writes must not refuse them to everyone sharing the embedded one."""
    from core import redis as core_redis
    from tests.support.chaos import RedisServer

    def forget_clients() -> None:
        core_redis.sync_redis.cache_clear()
        core_redis._async_clients.clear()
        ledger._scripts.clear()  # bound to the clients they were registered on

    server = RedisServer(tmp_path / "redis").start()
    settings.REDIS_URL = server.url
    forget_clients()
    yield server
    server.stop()
    forget_clients()


class TestRefusedWrites:
    """Defect 3 of issue 18: Redis that refuses writes for a while (MISCONF, READONLY, OOM,
    BUSY, NOREPLICAS) is an outage, not a verdict: the settlement waits and is written with
    the tokens the request used, never parked with them lost."""

    async def test_a_settlement_refused_for_a_moment_is_written_once_redis_takes_it(self, own_redis):
        grant = _grant()
        draft = _draft(grant)
        await ledger.admit(grant=grant, draft=draft, tokens=100, spend=Decimal(0), model_limit=10)
        final = replace(draft, status_code=200, completion_tokens=7)
        client = sync_redis()
        dead_before = client.xlen(keys.usage_dead_letters())
        own_redis.refuse_writes()  # Redis's own way of refusing every write: not enough replicas
        try:
            assert not await ledger.settle_or_defer(final)
            assert len(ledger.settlements) >= 1
            await asyncio.sleep(0.5)  # the worker tries again and is refused again
            assert _entry(draft.request_id) is not None
        finally:
            own_redis.accept_writes()
        for _ in range(100):  # the worker's next try, after its backoff
            if _entry(draft.request_id) is None:
                break
            await asyncio.sleep(0.1)
        [event] = _events_for(draft.request_id)
        assert UsageEvent.from_fields(event) == final  # the completion tokens are billed
        assert client.xlen(keys.usage_dead_letters()) == dead_before  # nothing parked

    def test_only_a_refusal_that_cannot_pass_is_permanent(self):
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import ReadOnlyError, ResponseError

        from core.redis import is_transient

        wrapped = "Error running script (call to f_1): @user_script:1: @user_script: 1: -NOREPLICAS Not enough"
        for passing in ("MISCONF Errors writing to disk", "OOM command not allowed", "BUSY Redis is busy", wrapped):
            assert is_transient(ResponseError(passing))
        assert is_transient(ReadOnlyError("You can't write against a read only replica.", status_code="READONLY"))
        assert is_transient(RedisConnectionError("gone"))
        assert not is_transient(ResponseError("Error running script (call to f_1): @user_script:9: attempt to index"))
        assert not is_transient(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))


class TestALateSettlementCorrectsTheSweepers:
    """Defect 8 of issue 18: a gateway cut off from Redis long enough is judged lost, and the
    sweeper settles its live requests from their admission drafts (the prompt, status 500).
    When the gateway comes back and settles one for real, that must correct the record, never
    be dropped (the completion tokens unbilled) nor count twice."""

    async def test_the_gateways_settlement_after_the_sweepers_is_written_once_as_a_correction(self, settings):
        settings.GATEWAY_LOST_AFTER = 0.2
        grant = _grant()
        draft = _draft(grant)
        await ledger.admit(grant=grant, draft=draft, tokens=100, spend=Decimal(0), model_limit=10)
        _set_gateway(draft.request_id, f"gw-lost-{uuid.uuid4().hex}")
        ledger.sweep_lost_requests()  # suspected
        await asyncio.sleep(0.3)
        ledger.sweep_lost_requests()  # judged lost: settled from the draft
        [swept] = _events_for(draft.request_id)
        assert (swept[b"status_code"], swept[b"completion_tokens"], swept[b"revision"]) == (b"500", b"0", b"0")

        final = replace(draft, status_code=200, completion_tokens=40)
        assert await ledger.settle(final)  # not dropped: a correction
        assert not await ledger.settle(final)  # and only once
        events = [UsageEvent.from_fields(e) for e in _events_for(draft.request_id)]
        assert [e.revision for e in events] == [0, 1]
        assert replace(events[1], revision=0) == final
        month = sync_redis().hgetall(keys.limit_scope("key", grant.key_id) + f":b:{draft.created_at:%Y-%m}")
        assert int(month[b"ut"]) == final.total_tokens  # the budget holds what was used, once
        assert int(month[b"rt"]) == 0

    def test_the_persister_puts_the_correction_in_place_of_the_first_record(self, db):
        from accounts.services import api_key_create, organization_create
        from billing.models import UsageRecord
        from billing.usage import persist_usage_stream

        key = api_key_create(organization=organization_create(name=f"Sweep {uuid.uuid4().hex[:6]}"), name="k").api_key
        grant = replace(_grant(), key_id=key.pk, organization_id=key.organization_id)
        base = replace(_draft(grant), status_code=500, error_code="gateway_lost")
        corrected = replace(base, status_code=200, completion_tokens=40, error_code="", revision=1)
        for order in ((base, corrected), (corrected, base)):  # either may reach the persister first
            first, second = (replace(e, request_id=uuid.uuid4()) for e in order)
            second = replace(second, request_id=first.request_id)
            for event in (first, second):
                sync_redis().xadd(keys.usage_stream(), event.to_fields())
                persist_usage_stream()
            [record] = UsageRecord.objects.filter(request_id=first.request_id)
            assert (record.status_code, record.completion_tokens, record.revision) == (200, 40, 1)
