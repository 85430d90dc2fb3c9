"""Faults of the engine: errors, crashes, timeouts, dropped connections and unreadable events,
replicas that refuse, fail, slow down or are killed mid-answer, dead or stale replicas; the
gateway's answer to each (status, error body, error event or frames), its retries, fallbacks
and circuits, and what is metered. Fake engines (tests/support/fake_engine.py) throughout."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import pytest
from django.utils import timezone
from websockets.sync.client import connect

from tests.support.chaos import (
    ERROR_EVENT,
    GATEWAY_ENV,
    OK,
    REFUSED,
    ClientLoad,
    assert_clients_saw_only,
    assert_metered_exactly_once,
    control,
    engine_stats,
    fake_engines,
    ready_replicas,
    report,
    start_metering,
    summary,
    supervised_model,
)
from tests.support.gateway import (
    HELLO,
    QUESTION,
    chat,
    committed,
    persisted,
    price_model,
    register_fake_replica,
    start_fake_engine,
    wait_for,
)
from tests.support.processes import free_port

pytestmark = pytest.mark.django_db


ask = functools.partial(chat, messages=QUESTION)  # the question most tests here send


def sse_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]


class TestEngineFaults:
    def test_no_first_token_in_time_is_a_504(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="hang")
        started = time.monotonic()
        response = chat(fault_gateway, api_key, fake_model.name, stream=True)
        assert 1.4 < time.monotonic() - started < 10
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "engine_timeout"
        request_id = response.headers["x-request-id"]
        record = persisted([request_id])[request_id]
        assert (record.status_code, record.completion_tokens) == (504, 0)

    def test_an_engine_refusal_keeps_its_message_and_status(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="error400")
        response = chat(fault_gateway, api_key, fake_model.name)
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "fake engine refuses"
        request_id = response.headers["x-request-id"]
        assert persisted([request_id])[request_id].status_code == 400

    def test_an_engine_crash_is_a_502(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="error500")
        response = chat(fault_gateway, api_key, fake_model.name, stream=True)
        assert response.status_code == 502
        assert response.json()["error"]["type"] == "server_error"

    def test_a_stream_cut_mid_way_ends_with_an_error_event(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="die", tokens=10, die_after=4)
        response = chat(fault_gateway, api_key, fake_model.name, stream=True)
        assert response.status_code == 200
        events = sse_events(response)
        assert "[DONE]" not in events
        assert '"error"' in events[-1]
        assert '"engine_error"' in events[-1]
        assert len(events) == 5
        request_id = response.headers["x-request-id"]
        record = persisted([request_id])[request_id]
        assert (record.status_code, record.completion_tokens) == (502, 4)

    def test_the_whole_request_time_limit(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="normal", tokens=20, delay=0.5)
        response = chat(fault_gateway, api_key, fake_model.name, stream=True)
        events = sse_events(response)
        assert '"engine_timeout"' in events[-1]
        request_id = response.headers["x-request-id"]
        record = persisted([request_id])[request_id]
        assert record.status_code == 504
        assert 5 <= record.completion_tokens < 20

    def test_usage_is_hidden_unless_asked_for(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="normal", tokens=3, delay=0)
        events = sse_events(chat(fault_gateway, api_key, fake_model.name, stream=True))
        assert events[-1] == "[DONE]"
        assert all('"usage"' not in e for e in events[:-1])
        with_usage = sse_events(
            chat(fault_gateway, api_key, fake_model.name, stream=True, stream_options={"include_usage": True})
        )
        assert '"usage":{"prompt_tokens":3,"completion_tokens":3' in with_usage[-2]
        assert all('"usage":null' in e for e in with_usage[:-2])


class TestRouting:
    def test_a_refused_connection_is_retried_on_another_replica(
        self, fault_gateway, api_key, fake_model, django_db_blocker
    ):
        from django.utils import timezone

        from registry.models import Deployment, Replica

        def add_dead_replica() -> None:
            deployment = Deployment.objects.get(replica_set__id=fake_model.replica_id)
            # Port 9 (discard) refuses connections on loopback.
            Replica.objects.create(
                deployment=deployment, host="fake", endpoint="http://127.0.0.1:9", state="ready",
                last_heartbeat=timezone.now(),
            )  # fmt: skip

        committed(django_db_blocker, add_dead_replica)
        time.sleep(0.5)
        for _ in range(6):
            assert chat(fault_gateway, api_key, fake_model.name).status_code == 200
        assert fake_model.requests() == 6

    def test_a_model_without_a_live_replica_is_a_503(self, fault_gateway, api_key, django_db_blocker):
        name = "fake-dead"
        committed(django_db_blocker, lambda: register_fake_replica(name, "http://127.0.0.1:9"))
        time.sleep(0.5)
        statuses = [chat(fault_gateway, api_key, name).status_code for _ in range(5)]
        # Connection refused everywhere: 503, and after 3 failures the circuit opens, still 503.
        assert statuses == [503] * 5

    def test_a_stale_heartbeat_is_never_routed_to(self, gateway_with_default_staleness, api_key, django_db_blocker):
        process, endpoint = start_fake_engine()
        try:
            from datetime import timedelta

            from django.utils import timezone

            from registry.models import Replica

            name = "fake-stale"

            def register() -> None:
                replica_id = register_fake_replica(name, endpoint)
                Replica.objects.filter(pk=replica_id).update(last_heartbeat=timezone.now() - timedelta(minutes=5))

            committed(django_db_blocker, register)
            time.sleep(0.5)
            response = chat(gateway_with_default_staleness, api_key, name)
            assert response.status_code == 503
            assert httpx.get(f"{endpoint}/_stats").json()["requests"] == 0
        finally:
            process.kill()


@pytest.fixture(scope="module")
def gateway_with_default_staleness(django_db_setup, tmp_path_factory):
    from tests.support.processes import start_gateway

    gw = start_gateway(tmp_path_factory.mktemp("stale-gateway"), ROUTING_REFRESH_SECONDS="0.2")
    yield gw
    gw.stop()


class TestEngineTransportErrors:
    @pytest.mark.parametrize("stream", [False, True])
    def test_a_connection_dropped_by_the_engine_is_a_502_and_a_circuit_failure(
        self, fault_gateway, api_key, fake_model, stream
    ):
        fake_model.control(mode="reset")
        statuses = [chat(fault_gateway, api_key, fake_model.name, stream=stream).status_code for _ in range(4)]
        # Three failures open the circuit: the fourth request is not sent to that replica.
        assert statuses == [502, 502, 502, 503]
        assert fake_model.requests() == 3
        response = chat(fault_gateway, api_key, fake_model.name, stream=stream)
        assert response.json()["error"]["code"] == "engine_unavailable"

    def test_an_unreadable_event_mid_stream_ends_the_stream_with_an_error(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="bad_event", tokens=6, die_after=2)
        response = chat(fault_gateway, api_key, fake_model.name, stream=True)
        assert response.status_code == 200
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert "[DONE]" not in events
        assert '"error"' in events[-1]
        request_id = response.headers["x-request-id"]
        record = persisted([request_id])[request_id]
        assert record.status_code >= 500
        assert record.completion_tokens == 2


class TestWebSocketFailures:
    def _run(self, gateway, key, body):
        url = gateway.base_url.replace("http://", "ws://") + "/ws/v1/chat/completions"
        with connect(url, additional_headers={"Authorization": f"Bearer {key.secret}"}) as socket_:
            socket_.send(json.dumps({"type": "chat.completion", "id": "a", "body": body}))
            frames = []
            deadline = time.monotonic() + 30
            while not any(f["type"] == "usage" for f in frames):
                frames.append(json.loads(socket_.recv(timeout=max(0.1, deadline - time.monotonic()))))
        return frames

    def test_an_engine_error_before_the_first_token_is_an_error_then_usage(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="error500")
        frames = self._run(fault_gateway, api_key, {"model": fake_model.name, "messages": HELLO})
        assert [f["type"] for f in frames] == ["error", "usage"]
        assert frames[0]["error"]["code"] == "engine_error"
        assert (frames[1]["status"], frames[1]["status_code"]) == ("error", 502)

    def test_a_dropped_engine_connection_is_reported_not_completed(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="reset")
        frames = self._run(fault_gateway, api_key, {"model": fake_model.name, "messages": HELLO})
        assert frames[-1]["status"] == "error"
        assert frames[-1]["status_code"] == 502
        record = persisted([frames[-1]["request_id"]])[frames[-1]["request_id"]]
        assert record.status_code == 502

    def test_an_unreadable_event_after_admission_is_not_completed(self, fault_gateway, api_key, fake_model):
        fake_model.control(mode="bad_event", tokens=6, die_after=2)
        frames = self._run(fault_gateway, api_key, {"model": fake_model.name, "messages": HELLO})
        assert [f["type"] for f in frames][-2:] == ["error", "usage"]
        assert frames[-1]["status"] == "error"
        assert frames[-1]["status_code"] >= 500


class TestARequestNoEngineRanCostsNothing:
    """Defect 6: an engine's refusal, or no replica to take it, is not billed its prompt."""

    def test_an_engine_refusal_costs_nothing_and_says_why(self, gateway, api_key, counted_model):
        served = ask(gateway, api_key, counted_model.name)
        assert served.status_code == 200
        counted_model.control(mode="error400")
        refused = ask(gateway, api_key, counted_model.name)
        assert refused.status_code == 400
        ids = [served.headers["x-request-id"], refused.headers["x-request-id"]]
        records = persisted(ids)
        ok, bad = records[ids[0]], records[ids[1]]
        assert ok.prompt_tokens > 0  # a request that ran is billed
        assert ok.cost > 0
        assert ok.error_code == ""
        assert (bad.status_code, bad.prompt_tokens, bad.completion_tokens, bad.cost) == (400, 0, 0, Decimal(0))
        assert bad.error_code == "invalid_request"

    def test_a_request_every_replica_refused_costs_nothing(self, spawn_gateway, api_key, bundled_models,
                                                           django_db_blocker):  # fmt: skip
        name = f"unreachable-{uuid.uuid4().hex[:8]}"
        artifact = bundled_models["versions"]["smollm2-135m-instruct"].artifact_uri

        def register() -> None:
            register_fake_replica(name, f"http://127.0.0.1:{free_port()}", artifact_uri=artifact)  # nothing listens
            price_model(name, input_per_million="1000", output_per_million="2000")

        committed(django_db_blocker, register)
        gateway = spawn_gateway(REPLICA_STALE_AFTER="86400")
        response = ask(gateway, api_key, name)
        assert response.status_code == 503
        request_id = response.headers["x-request-id"]
        record = persisted([request_id])[request_id]
        assert (record.status_code, record.prompt_tokens, record.cost) == (503, 0, Decimal(0))
        assert record.error_code == "engine_unavailable"


