"""Faults of the stores: PostgreSQL or Redis cut away (through tests/support/tcp_proxy.py),
restarted under load, or refusing writes (a Redis server of the test's own,
tests/support/chaos.py). What clients see meanwhile, that the platform recovers, and that every
admitted request is metered exactly once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.db import connection
from django.utils import timezone

from tests.support import processes
from tests.support.chaos import (
    GATEWAY_ENV,
    OK,
    PG_OUTAGE_SECONDS,
    REFUSAL_SECONDS,
    REFUSED,
    ClientLoad,
    assert_clients_saw_only,
    assert_metered_exactly_once,
    engine_stats,
    fake_engines,
    left_in_flight,
    report,
    start_metering,
    summary,
)
from tests.support.gateway import (
    chat,
    in_flight_of,
    persisted,
    wait_for,
)
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.django_db


@pytest.fixture
def db_proxy():
    from django.db import connection

    proxy = TcpProxy(int(connection.settings_dict["PORT"])).start()
    yield proxy
    proxy.close()


class TestDatabaseDown:
    def test_beyond_the_routing_tables_staleness_it_is_a_503(
        self, api_key, fake_model, db_proxy, spawn_gateway, django_db_blocker
    ):
        url = processes.test_database_url().replace(f":{db_proxy.target[1]}/", f":{db_proxy.port}/")
        gateway = spawn_gateway(
            DATABASE_URL=url, REPLICA_STALE_AFTER="86400", ROUTING_REFRESH_SECONDS="0.2", ROUTING_MAX_STALENESS="2",
            API_KEY_CACHE_SECONDS="1",
        )  # fmt: skip
        fake_model.control(mode="normal", tokens=2, delay=0)
        assert chat(gateway, api_key, fake_model.name).status_code == 200
        db_proxy.cut()
        time.sleep(2.5)
        refused = chat(gateway, api_key, fake_model.name, timeout=60)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] in {"auth_unavailable", "routing_unavailable", "database_unavailable"}
        assert httpx.get(f"{gateway.base_url}/v1/models", timeout=60,
                         headers={"Authorization": f"Bearer {api_key.secret}"}).status_code == 503  # fmt: skip
        db_proxy.restore()
        wait_for(lambda: chat(gateway, api_key, fake_model.name).status_code == 200, 20, "not back after restore")


@pytest.fixture
def redis_proxy():
    from django.conf import settings

    port = int(settings.REDIS_URL.rsplit(":", 1)[1].split("/")[0])
    proxy = TcpProxy(port).start()
    yield proxy
    proxy.close()


class TestRedisOutage:
    def test_a_settlement_waits_for_redis_however_long_it_is_away(
        self, make_api_key, fake_model, redis_proxy, spawn_gateway
    ):
        from django.conf import settings

        from billing.ledger import sweep_lost_requests

        db = settings.REDIS_URL.rsplit("/", 1)[1]
        gateway = spawn_gateway(
            TEST_REDIS_URL=f"redis://127.0.0.1:{redis_proxy.port}/{db}", REPLICA_STALE_AFTER="86400",
            ROUTING_REFRESH_SECONDS="0.2",
        )  # fmt: skip
        key = make_api_key(rate_limit_rpm=10_000)
        fake_model.control(mode="normal", tokens=10, delay=0.2)
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(chat, gateway, key, fake_model.name, stream=True, timeout=60)
            wait_for(lambda: fake_model.requests() == 1, 10, "not dispatched")
            redis_proxy.cut()  # Redis goes away mid-stream, for longer than the old 6 s of retries
            response = pending.result()
        assert response.status_code == 200
        assert response.text.rstrip().endswith("data: [DONE]")
        request_id = response.headers["x-request-id"]
        time.sleep(10)
        assert sweep_lost_requests() == 0  # the gateway is alive: its request is not the sweeper's
        redis_proxy.restore()
        wait_for(lambda: in_flight_of(key.key_id) == [], 20, "not settled after Redis came back")
        record = persisted([request_id])[request_id]  # written once Redis is back
        assert (record.status_code, record.completion_tokens) == (200, 10)
        assert in_flight_of(key.key_id) == []


# --- Redis restarted ---------------------------------------------------------------------------------


def test_redis_restarted_under_load(own_redis, metering, make_api_key, spawn_gateway, django_db_blocker, tmp_path):
    """Redis killed and started again: no crash; while it is away admission fails closed (503
    limiter_unavailable, nothing reaches an engine), requests in flight are answered and
    settled once Redis is back, and WebSocket sockets stay open."""
    since = timezone.now()
    name, endpoints, engines = fake_engines(django_db_blocker, 1, tokens=20, delay=0.1, latency=0.2)
    gateway = spawn_gateway(TEST_REDIS_URL=own_redis.url, REPLICA_STALE_AFTER="86400", **GATEWAY_ENV)
    worker = start_metering(tmp_path, TEST_REDIS_URL=own_redis.url)
    metering.append(worker)
    key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
    try:
        with ClientLoad([gateway], key.secret, name, json=2, sse=2, ws=2) as load:
            wait_for(lambda: load.in_progress("sse") and load.in_progress("ws"), 20, "streams in progress")
            own_redis.stop(kill=True)  # kill -9, then started again on the same data 3 s later
            down_at = time.monotonic()
            time.sleep(3)
            own_redis.start()
            up_at = time.monotonic()
            recovered = load.wait_for(OK, after=up_at, count=3)
            time.sleep(1)
        outcomes = load.outcomes
        engine_requests = engine_stats(endpoints[0])["requests"]
    finally:
        for process in engines:
            process.kill()

    assert gateway.process.poll() is None, "the gateway crashed"
    assert worker.process.poll() is None, "the metering worker crashed"
    assert_clients_saw_only(outcomes, {OK: set(), REFUSED: {"limiter_unavailable"}})
    refused = [o for o in outcomes if o.verdict == REFUSED]
    assert refused, summary(outcomes)
    assert all(o.status in (503, None) and down_at <= o.ended for o in refused), summary(outcomes)  # WS: no status
    spanning = [o for o in outcomes if o.verdict == OK and o.started < down_at < o.ended]
    assert spanning, "no request was in flight while Redis went away"
    metering_ = assert_metered_exactly_once([key.key_id], outcomes, since)
    # Fail closed: only admitted requests reached the engine.
    assert engine_requests == sum(o.verdict == OK for o in outcomes)
    report(
        "Redis restarted", requests=len(outcomes), answered=sum(o.verdict == OK for o in outcomes),
        refused_503=len(refused), in_flight_settled_late=len(spanning), records=len(metering_.records),
        down_s=up_at - down_at, first_answer_after_restart_s=recovered,
    )  # fmt: skip


# --- PostgreSQL restarted ------------------------------------------------------------------------------


def test_postgresql_restarted_under_load(own_redis, metering, make_api_key, spawn_gateway, django_db_blocker,
                                           tmp_path):  # fmt: skip
    """Gateway and persister lose PostgreSQL (every connection cut, new ones refused) for a
    while: clear 503s where a key or route cannot be checked, no crash, and the usage of
    everything answered meanwhile is persisted after recovery."""
    from billing.models import UsageRecord

    since = timezone.now()
    name, _, engines = fake_engines(django_db_blocker, 1, tokens=20, delay=0.1, latency=0.2)
    database = connection.settings_dict
    proxy = TcpProxy(int(database["PORT"]), database["HOST"]).start()
    url = processes.test_database_url().replace(f"@{database['HOST']}:{database['PORT']}/", f"@127.0.0.1:{proxy.port}/")
    assert str(proxy.port) in url
    gateway = spawn_gateway(DATABASE_URL=url, TEST_REDIS_URL=own_redis.url, REPLICA_STALE_AFTER="86400",
                            **GATEWAY_ENV)  # fmt: skip
    worker = start_metering(tmp_path, DATABASE_URL=url, TEST_REDIS_URL=own_redis.url)
    metering.append(worker)
    key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
    try:
        with ClientLoad([gateway], key.secret, name, json=2, sse=2, ws=2) as load:
            wait_for(lambda: load.in_progress("sse") and load.in_progress("ws"), 20, "streams in progress")
            proxy.cut()
            down_at = time.monotonic()
            time.sleep(PG_OUTAGE_SECONDS)
            proxy.restore()
            up_at = time.monotonic()
            recovered = load.wait_for(OK, after=up_at, count=3)
            # What was answered meanwhile is persisted now (its events waited in Redis).
            meanwhile = [o.request_id for o in load.outcomes if o.verdict == OK and down_at < o.ended < up_at]
            persisted = wait_for(
                lambda: UsageRecord.objects.filter(request_id__in=meanwhile).count() == len(meanwhile)
                and time.monotonic(), 20, "the usage of what was answered during the outage persisted",
            )  # fmt: skip
            time.sleep(1)
        outcomes = load.outcomes
    finally:
        proxy.restore()
        for process in engines:
            process.kill()

    assert gateway.process.poll() is None, "the gateway crashed"
    assert worker.process.poll() is None, "the metering worker crashed"
    codes = {"auth_unavailable", "routing_unavailable", "database_unavailable"}
    assert_clients_saw_only(outcomes, {OK: set(), REFUSED: codes})
    refused = [o for o in outcomes if o.verdict == REFUSED]
    assert refused, summary(outcomes)
    assert all(o.status in (503, None) for o in refused), summary(outcomes)  # a WebSocket error frame has none
    # A key that cannot be checked waits for a database connection at most the pool's 10 s.
    assert max(o.seconds for o in refused) < 13, summary(outcomes)
    assert meanwhile, "nothing was answered during the outage"
    metering_ = assert_metered_exactly_once([key.key_id], outcomes, since)
    proxy.close()
    report(
        "PostgreSQL restarted", requests=len(outcomes), answered=sum(o.verdict == OK for o in outcomes),
        refused_503=len(refused), answered_during_outage=len(meanwhile), records=len(metering_.records),
        slowest_503_s=max(o.seconds for o in refused), down_s=up_at - down_at, first_answer_after_s=recovered,
        usage_persisted_after_s=persisted - up_at,
    )  # fmt: skip


# --- Redis refusing writes ------------------------------------------------------------------------------


def test_redis_refusing_writes_for_a_while(own_redis, metering, make_api_key, spawn_gateway, django_db_blocker,
                                            tmp_path):  # fmt: skip
    """NOREPLICAS on every write for REFUSAL_SECONDS: admission fails closed, and a settlement
    refused meanwhile is written later with its completion tokens; nothing parked or lost."""
    since = timezone.now()
    name, _, engines = fake_engines(django_db_blocker, 1, tokens=30, delay=0.1, latency=0.2)
    gateway = spawn_gateway(TEST_REDIS_URL=own_redis.url, REPLICA_STALE_AFTER="86400", **GATEWAY_ENV)
    worker = start_metering(tmp_path, TEST_REDIS_URL=own_redis.url)
    metering.append(worker)
    key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
    try:
        with ClientLoad([gateway], key.secret, name, json=2, sse=2, ws=2) as load:
            wait_for(lambda: load.in_progress("sse") and load.in_progress("ws"), 20, "streams in progress")
            own_redis.refuse_writes()
            refused_at = time.monotonic()
            time.sleep(REFUSAL_SECONDS)
            own_redis.accept_writes()
            accepted_at = time.monotonic()
            recovered = load.wait_for(OK, after=accepted_at, count=3)
            waiting = left_in_flight(key.key_id)  # admitted before the refusal, their settlements refused
            settled = wait_for(lambda: not (waiting & left_in_flight(key.key_id)) and time.monotonic(), 30,
                               "the refused settlements written")  # fmt: skip
            time.sleep(1)
        outcomes = load.outcomes
    finally:
        own_redis.accept_writes()
        for process in engines:
            process.kill()

    assert gateway.process.poll() is None, "the gateway crashed"
    assert worker.process.poll() is None, "the metering worker crashed"
    assert_clients_saw_only(outcomes, {OK: set(), REFUSED: {"limiter_unavailable"}})
    refused = [o for o in outcomes if o.verdict == REFUSED]
    assert refused, summary(outcomes)
    assert all(o.status in (503, None) for o in refused), summary(outcomes)  # a WebSocket error frame has none
    # Answered while Redis refused writes: each one's settlement was refused, and waited.
    deferred = [o for o in outcomes if o.verdict == OK and refused_at < o.ended < accepted_at]
    assert deferred, "no request finished while Redis refused writes"
    metering_ = assert_metered_exactly_once([key.key_id], outcomes, since)
    assert all(metering_.records[str(o.request_id)].completion_tokens == 30 for o in deferred)
    report(
        f"Redis refusing writes {REFUSAL_SECONDS:g} s", requests=len(outcomes),
        answered=sum(o.verdict == OK for o in outcomes), refused_503=len(refused), settled_late=len(deferred),
        records=len(metering_.records), first_answer_after_s=recovered, all_settled_after_s=settled - accepted_at,
    )  # fmt: skip
