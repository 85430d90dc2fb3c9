"""LoRA adapters on the serving side: the engine's command line, what a deployment of one is, and a
real gateway routing an adapter's requests to its base's engine under the adapter's name, each
request metered to the model it was sent to (fake engines; tests/serving/test_adapters_real.py
runs vLLM itself)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
from django.utils import timezone

from core.errors import InvalidInput
from registry.models import Deployment, Model, ModelVersion
from serving.gateway.engine_kinds import _vllm_command
from tests.support.gateway import committed
from tests.support.processes import start_process, stop_process

FLAGS = ("--enable-lora", "--max-loras", "--max-lora-rank")


def deployment_of(task: str, max_adapters: int) -> Deployment:
    version = ModelVersion(model=Model(name="m", task=task), version="1", framework="transformers", config={})
    return Deployment(version=version, max_adapters=max_adapters)


class TestEngineCommand:
    def test_a_deployment_that_takes_adapters_starts_its_engines_with_lora(self, settings):
        settings.LORA_MAX_RANK = 32
        command = _vllm_command(deployment_of("chat", 3), 8000, Path("/m"))
        at = command.index("--enable-lora")
        assert command[at : at + 5] == ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32"]

    def test_one_that_takes_none_starts_without(self):
        command = _vllm_command(deployment_of("chat", 0), 8000, Path("/m"))
        assert not set(FLAGS) & set(command)


@pytest.mark.django_db
class TestDeployments:
    def version(self, task: str = "chat", framework: str = "transformers") -> ModelVersion:
        model = Model.objects.create(name=f"m-{uuid.uuid4().hex[:6]}", task=task)
        return ModelVersion.objects.create(
            model=model, version="1", framework=framework, artifact_uri="local://x", artifact_sha256="0" * 64,
            artifact_size=1, config={},
        )  # fmt: skip

    def test_an_adapters_deployment_has_no_replicas_of_its_own(self):
        from registry.models import Adapter
        from registry.services import deployment_create

        adapter = self.version(framework="lora")
        Adapter.objects.create(version=adapter, base=self.version(), rank=8)
        deployment = deployment_create(version=adapter, replicas=3, min_replicas=1, max_replicas=4)
        assert (deployment.replicas, deployment.min_replicas, deployment.max_replicas) == (0, 0, 0)
        for field, asked in (("max_adapters", {"max_adapters": 2}), ("standby", {"standby": 1})):
            with pytest.raises(InvalidInput) as refused:
                deployment_create(version=adapter, **asked)
            assert refused.value.field == field

    @pytest.mark.parametrize(
        ("task", "framework"),
        [("embedding", "sentence-transformers"), ("chat", "openai-upstream"), ("classification", "onnx")],
    )
    def test_only_a_generative_model_on_our_engines_takes_adapters(self, task, framework):
        from registry.services import deployment_create

        with pytest.raises(InvalidInput) as refused:
            deployment_create(version=self.version(task, framework), max_adapters=2)
        assert refused.value.field == "max_adapters"

    def test_an_adapters_deployment_is_never_autoscaled(self):
        from registry.models import Adapter
        from registry.services import deployment_create
        from rollout.autoscaler import deployment_autoscale_set

        adapter = self.version(framework="lora")
        Adapter.objects.create(version=adapter, base=self.version(), rank=8)
        deployment = deployment_create(version=adapter)
        with pytest.raises(InvalidInput) as refused:
            deployment_autoscale_set(actor=None, deployment=deployment, autoscale={"enabled": True})
        assert refused.value.field == "enabled"
        deployment_autoscale_set(actor=None, deployment=deployment, autoscale={"enabled": False})  # off: allowed

    def test_max_adapters_is_bounded(self):
        from registry.services import MAX_ADAPTERS_PER_BATCH, deployment_create

        version = self.version()
        assert deployment_create(version=version, max_adapters=MAX_ADAPTERS_PER_BATCH).max_adapters == 64
        with pytest.raises(InvalidInput):
            deployment_create(version=version, max_adapters=MAX_ADAPTERS_PER_BATCH + 1)


@pytest.fixture
def lora_engine(django_db_setup, django_db_blocker, tmp_path):
    """A fake engine with LoRA on, serving base model B on a ready replica (its pid recorded), and
    an adapter A on B loaded into it: A's running deployment, its LoadedAdapter row."""
    import sys

    from registry.adapters import lora_name
    from registry.models import Adapter, LoadedAdapter, Replica
    from tests.support.processes import free_port

    port, tag = free_port(), uuid.uuid4().hex[:6]
    process = start_process(
        [sys.executable, "-m", "tests.support.fake_engine", "--port", str(port), "--enable-lora",
         "--served-model-name", f"base-{tag}"],
        stdout=None,
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(f"{endpoint}/health", timeout=1).raise_for_status()
            break
        except httpx.HTTPError:
            import time

            time.sleep(0.1)
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')

    def register() -> dict[str, object]:
        base_model = Model.objects.create(name=f"base-{tag}", task="chat")
        base = ModelVersion.objects.create(
            model=base_model, version="1", framework="fake", artifact_uri="local://fake/base", artifact_sha256="0" * 64,
            artifact_size=0, config={"max_seq_len": 1024}, status="active",
        )  # fmt: skip
        deployment = Deployment.objects.create(version=base, status="running", max_adapters=2)
        replica = Replica.objects.create(
            deployment=deployment, host="fake", endpoint=endpoint, state="ready", last_heartbeat=timezone.now(),
            pid=process.pid,
        )  # fmt: skip
        adapter_model = Model.objects.create(name=f"pirate-{tag}", task="chat")
        adapter = ModelVersion.objects.create(
            model=adapter_model, version="1", framework="lora", artifact_uri="local://fake/adapter",
            artifact_sha256="0" * 64, artifact_size=0, config={}, status="active",
        )  # fmt: skip
        Adapter.objects.create(version=adapter, base=base, rank=8)
        Deployment.objects.create(version=adapter, status="running", replicas=0, min_replicas=0, max_replicas=0)
        LoadedAdapter.objects.create(replica=replica, version=adapter, pid=process.pid)
        return {"base": base_model.name, "adapter": adapter_model.name, "lora": lora_name(adapter)}

    names = committed(django_db_blocker, register)
    headers = {"Authorization": "Bearer anything"}
    httpx.post(
        f"{endpoint}/v1/load_lora_adapter", json={"lora_name": names["lora"], "lora_path": str(folder)}, headers=headers
    ).raise_for_status()
    yield {**names, "endpoint": endpoint, "pid": process.pid}
    stop_process(process, grace=0)


def test_a_gateway_sends_an_adapters_requests_to_its_base_under_the_adapters_name(
    lora_engine, api_key, spawn_gateway, django_db_blocker
):
    from billing.models import UsageRecord
    from billing.usage import persist_usage_stream

    gateway = spawn_gateway(REPLICA_STALE_AFTER="86400")
    headers = {"Authorization": f"Bearer {api_key.secret}"}
    answers, request_ids = {}, {}
    for name in (lora_engine["adapter"], lora_engine["base"]):
        for stream in (False, True):
            response = httpx.post(
                f"{gateway.base_url}/v1/chat/completions", timeout=30, headers=headers,
                json={"model": name, "messages": [{"role": "user", "content": "hi"}], "stream": stream},
            )  # fmt: skip
            assert response.status_code == 200, response.text
            if not stream:
                body = response.json()
                assert body["model"] == name  # the public name, never the engine's name for it
                answers[name] = body["choices"][0]["message"]["content"]
                request_ids[name] = response.headers["x-request-id"]
            else:
                events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
                assert events
                assert {event["model"] for event in events} == {name}  # never the engine's name for it
    assert lora_engine["lora"] in answers[lora_engine["adapter"]]  # the engine answered as the adapter
    assert "tok" in answers[lora_engine["base"]]
    stats = httpx.get(f"{lora_engine['endpoint']}/_stats", timeout=5).json()
    assert stats["models"] == [lora_engine["lora"]] * 2 + [lora_engine["base"]] * 2
    listed = httpx.get(f"{gateway.base_url}/v1/models", headers=headers, timeout=10).json()["data"]
    assert {lora_engine["adapter"], lora_engine["base"]} <= {m["id"] for m in listed}

    def records() -> dict[str, str]:
        persist_usage_stream()
        found = UsageRecord.objects.filter(request_id__in=list(request_ids.values()))
        return {str(r.request_id): r.model for r in found}

    metered = committed(django_db_blocker, records)
    assert metered == {request_ids[name]: name for name in request_ids}  # each request metered to its own model


def test_an_adapter_whose_engine_restarted_is_not_routed(lora_engine, api_key, spawn_gateway, django_db_blocker):
    """Its row names the engine process it was loaded into: another pid on the replica (a restart)
    leaves the adapter with nowhere to go (503), while the base is served."""
    from registry.models import Replica

    committed(django_db_blocker, lambda: Replica.objects.filter(endpoint=lora_engine["endpoint"]).update(pid=1))
    gateway = spawn_gateway(REPLICA_STALE_AFTER="86400")
    headers = {"Authorization": f"Bearer {api_key.secret}"}
    outcome = {}
    for name in (lora_engine["adapter"], lora_engine["base"]):
        outcome[name] = httpx.post(
            f"{gateway.base_url}/v1/chat/completions", timeout=30, headers=headers,
            json={"model": name, "messages": [{"role": "user", "content": "hi"}]},
        ).status_code  # fmt: skip
    assert outcome == {lora_engine["adapter"]: 503, lora_engine["base"]: 200}


def test_an_adapter_version_shares_its_models_traffic_with_the_base_version(
    lora_engine, api_key, spawn_gateway, django_db_blocker, tmp_path
):
    """An adapter registered as another version of its base's own model (to canary it against
    the base): the split sends some users to each, both answered by the one engine."""
    from registry.adapters import lora_name
    from registry.models import Adapter, LoadedAdapter, Replica

    def second_version() -> str:
        base = ModelVersion.objects.get(model__name=lora_engine["base"], version="1")
        Deployment.objects.filter(version=base).update(traffic_weight=50)
        tuned = ModelVersion.objects.create(
            model=base.model, version="2-tuned", framework="lora", artifact_uri="local://fake/tuned",
            artifact_sha256="0" * 64, artifact_size=0, config={}, status="active",
        )  # fmt: skip
        Adapter.objects.create(version=tuned, base=base, rank=8)
        Deployment.objects.create(version=tuned, status="running", traffic_weight=50, replicas=0, min_replicas=0,
                                  max_replicas=0)  # fmt: skip
        replica = Replica.objects.get(deployment__version=base)
        assert replica.pid is not None
        LoadedAdapter.objects.create(replica=replica, version=tuned, pid=replica.pid)
        return lora_name(tuned)

    tuned = committed(django_db_blocker, second_version)
    folder = tmp_path / "tuned"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    httpx.post(
        f"{lora_engine['endpoint']}/v1/load_lora_adapter", json={"lora_name": tuned, "lora_path": str(folder)}
    ).raise_for_status()
    gateway = spawn_gateway(REPLICA_STALE_AFTER="86400")
    answered_as = set()
    for user in range(24):
        response = httpx.post(
            f"{gateway.base_url}/v1/chat/completions", timeout=30,
            headers={"Authorization": f"Bearer {api_key.secret}"},
            json={"model": lora_engine["base"], "messages": [{"role": "user", "content": "hi"}], "user": f"u{user}"},
        )  # fmt: skip
        assert response.status_code == 200, response.text
        answered_as.add("adapter" if tuned in response.json()["choices"][0]["message"]["content"] else "base")
    assert answered_as == {"adapter", "base"}