@dataclass
class TwoReplicas:
    name: str
    endpoints: list[str]

    def control(self, index: int, **state: Any) -> None:
        httpx.post(f"{self.endpoints[index]}/_control", json=state, timeout=5).raise_for_status()

    def requests(self, index: int) -> int:
        return int(httpx.get(f"{self.endpoints[index]}/_stats", timeout=5).json()["requests"])


@pytest.fixture
def two_replicas(django_db_blocker) -> Iterator[TwoReplicas]:
    """One version served by two fake replicas."""
    engines = [start_fake_engine(), start_fake_engine()]
    name = f"pair-{uuid.uuid4().hex[:8]}"

    def register() -> None:
        from django.utils import timezone

        from registry.models import Replica

        first = Replica.objects.get(pk=register_fake_replica(name, engines[0][1]))
        Replica.objects.create(deployment=first.deployment, host="fake", endpoint=engines[1][1], state="ready",
                               last_heartbeat=timezone.now())  # fmt: skip

    committed(django_db_blocker, register)
    yield TwoReplicas(name, [endpoint for _, endpoint in engines])
    for process, _ in engines:
        process.kill()
        process.wait(5)


def failed_attempts(request_ids: list[str]) -> dict[str, Any]:
    from billing.models import FailedAttempt
    from billing.usage import persist_failed_attempts

    persist_failed_attempts()
    return {str(a.request_id): a for a in FailedAttempt.objects.filter(request_id__in=request_ids)}


