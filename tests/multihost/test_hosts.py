"""The platform on three hosts, networked for real, behind haproxy (docs/scale-out.md).

Each host (a network namespace with its own address on a bridge) runs ``runworkers`` with
one slot and a gateway; PostgreSQL and Redis are on the data host; haproxy balances the
gateways, checking ``/readyz``. One model wants two replicas, so one host's slot is free.
The tests run in order on the one cluster; each leaves it whole. Their figures (the
``CHAOS`` lines) are the failover times docs/scale-out.md quotes.

Root only (network namespaces), with haproxy and iptables from Debian (.ci/run installs
them); elsewhere the module is skipped, saying why.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import pytest
from django.utils import timezone

from tests.support import haproxy, netns
from tests.support.chaos import (
    ERROR_EVENT,
    LOST,
    OK,
    REFUSED,
    ClientLoad,
    assert_clients_saw_only,
    assert_metered_exactly_once,
    left_in_flight,
    reconciled,
    redis_at,
    report,
    summary,
)
from tests.support.cluster import Cluster, create_model, drop_model
from tests.support.gateway import committed, wait_for

_why = netns.unavailable() or haproxy.unavailable()
pytestmark = [pytest.mark.skipif(_why is not None, reason=_why or ""), pytest.mark.django_db]

HOSTS = ["h1", "h2", "h3"]
WANTED = 2


def live_replicas(django_db_blocker: Any, deployment_id: int) -> list[Any]:
    from registry.models import Replica

    return committed(
        django_db_blocker,
        lambda: list(Replica.objects.filter(deployment_id=deployment_id).exclude(state="stopped").order_by("pk")),
    )


def ready_replicas(django_db_blocker: Any, deployment_id: int) -> list[Any]:
    return [r for r in live_replicas(django_db_blocker, deployment_id) if r.state == "ready"]


@pytest.fixture(scope="module")
def cluster(django_db_setup, django_db_blocker, make_api_key, tmp_path_factory) -> Iterator[tuple[Cluster, int, str]]:
    name = f"multihost-{uuid.uuid4().hex[:6]}"
    directory = tmp_path_factory.mktemp("multihost")
    session = int(os.environ.get("TEST_SESSION", "0"))
    with netns.Network(session) as network:
        built = Cluster(network, directory, models=[name], s3=True)
        try:
            built.start(HOSTS)
            # The version's files are registered here (the data host) into the object store;
            # every engine host loads them from there into its own cache.
            files = directory / "artifact"
            files.mkdir()
            (files / "config.json").write_text(json.dumps({"model_type": "fake", "name": name}))
            (files / "weights.bin").write_bytes(os.urandom(256 * 1024))
            stored = built.register_artifact(files, f"{name}/1")
            deployment_id = create_model(django_db_blocker, name, replicas=WANTED, uri=stored.uri,
                                         sha256=stored.sha256, size=stored.size)  # fmt: skip
            with redis_at(built.redis.url):
                wait_for(lambda: len(ready_replicas(django_db_blocker, deployment_id)) == WANTED, 60,
                         "two replicas ready")  # fmt: skip
                built.wait_up(HOSTS)
                for replica in ready_replicas(django_db_blocker, deployment_id):
                    slow_stream(replica.endpoint)
                # Every gateway answers before the tests begin (its routing table has loaded).
                key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000)
                for url in [h.gateway_url for h in built.hosts.values()]:
                    wait_for(partial(answers, url, key.secret, name), 30, "an answer from every gateway")
                yield built, deployment_id, name
        finally:
            built.stop()
            drop_model(django_db_blocker, name)


def answers(base_url: str, secret: str, model: str) -> bool:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        # Straight to a gateway, not through the balancer: as if over HTTPS (production settings).
        headers = {"Authorization": f"Bearer {secret}", "X-Forwarded-Proto": "https"}
        return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=10, headers=headers).status_code == 200
    except httpx.HTTPError:
        return False


def persisted(key_id: int, since: Any) -> None:
    """Every usage event the ledger emitted (the sweeper's too) is stored as a record."""
    wait_for(lambda: reconciled([key_id], since).ok, 20, "every usage event stored")


def slow_stream(endpoint: str) -> None:
    """Answers take ~1 s, so that a fault always meets streams in flight."""
    from tests.support.chaos import control

    control(endpoint, tokens=20, delay=0.05)


def load(built: Cluster, secret: str, name: str) -> ClientLoad:
    return ClientLoad([built.door()], secret, name, json=2, sse=3, ws=2)


def until_status(built: Cluster, server: str, prefix: str, timeout: float = 15.0) -> float:
    started = time.monotonic()
    wait_for(lambda: built.balancer.status(server).startswith(prefix), timeout, f"{server} {prefix} in haproxy")
    return time.monotonic() - started


class TestSeveralHosts:
    def test_engines_run_on_their_hosts_and_every_gateway_serves_through_the_balancer(
        self, cluster, make_api_key, django_db_blocker
    ):
        built, deployment_id, name = cluster
        replicas = ready_replicas(django_db_blocker, deployment_id)
        hosts = {built.host_of(r.endpoint) for r in replicas}
        assert len(hosts) == WANTED  # one slot a host: the replicas are on two hosts
        assert not any("127.0.0.1" in r.endpoint or "localhost" in r.endpoint for r in replicas)
        assert {r.host for r in replicas} == {built.hosts[h].name for h in hosts}
        for host in hosts:  # each loaded the version's files from the object store, checked
            fetched = [p for p in built.cache_of(host).rglob("weights.bin")]
            assert len(fetched) == 1, list(built.cache_of(host).rglob("*"))
            assert fetched[0].stat().st_size == 256 * 1024

        since = timezone.now()
        key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
        before = built.balancer.sessions()
        with load(built, key.secret, name) as clients:
            wait_for(lambda: sum(o.verdict == OK for o in clients.outcomes) >= 30, 60, "30 answers")
        after = built.balancer.sessions()
        assert_clients_saw_only(clients.outcomes, {OK: set()})
        kinds = {o.kind for o in clients.outcomes}
        assert kinds == {"json", "sse", "ws"}
        assert all(after[h] > before[h] for h in HOSTS), (before, after)  # every gateway took requests
        assert_metered_exactly_once([key.key_id], clients.outcomes, since)
        # Production settings on every host: a console page asked over plain HTTP straight from
        # a gateway is sent to HTTPS; through the balancer (which says the request came over
        # HTTPS) it is served, with HSTS. (The data plane's /v1 is not Django's: no redirect.)
        direct = httpx.get(f"{built.hosts[HOSTS[0]].gateway_url}/accounts/login/")
        assert direct.status_code == 301
        assert direct.headers["location"].startswith("https://")
        served = httpx.get(f"{built.balancer.base_url}/accounts/login/")
        assert served.status_code == 200
        assert "max-age=" in served.headers["strict-transport-security"]

    def test_a_draining_gateway_is_taken_out_before_it_stops_and_no_request_fails(
        self, cluster, make_api_key, django_db_blocker
    ):
        built, _, name = cluster
        since = timezone.now()
        key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
        gateway = built.hosts["h3"].gateway
        assert gateway is not None
        with load(built, key.secret, name) as clients:
            wait_for(lambda: sum(o.verdict == OK for o in clients.outcomes) >= 10, 30, "answers")
            gateway.send_signal(signal.SIGTERM)
            asked = time.monotonic()
            out_after = until_status(built, "h3", "DOWN")
            gateway.wait(30)
            stopped_after = time.monotonic() - asked
            time.sleep(2)
        assert_clients_saw_only(clients.outcomes, {OK: set()})
        assert_metered_exactly_once([key.key_id], clients.outcomes, since)
        report("gateway drained behind haproxy", requests=len(clients.outcomes), out_of_balancer_s=out_after,
               stopped_s=stopped_after)  # fmt: skip
        built.start_gateway("h3")
        until_status(built, "h3", "UP", timeout=30)

    def test_a_killed_gateway_is_taken_out_and_only_its_requests_in_flight_fail(
        self, cluster, make_api_key, django_db_blocker
    ):
        built, _, name = cluster
        since = timezone.now()
        key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
        gateway = built.hosts["h1"].gateway
        assert gateway is not None
        with load(built, key.secret, name) as clients:
            wait_for(lambda: clients.in_progress("sse") >= 2, 30, "streams in flight")
            os.killpg(gateway.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            out_after = until_status(built, "h1", "DOWN")
            time.sleep(3)
        # Its requests in flight are settled by the sweeper once the gateway is judged lost.
        swept_after = wait_for(lambda: not left_in_flight(key.key_id) and time.monotonic() - killed_at, 30,
                               "the dead gateway's requests settled")  # fmt: skip
        persisted(key.key_id, since)
        outcomes = clients.outcomes
        assert_clients_saw_only(outcomes, {OK: set(), LOST: set()})
        lost = [o for o in outcomes if o.verdict == LOST]
        assert all(o.started < killed_at + out_after + 0.5 for o in lost), summary(outcomes)
        assert sum(o.verdict == OK and o.started > killed_at + out_after for o in outcomes) > 5
        unseen = sum(1 for o in lost if o.request_id is None)
        assert_metered_exactly_once([key.key_id], outcomes, since, unseen=unseen)
        report("gateway killed behind haproxy", requests=len(outcomes), lost=len(lost), out_of_balancer_s=out_after,
               settled_s=swept_after)  # fmt: skip
        built.start_gateway("h1")
        until_status(built, "h1", "UP", timeout=30)

    def test_a_gateway_host_cut_off_from_redis_is_taken_out_and_nothing_is_billed_twice(
        self, cluster, make_api_key, django_db_blocker
    ):
        built, _, name = cluster
        since = timezone.now()
        key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
        host = built.hosts["h2"].host
        with load(built, key.secret, name) as clients:
            wait_for(lambda: clients.in_progress("sse") >= 2, 30, "streams in flight")
            host.cut(built.redis.port)
            cut_at = time.monotonic()
            try:
                out_after = until_status(built, "h2", "DOWN")
                time.sleep(3)
            finally:
                host.uncut(built.redis.port)
            back_after = until_status(built, "h2", "UP", timeout=30)
            time.sleep(2)
        outcomes = clients.outcomes
        # Requests that reached h2 before it was taken out may fail (Redis unreachable: the
        # limiter's and the ledger's refusals, or a stream ended by an error event); every
        # other one is answered.
        late = [o for o in outcomes if o.verdict != OK and o.started > cut_at + out_after + 0.5]
        assert not late, summary(late)
        assert_clients_saw_only(outcomes, {OK: set(), REFUSED: {503, 500}, ERROR_EVENT: set(), LOST: set()})
        unseen = sum(1 for o in outcomes if o.verdict == LOST and o.request_id is None)
        assert_metered_exactly_once([key.key_id], outcomes, since, unseen=unseen)
        report("gateway host cut off from Redis", requests=len(outcomes), failed=sum(o.verdict != OK for o in outcomes),
               out_of_balancer_s=out_after, back_in_s=back_after)  # fmt: skip

    def test_a_killed_hosts_replica_is_replaced_by_a_standby_on_another_host_and_it_rejoins_without_doubling(
        self, cluster, make_api_key, django_db_blocker
    ):
        from registry.models import AuditEntry, Deployment
        from registry.warm_pool import deployment_standby_set

        built, deployment_id, name = cluster
        key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
        replicas = ready_replicas(django_db_blocker, deployment_id)
        doomed = built.host_of(replicas[0].endpoint)
        doomed_ids = {r.pk for r in replicas if built.host_of(r.endpoint) == doomed}
        free = next(h for h in HOSTS if h not in {built.host_of(r.endpoint) for r in replicas})

        def set_standby(count: int) -> None:
            deployment = Deployment.objects.get(pk=deployment_id)
            deployment_standby_set(actor=None, deployment=deployment, standby=count)

        # A warm pool of one: the supervisor of the host with the free slot starts the standby.
        committed(django_db_blocker, lambda: set_standby(1))
        standby = wait_for(
            lambda: next((r for r in ready_replicas(django_db_blocker, deployment_id) if r.standby), None),
            30, "a ready standby",
        )  # fmt: skip
        assert built.host_of(standby.endpoint) == free
        since = timezone.now()
        with load(built, key.secret, name) as clients:
            wait_for(lambda: clients.in_progress("sse") >= 2, 30, "streams in flight")
            killed = built.kill_host(doomed)
            killed_at = time.monotonic()
            assert killed >= 3  # its supervisor, its engine, its gateway
            out_after = until_status(built, doomed, "DOWN")
            lost_after = wait_for(
                lambda: committed(django_db_blocker, lambda: AuditEntry.objects.filter(
                    action="host.lost", target=built.hosts[doomed].name).exists()) and time.monotonic() - killed_at,
                30, "the host judged lost",
            )  # fmt: skip
            # No cold start: the standby on another host is promoted into the lost replica's place.
            replaced_after = wait_for(
                lambda: (
                    len(serving := [r for r in ready_replicas(django_db_blocker, deployment_id) if not r.standby])
                    == WANTED
                    and standby.pk in {r.pk for r in serving}
                    and time.monotonic() - killed_at
                ),
                30, "the standby promoted",
            )  # fmt: skip
            for replica in ready_replicas(django_db_blocker, deployment_id):
                slow_stream(replica.endpoint)
            time.sleep(2)
        wait_for(lambda: not left_in_flight(key.key_id), 30, "the dead gateway's requests settled")
        persisted(key.key_id, since)
        promoted = committed(
            django_db_blocker, lambda: AuditEntry.objects.get(action="replica.promote", target=str(standby.pk))
        )
        assert promoted.actor_name == "engine supervisor"
        hosts_now = {built.host_of(r.endpoint) for r in ready_replicas(django_db_blocker, deployment_id)}
        assert doomed not in hosts_now
        assert not doomed_ids & {r.pk for r in live_replicas(django_db_blocker, deployment_id)}
        outcomes = clients.outcomes
        # What was in flight on the dead host's gateway or engine may fail; nothing after.
        # Other gateways stop routing to its engine once its heartbeat is stale (REPLICA_STALE_AFTER, 4 s).
        late = [o for o in outcomes if o.verdict != OK and o.started > killed_at + max(out_after, 4.0) + 0.5]
        assert not late, summary(late)
        assert_clients_saw_only(outcomes, {OK: set(), LOST: set(), ERROR_EVENT: set(), REFUSED: {502, 503}})
        unseen = sum(1 for o in outcomes if o.verdict == LOST and o.request_id is None)
        assert_metered_exactly_once([key.key_id], outcomes, since, unseen=unseen)

        # The host comes back (its supervisor and gateway start again): its free slot refills
        # the warm pool; the deployment keeps the two serving replicas it wants, none doubled.
        built.start_supervisor(doomed)
        built.start_gateway(doomed)
        until_status(built, doomed, "UP", timeout=30)
        refill = wait_for(
            lambda: next((r for r in ready_replicas(django_db_blocker, deployment_id) if r.standby), None),
            30, "the pool refilled",
        )  # fmt: skip
        assert built.host_of(refill.endpoint) == doomed
        time.sleep(4)  # more than a lease: a doubling would have shown by now
        live = live_replicas(django_db_blocker, deployment_id)
        assert sorted(r.standby for r in live) == [False] * WANTED + [True], [(r.pk, r.host, r.state) for r in live]
        assert all(r.state == "ready" for r in live)
        committed(django_db_blocker, lambda: set_standby(0))
        wait_for(lambda: len(live_replicas(django_db_blocker, deployment_id)) == WANTED, 30, "the standby drained")
        report("host killed", requests=len(outcomes), failed=sum(o.verdict != OK for o in outcomes),
               out_of_balancer_s=out_after, judged_lost_s=lost_after, promoted_s=replaced_after)  # fmt: skip
