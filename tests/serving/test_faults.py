"""Fault injection with the fake engine: timeouts, engine errors, retries, dead replicas."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.gateway import chat, committed, persisted, register_fake_replica, start_fake_engine

pytestmark = pytest.mark.django_db


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