class TestFallback:
    """A request whose engine fails before the first byte reaches the client is answered by
    another replica (or the base version), metered once, and the failure still counted."""

    @pytest.mark.parametrize("stream", [False, True])
    def test_a_replica_that_fails_is_replaced_by_another(self, gateway, api_key, two_replicas, stream,
                                                         django_db_blocker):  # fmt: skip
        two_replicas.control(0, mode="error500")
        two_replicas.control(1, mode="error500")
        ids: list[str] = []
        for _ in range(6):
            # Whichever replica a request tries first, the other is healthy for this one.
            response = None
            for broken in (0, 1):
                two_replicas.control(broken, mode="error500" if not stream else "hang")
                two_replicas.control(1 - broken, mode="normal")
                response = ask(gateway, api_key, two_replicas.name, stream=stream)
                assert response.status_code == 200, response.text
                ids.append(response.headers["x-request-id"])
        records = committed(django_db_blocker, lambda: persisted(ids))
        assert sorted(records) == sorted(ids)  # metered once each
        assert {r.status_code for r in records.values()} == {200}
        attempts = committed(django_db_blocker, lambda: failed_attempts(ids))
        assert attempts  # the ones that went to the broken replica first
        assert {a.status_code for a in attempts.values()} <= {502, 504}
        assert all(a.model_version == "1" for a in attempts.values())

    def test_a_pinned_request_never_changes_version(self, gateway, api_key, django_db_blocker):
        engines = [start_fake_engine(), start_fake_engine()]
        name = f"pinned-{uuid.uuid4().hex[:8]}"
        try:

            def register() -> None:
                register_fake_replica(name, engines[0][1], version="v1")
                register_fake_replica(name, engines[1][1], version="v2", weight=0)

            committed(django_db_blocker, register)
            httpx.post(f"{engines[1][1]}/_control", json={"mode": "error500"}, timeout=5).raise_for_status()
            pinned = httpx.post(
                f"{gateway.base_url}/v1/chat/completions", timeout=30,
                json={"model": name, "messages": QUESTION},
                headers={"Authorization": f"Bearer {api_key.secret}", "X-Model-Version": "v2"},
            )  # fmt: skip
            assert pinned.status_code == 502
            assert httpx.get(f"{engines[0][1]}/_stats", timeout=5).json()["requests"] == 0
            # Unpinned, a request of v2's callers would have been answered by v1; the pinned one was not.
            request_id = pinned.headers["x-request-id"]
            assert committed(django_db_blocker, lambda: persisted([request_id]))[request_id].model_version == "v2"
        finally:
            for process, _ in engines:
                process.kill()
                process.wait(5)


