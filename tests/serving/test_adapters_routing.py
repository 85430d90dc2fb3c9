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


def registered(task: str = "chat", framework: str = "transformers", name: str = "") -> ModelVersion:
    model = Model.objects.create(name=name or f"m-{uuid.uuid4().hex[:6]}", task=task)
    return ModelVersion.objects.create(
        model=model, version="1", framework=framework, artifact_uri="local://x", artifact_sha256="0" * 64,
        artifact_size=1, config={},
    )  # fmt: skip


@pytest.mark.django_db
class TestDeployments:
    def version(self, task: str = "chat", framework: str = "transformers") -> ModelVersion:
        return registered(task, framework)

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


@pytest.mark.django_db
class TestAdaptersPerBatchAfterDeploy:
    """``deployment_adapters_set`` and the roll it starts (``replica_roll_request``); the
    supervisor carrying it out: tests/serving/test_supervisor.py::TestAdaptersRoll."""

    def base(self, *, max_adapters: int = 2, replicas: int = 1, task: str = "chat") -> Deployment:
        from registry.services import deployment_create

        return deployment_create(
            version=registered(task), replicas=replicas, max_replicas=replicas, max_adapters=max_adapters
        )

    def adapter_on(self, base: Deployment, name: str) -> Deployment:
        from registry.models import Adapter
        from registry.services import deployment_create

        version = registered(framework="lora", name=name)
        Adapter.objects.create(version=version, base=base.version, rank=8)
        return deployment_create(version=version)

    def test_it_sets_the_value_audited_before_and_after(self):
        from registry.models import AuditEntry
        from registry.services import deployment_adapters_set
        from rollout.selectors import version_timeline

        base = self.base(max_adapters=2)
        deployment_adapters_set(actor=None, deployment=base, max_adapters=8)
        base.refresh_from_db()
        assert base.max_adapters == 8
        entry = AuditEntry.objects.get(action="deployment.adapters", target=str(base.pk))
        assert (entry.before, entry.after) == ({"max_adapters": 2}, {"max_adapters": 8})
        labels = [event.label for event in version_timeline(version=base.version)]
        assert f"deployment #{base.pk} runs 8 LoRA adapters per batch (was 2)" in labels
        deployment_adapters_set(actor=None, deployment=base, max_adapters=8)  # the same again: nothing recorded
        assert AuditEntry.objects.filter(action="deployment.adapters", target=str(base.pk)).count() == 1

    @pytest.mark.parametrize("value", [65, -1, True, "4"])
    def test_a_value_out_of_range_is_refused(self, value):
        from registry.services import deployment_adapters_set

        with pytest.raises(InvalidInput) as refused:
            deployment_adapters_set(actor=None, deployment=self.base(), max_adapters=value)
        assert refused.value.field == "max_adapters"

    def test_a_deployment_that_cannot_carry_adapters_or_is_an_adapter_is_refused(self):
        from registry.services import deployment_adapters_set

        with pytest.raises(InvalidInput, match="Only a chat or completion model"):
            deployment_adapters_set(actor=None, deployment=self.base(task="embedding", max_adapters=0), max_adapters=2)
        adapter = self.adapter_on(self.base(), "lora-a")
        with pytest.raises(InvalidInput, match="set this on the base's deployment"):
            deployment_adapters_set(actor=None, deployment=adapter, max_adapters=2)

    @pytest.mark.parametrize("status", ["draining", "stopped"])
    def test_a_deployment_that_is_stopping_or_stopped_is_refused(self, status):
        from registry.models import AuditEntry
        from registry.services import deployment_adapters_set

        base = self.base(max_adapters=2)
        Deployment.objects.filter(pk=base.pk).update(status=status)
        with pytest.raises(InvalidInput, match=f"is {status}") as refused:
            deployment_adapters_set(actor=None, deployment=base, max_adapters=4)
        assert refused.value.field == "max_adapters"
        assert Deployment.objects.get(pk=base.pk).max_adapters == 2
        assert not AuditEntry.objects.filter(action="deployment.adapters", target=str(base.pk)).exists()

    def test_lora_off_is_refused_while_deployed_adapters_would_have_no_engine(self):
        from registry.services import deployment_adapters_set, deployment_create

        base = self.base(max_adapters=2)
        self.adapter_on(base, "lora-one")
        self.adapter_on(base, "lora-two")
        with pytest.raises(InvalidInput) as refused:
            deployment_adapters_set(actor=None, deployment=base, max_adapters=0)
        assert refused.value.field == "max_adapters"
        assert "2 LoRA adapters are deployed" in refused.value.message
        assert "lora-one@1, lora-two@1" in refused.value.message
        assert Deployment.objects.get(pk=base.pk).max_adapters == 2
        # Another serving deployment of the version takes adapters: they run there.
        deployment_create(version=base.version, max_adapters=1)
        deployment_adapters_set(actor=None, deployment=base, max_adapters=0)
        assert Deployment.objects.get(pk=base.pk).max_adapters == 0

    def test_fewer_slots_than_deployed_adapters_is_allowed(self):
        # vLLM keeps max_loras adapters in memory and loads an evicted one again from its files
        # when a request names it: as when more adapters are deployed than a base has slots.
        from registry.services import deployment_adapters_set

        base = self.base(max_adapters=4)
        for name in ("lora-x", "lora-y", "lora-z"):
            self.adapter_on(base, name)
        deployment_adapters_set(actor=None, deployment=base, max_adapters=1)
        assert Deployment.objects.get(pk=base.pk).max_adapters == 1

    def test_the_roll_asks_one_stale_replica_at_a_time(self):
        from registry.models import AuditEntry, Replica
        from registry.services import deployment_adapters_set, replica_roll_request

        base = self.base(max_adapters=2, replicas=2)
        Deployment.objects.filter(pk=base.pk).update(status="running")
        first, second = (Replica.objects.create(deployment=base, host="h", state="ready", pid=pid) for pid in (1, 2))
        running = {first.pk: 2, second.pk: 2}
        assert replica_roll_request(deployment_id=base.pk, running=running) is None  # nothing changed
        deployment_adapters_set(actor=None, deployment=base, max_adapters=4)
        assert replica_roll_request(deployment_id=base.pk, running=running) == first.pk
        assert Replica.objects.get(pk=first.pk).restart_requested_at is not None
        entry = AuditEntry.objects.get(action="replica.restart", target=str(first.pk))
        assert entry.actor_name == "engine supervisor"
        assert (entry.before["max_adapters"], entry.after["max_adapters"]) == (2, 4)
        assert replica_roll_request(deployment_id=base.pk, running=running) is None  # the first restarts
        Replica.objects.filter(pk=first.pk).update(state="starting", restart_requested_at=None)
        assert replica_roll_request(deployment_id=base.pk, running={second.pk: 2}) is None  # still starting
        Replica.objects.filter(pk=first.pk).update(state="ready")
        assert replica_roll_request(deployment_id=base.pk, running={first.pk: 4, second.pk: 2}) == second.pk


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
