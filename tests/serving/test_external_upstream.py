"""The external engine kind: a replica that is an OpenAI-compatible server the platform does not
run (``serving.gateway.engine_kinds.EXTERNAL``), attached, probed and stopped by a supervisor
with nothing to start or kill, called with its own key and its own name for the model, and
canaried and fallen back to like any replica. Against the fake engine (with an API key, as
vLLM's ``--api-key``) and a real vLLM server (the session's engines, reached as an upstream).
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

from core.events import publish_routing_change_now
from registry.models import Deployment, Replica
from registry.services import deployment_create, deployment_transition, upstream_version_create
from tests.support.gateway import (
    committed,
    persisted,
    register_fake_replica,
    start_fake_engine,
    wait_for,
    wait_for_ready_replicas,
)
from tests.support.processes import stop_process

KEY = "sk-upstream-" + uuid.uuid4().hex
SERVED = "org/upstream-model"
QUESTION = [{"role": "user", "content": "Say hi."}]


@pytest.fixture
def upstream() -> Any:
    """A fake engine that takes only KEY and serves SERVED: an upstream the platform does not run."""
    process, url = start_fake_engine("--api-key", KEY, "--served-model-name", SERVED)
    yield url, process
    stop_process(process, grace=0)


def stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/_stats", timeout=5).json()


def control(url: str, **state: Any) -> None:
    httpx.post(f"{url}/_control", json=state, timeout=5).raise_for_status()


def external_version(name: str, url: str, *, version: str = "v1", api_key: str = KEY, served: str = SERVED) -> Any:
    registered, _ = upstream_version_create(
        actor=None, name=name, version=version, url=url, served_model=served, api_key=api_key,
        config={"max_seq_len": 4096},
    )  # fmt: skip
    return registered


def register_external_replica(name: str, url: str, *, version: str = "v1", weight: int = 100) -> int:
    """A committed external version, running, with the ready replica a supervisor would have
    attached (host ``fake``: no supervisor claims or releases it)."""
    from django.utils import timezone

    registered = external_version(name, url, version=version)
    registered.status = "active"
    registered.save(update_fields=["status"])
    deployment = Deployment.objects.create(version=registered, status="running", traffic_weight=weight)
    replica = Replica.objects.create(
        deployment=deployment, host="fake", endpoint=url, state="ready", last_heartbeat=timezone.now()
    )
    return replica.pk


def chat(gateway: Any, key: Any, model: str, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{gateway.base_url}/v1/chat/completions", timeout=30,
        json={"model": model, "messages": QUESTION, "max_tokens": 5, **body},
        headers={"Authorization": f"Bearer {key.secret}"},
    )  # fmt: skip


@pytest.mark.django_db
class TestSupervisor:
    """In-process supervisors (their rows uncommitted: no other supervisor sees them)."""

    @pytest.fixture
    def make_supervisor(self, settings, tmp_path) -> Any:
        from serving.supervisor.host import Supervisor

        settings.WORKER_HEARTBEAT_SECONDS = 0.2
        settings.WORKER_MAX_BACKOFF = 1
        made: list[Supervisor] = []

        def make(**kwargs: Any) -> Supervisor:
            options = {"host": f"test-host-{uuid.uuid4().hex[:8]}", "log_dir": tmp_path, "report": lambda m: None}
            made.append(Supervisor(**{**options, **kwargs}))
            return made[-1]

        yield make
        for supervisor in made:
            supervisor.close()

    @staticmethod
    def step_until(supervisor: Any, condition: Any, timeout: float = 20.0) -> None:
        def stepped() -> Any:
            supervisor.step()
            return condition()

        wait_for(stepped, timeout, "the supervisor did not get there")

    @staticmethod
    def state(deployment: Deployment) -> set[str]:
        return set(Replica.objects.filter(deployment=deployment).values_list("state", flat=True))

    def test_it_attaches_probes_fails_and_stops_a_replica_with_no_process(self, make_supervisor, upstream):
        url, process = upstream
        deployment = deployment_create(version=external_version("ext-chat", url))
        # No slot at all: an external replica takes none (a vLLM engine could not start here).
        supervisor = make_supervisor(slots=[])
        self.step_until(supervisor, lambda: self.state(deployment) == {"ready"})
        replica = Replica.objects.get(deployment=deployment)
        assert replica.endpoint == url
        assert replica.pid is None
        assert replica.last_heartbeat is not None
        assert supervisor.engines[replica.pk].popen is None
        deployment.refresh_from_db()
        assert deployment.status == "running"
        assert deployment.version.status == "active"
        assert stats(url)["requests"] == 0  # probed through its model list only, never asked to generate

        control(url, health="error")  # its /v1/models answers 503
        self.step_until(supervisor, lambda: self.state(deployment) == {"failed"})
        control(url, health="ok")
        self.step_until(supervisor, lambda: self.state(deployment) == {"ready"})
        assert Replica.objects.filter(deployment=deployment).count() == 1  # the same replica, attached again

        deployment_transition(deployment=deployment, status=Deployment.Status.DRAINING)
        self.step_until(supervisor, lambda: self.state(deployment) == {"stopped"})
        assert process.poll() is None  # stopping it stopped nothing of the upstream's

    @pytest.mark.parametrize(
        "wrong", [{"api_key": "sk-wrong"}, {"served": "another-model"}, {"url": "http://127.0.0.1:9"}]
    )
    def test_a_wrong_key_name_or_url_never_looks_ready(self, make_supervisor, upstream, settings, wrong):
        settings.WORKER_STARTUP_TIMEOUT = 1.0
        url, _ = upstream
        deployment = deployment_create(version=external_version("ext-chat", wrong.pop("url", url), **wrong))
        messages: list[str] = []
        supervisor = make_supervisor(slots=[], report=messages.append)
        self.step_until(supervisor, lambda: self.state(deployment) == {"failed"})
        assert any("not healthy within" in m for m in messages), messages
        assert not Replica.objects.filter(deployment=deployment, last_heartbeat__isnull=False).exists()


class TestGateway:
    @pytest.mark.parametrize("stream", [False, True])
    def test_requests_reach_the_upstream_with_its_key_and_its_name_for_the_model(
        self, fault_gateway, api_key, upstream, django_db_blocker, stream
    ):
        url, _ = upstream
        name = f"ext-{uuid.uuid4().hex[:8]}"
        committed(django_db_blocker, lambda: register_external_replica(name, url))
        client = openai.OpenAI(base_url=f"{fault_gateway.base_url}/v1", api_key=api_key.secret, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model=name, messages=QUESTION, max_tokens=5, stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )  # fmt: skip
        request_id = raw.headers["x-request-id"]
        if stream:
            chunks = list(raw.parse())
            assert {c.model for c in chunks} == {name}  # the public name, never the upstream's
            usage = chunks[-1].usage
        else:
            parsed = raw.parse()
            assert parsed.model == name
            usage = parsed.usage
        assert usage is not None
        assert usage.prompt_tokens > 0
        assert usage.completion_tokens > 0
        # The fake engine answers 401 without KEY: the answer proves the key went; it saw its own name.
        assert stats(url)["models"] == [SERVED]
        record = committed(django_db_blocker, lambda: persisted([request_id]))[request_id]
        assert record.model_version == "v1"
        assert record.completion_tokens == usage.completion_tokens

    @pytest.mark.parametrize("failing", ["local", "external"])
    def test_a_canary_between_a_local_and_an_external_replica_and_the_fallback_either_way(
        self, fault_gateway, api_key, upstream, django_db_blocker, failing
    ):
        """v1 is a platform replica, v2 (the canary, half the traffic) an external upstream. Both
        arms serve their share; when one arm fails, its requests are answered by the other,
        never seen by the customer, and metered as the version that answered."""
        external_url, _ = upstream
        local_process, local_url = start_fake_engine()
        name = f"ext-canary-{uuid.uuid4().hex[:8]}"
        try:

            def register() -> None:
                register_fake_replica(name, local_url, version="v1", weight=50)
                register_external_replica(name, external_url, version="v2", weight=50)
                Deployment.objects.filter(version__model__name=name, version__version="v2").update(is_canary=True)

            committed(django_db_blocker, register)
            split = [chat(fault_gateway, api_key, name, user=f"user-{i}") for i in range(24)]
            assert [r.status_code for r in split] == [200] * 24
            assert stats(local_url)["requests"] > 0
            assert stats(external_url)["requests"] > 0
            assert set(stats(external_url)["models"]) == {SERVED}

            broken, healthy = (local_url, external_url) if failing == "local" else (external_url, local_url)
            answering = "v2" if failing == "local" else "v1"
            control(broken, mode="error500")
            before = {u: stats(u)["requests"] for u in (broken, healthy)}
            answers = [chat(fault_gateway, api_key, name, user=f"user-{i}") for i in range(24)]
            assert [r.status_code for r in answers] == [200] * 24
            tried = stats(broken)["requests"] - before[broken]
            assert tried > 0
            assert stats(healthy)["requests"] - before[healthy] == 24
            ids = [r.headers["x-request-id"] for r in answers]
            records = committed(django_db_blocker, lambda: persisted(ids))
            assert {records[i].model_version for i in ids} == {answering}
        finally:
            stop_process(local_process, grace=0)


def test_a_real_vllm_server_as_an_upstream_attached_by_runworkers_and_fallen_back_to(
    gateway, engines, api_key, django_db_blocker
):
    """The session's vLLM server of the chat model, reached as an external upstream with its
    key: the session's runworkers attaches it (probing vLLM's own /v1/models), the gateway
    serves it under another name, and a failing platform replica of the same model falls back
    to it."""
    chat_model = "smollm2-135m-instruct"
    url, key = engines.endpoint(chat_model, django_db_blocker), engines.key(chat_model)
    name = f"ext-vllm-{uuid.uuid4().hex[:8]}"

    def register() -> int:
        # Weight 0: a request reaches it only by the fallback once the platform replica is there.
        version, _ = upstream_version_create(
            actor=None, name=name, version="ext", url=url, served_model=chat_model, api_key=key,
            config={"max_seq_len": 2048},
        )  # fmt: skip
        return deployment_create(version=version, traffic_weight=0).pk

    deployment_id = committed(django_db_blocker, register)
    local_process, local_url = start_fake_engine()
    try:
        replica_id = wait_for_ready_replicas(django_db_blocker, [deployment_id], timeout=60)[deployment_id]
        replica = committed(django_db_blocker, lambda: Replica.objects.get(pk=replica_id))
        assert replica.endpoint == url
        assert replica.pid is None
        assert replica.host == "test-engines"

        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=api_key.secret, max_retries=0, timeout=120)
        answer = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=8, temperature=0)
        assert answer.model == name
        assert answer.choices[0].message.content
        assert answer.usage is not None
        assert answer.usage.prompt_tokens > 0
        chunks = list(
            client.chat.completions.create(
                model=name, messages=QUESTION, max_tokens=8, stream=True, stream_options={"include_usage": True}
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens > 0

        # A platform replica of the same model takes all the traffic, and fails: the upstream answers.
        control(local_url, mode="error500")
        committed(django_db_blocker, lambda: register_fake_replica(name, local_url, version="local", weight=100))
        publish_routing_change_now("test")
        # Until the gateway has reloaded, requests go to the upstream directly; then through the replica.
        wait_for(lambda: chat(gateway, api_key, name).status_code == 200 and stats(local_url)["requests"] > 0, 20)
        before = stats(local_url)["requests"]
        responses = [chat(gateway, api_key, name, user=f"u{i}") for i in range(3)]
        assert [r.status_code for r in responses] == [200] * 3
        assert all(r.json()["choices"][0]["message"]["content"] for r in responses)
        # Tried first until its circuit opens (CIRCUIT_FAILURE_THRESHOLD failures in a row); then
        # the upstream is the only routable version and answers at once.
        assert 1 <= stats(local_url)["requests"] - before <= 3
        ids = [r.headers["x-request-id"] for r in responses]
        records = committed(django_db_blocker, lambda: persisted(ids))
        assert {records[i].model_version for i in ids} == {"ext"}
    finally:
        stop_process(local_process, grace=0)

        def stop() -> None:
            deployment = Deployment.objects.get(pk=deployment_id)
            deployment_transition(deployment=deployment, status=Deployment.Status.DRAINING)

        committed(django_db_blocker, stop)