class TestASlowReplica:
    def test_json_requests_that_time_out_open_its_circuit(self, spawn_gateway, api_key, two_replicas):
        """A JSON request that hits the whole request's limit judges its replica (504 and a
        failure on its circuit), so a slow replica stops being chosen; it was 'nothing learnt'."""
        # The same question every time: prefix-aware routing would keep it on the replica that
        # answered first, and the slow one would never be tried.
        gateway = spawn_gateway(REPLICA_STALE_AFTER="86400", ENGINE_REQUEST_TIMEOUT="1.5", CIRCUIT_OPEN_SECONDS="60",
                                ROUTING_PREFIX_AWARE="false")  # fmt: skip
        two_replicas.control(0, mode="normal", latency=30)
        statuses: list[int] = []
        # Requests go to either replica (the fewest in flight, ties drawn at random) until the
        # slow one has failed CIRCUIT_FAILURE_THRESHOLD (3) times; then its circuit rests.
        while statuses.count(504) < 3:
            statuses.append(ask(gateway, api_key, two_replicas.name).status_code)
            assert len(statuses) < 60, statuses
        assert set(statuses) <= {200, 504}
        after = [ask(gateway, api_key, two_replicas.name).status_code for _ in range(10)]
        assert after == [200] * 10, (statuses, after)


