"""Half-open circuits through a gateway: after its rest a broken replica gets one probe request."""

from __future__ import annotations

import time

import pytest

from tests.support.gateway import chat

pytestmark = pytest.mark.django_db


def test_one_probe_after_the_rest_then_closed_or_resting_twice_as_long(spawn_gateway, api_key, fake_model):
    gateway = spawn_gateway(
        REPLICA_STALE_AFTER="86400", ROUTING_REFRESH_SECONDS="0.2", CIRCUIT_FAILURE_THRESHOLD="3",
        CIRCUIT_OPEN_SECONDS="2",
    )  # fmt: skip
    fake_model.control(mode="reset")
    assert [chat(gateway, api_key, fake_model.name).status_code for _ in range(4)] == [502, 502, 502, 503]
    assert fake_model.requests() == 3

    time.sleep(2.1)  # rested: half-open
    assert chat(gateway, api_key, fake_model.name).status_code == 502  # the probe, which fails…
    assert chat(gateway, api_key, fake_model.name).status_code == 503  # …so it rests again, for 4 s
    time.sleep(2.1)
    assert chat(gateway, api_key, fake_model.name).status_code == 503  # longer than the first rest
    assert fake_model.requests() == 4

    fake_model.control(mode="normal")
    deadline = time.monotonic() + 10
    while (status := chat(gateway, api_key, fake_model.name).status_code) == 503:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert status == 200  # the next probe succeeds: closed
    assert fake_model.requests() == 5  # no request reached it before that probe
    assert [chat(gateway, api_key, fake_model.name).status_code for _ in range(3)] == [200] * 3