def test_an_engine_replica_killed_mid_answer(
    own_redis, metering, make_api_key, spawn_gateway, django_db_blocker, tmp_path
):
    """SSE: a clean error event; WebSocket: error and usage frames; JSON: retried on the
    other replica; the supervisor restarts the replica and traffic resumes on it."""
    from billing.models import FailedAttempt

    since = timezone.now()
    with supervised_model(django_db_blocker, tmp_path, own_redis.url, replicas=2) as (name, deployment_id, _):
        replicas = wait_for(lambda: (r := ready_replicas(django_db_blocker, deployment_id)) and len(r) == 2 and r,
                            60, "two ready replicas")  # fmt: skip
        for replica in replicas:  # streams of 3 s; a JSON answer after 1 s
            control(replica.endpoint, tokens=30, delay=0.1, latency=1.0)
        gateway = spawn_gateway(TEST_REDIS_URL=own_redis.url, **GATEWAY_ENV)
        metering.append(start_metering(tmp_path, TEST_REDIS_URL=own_redis.url))
        key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
        with ClientLoad([gateway], key.secret, name, json=2, sse=3, ws=3) as load:
            # Kill a replica while it is in the middle of answering each kind of client.
            wanted = {"stream:sse", "stream:ws", "json:json"}

            def answering_all_kinds() -> Any:
                return next((r for r in replicas if wanted <= set(engine_stats(r.endpoint).get("active", {}))), None)

            try:
                victim = wait_for(answering_all_kinds, 30, "a replica answering SSE, WebSocket and JSON at once")
            except AssertionError as exc:
                active = [engine_stats(r.endpoint).get("active") for r in replicas]
                raise AssertionError(f"{exc}: {active}, {summary(load.outcomes)}") from None
            os.killpg(victim.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            restarted = wait_for(
                lambda: next((r for r in ready_replicas(django_db_blocker, deployment_id)
                              if r.pk == victim.pk and r.pid != victim.pid), None),
                30, "the replica restarted by the supervisor",
            )  # fmt: skip
            restarted_after = time.monotonic() - killed_at
            # Traffic resumes on it once the gateway's circuit for it closes again.
            wait_for(lambda: engine_stats(restarted.endpoint).get("requests", 0) > 0, 40,
                     "a request served by the restarted replica")  # fmt: skip
            resumed_after = time.monotonic() - killed_at
            time.sleep(1)
        outcomes = load.outcomes

    assert_clients_saw_only(outcomes, {OK: set(), ERROR_EVENT: set()})
    cut = [o for o in outcomes if o.verdict == ERROR_EVENT]
    assert {o.kind for o in cut} == {"sse", "ws"}, summary(outcomes)  # a JSON request never sees the crash
    assert all(o.code == "engine_error" for o in cut), cut
    metering_ = assert_metered_exactly_once([key.key_id], outcomes, since)
    json_ids = {o.request_id for o in outcomes if o.kind == "json"}
    retried = wait_for(lambda: FailedAttempt.objects.filter(request_id__in=json_ids).count(), 10,
                       "a failed attempt of a JSON request (retried on the other replica)")  # fmt: skip
    report(
        "engine replica killed", requests=len(outcomes), answered=sum(o.verdict == OK for o in outcomes),
        streams_cut=len(cut), json_retried=retried, lost_records=0, records=len(metering_.records),
        replica_restarted_s=restarted_after, traffic_back_on_it_s=resumed_after,
    )  # fmt: skip


# --- A slow engine ------------------------------------------------------------------------------------------


def test_a_slow_engine(own_redis, metering, make_api_key, spawn_gateway, django_db_blocker, tmp_path):
    """One of two replicas stops answering in time: a JSON request on it gets a 504 within the
    request limit, a stream falls back to the other replica after the first-token limit,
    the slow replica's circuit opens and the other serves everything.

    Only the streams' first-token timeouts count on the circuit (a JSON request that reaches
    the whole request's limit does not), so streams are most of this load."""
    since = timezone.now()
    name, (slow, _), engines = fake_engines(django_db_blocker, 2, tokens=5, delay=0.02)
    first_token, whole = 1.0, 3.0
    # An open circuit rests 30 s here (10 s by default): no half-open probe falls inside the test.
    gateway = spawn_gateway(
        TEST_REDIS_URL=own_redis.url, REPLICA_STALE_AFTER="86400", ENGINE_FIRST_TOKEN_TIMEOUT=str(first_token),
        ENGINE_REQUEST_TIMEOUT=str(whole), CIRCUIT_OPEN_SECONDS="30", **GATEWAY_ENV,
    )  # fmt: skip
    metering.append(start_metering(tmp_path, TEST_REDIS_URL=own_redis.url))
    key = make_api_key(rate_limit_rpm=100_000, rate_limit_tpm=100_000_000, max_concurrent=64)
    try:
        with ClientLoad([gateway], key.secret, name, json=2, sse=3, ws=0) as load:
            load.wait_for(OK, after=0, count=10)
            control(slow, latency=60)  # answers in a minute: far beyond either limit
            slowed_at = time.monotonic()

            def circuit_open() -> float | None:
                """When the slow replica stopped getting requests: none for longer than a JSON
                request can be held there (so not merely because it is the busiest)."""
                before = engine_stats(slow)["requests"]
                time.sleep(whole + 1)
                return time.monotonic() - whole - 1 if engine_stats(slow)["requests"] == before else None

            opened_at = wait_for(circuit_open, 40, "the slow replica's circuit open")
            time.sleep(2)
        outcomes = load.outcomes
    finally:
        for process in engines:
            process.kill()

    assert_clients_saw_only(outcomes, {OK: set(), REFUSED: {504}})
    # JSON requests that went to the slow replica before its circuit opened (a matter of
    # routing: none at all is possible): 504 within the request's limit.
    timed_out = [o for o in outcomes if o.verdict == REFUSED]
    assert {o.kind for o in timed_out} <= {"json"}, summary(outcomes)
    assert all(o.code == "engine_timeout" and o.seconds < whole + 1.5 for o in timed_out), timed_out
    # Streams that went to the slow replica fell back to the other after the first-token limit.
    assert all(o.seconds < first_token + 1.5 for o in outcomes if o.kind == "sse"), summary(outcomes)
    after_open = [o for o in outcomes if o.started > opened_at]
    assert after_open, summary(outcomes)
    assert all(o.verdict == OK for o in after_open), summary(after_open)
    metering_ = assert_metered_exactly_once([key.key_id], outcomes, since)
    report(
        "slow engine", requests=len(outcomes), answered=sum(o.verdict == OK for o in outcomes),
        timed_out_504=len(timed_out), records=len(metering_.records), circuit_open_after_s=opened_at - slowed_at,
        slowest_stream_s=max(o.seconds for o in outcomes if o.kind == "sse"),
    )  # fmt: skip


def test_a_stream_whose_engine_sends_nothing_is_a_504_at_the_first_token_limit(fault_gateway, api_key, fake_model):
    """An engine that accepts the request and never even sends its headers: the stream's wait
    is bounded by the first-token limit (1.5 s on this gateway), not the request's (6 s)."""
    fake_model.control(latency=30)
    started = time.monotonic()
    response = httpx.post(
        f"{fault_gateway.base_url}/v1/chat/completions", timeout=30,
        json={"model": fake_model.name, "messages": [{"role": "user", "content": "hello"}], "stream": True},
        headers={"Authorization": f"Bearer {api_key.secret}"},
    )  # fmt: skip
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "engine_timeout"
    assert time.monotonic() - started < 1.5 + 1
