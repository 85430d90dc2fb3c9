"""LoRA adapters on the real engine: the bundled pirate adapter (trained at install with peft) and
a second one made from it, both deployed onto the session's SmolLM2 engine while it runs, and
answered by that one engine process beside its base: three different answers to one question,
each request metered to the model it named."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.support.gateway import committed, wait_for

pytestmark = pytest.mark.engine

BASE = "smollm2-135m-instruct"
PIRATE = "smollm2-135m-pirate"
QUESTION = [{"role": "user", "content": "What should I pack for a day at the beach?"}]


def mirrored_adapter(source: Path, target: Path) -> None:
    """Another adapter from ``source``: the same low-rank factors with every B negated, so it
    moves the base the other way."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    weights = load_file(target / "adapter_model.safetensors")
    save_file({k: (-v if "lora_B" in k else v) for k, v in weights.items()}, target / "adapter_model.safetensors")


@pytest.fixture
def two_adapters(engines, bundled_models, django_db_blocker, tmp_path):
    """The bundled pirate adapter and its mirror, each with a deployment; afterwards both
    deployments are stopped and their adapters unloaded, so the engine is as it was."""
    from registry.artifacts import get_artifact_store
    from registry.models import Deployment, LoadedAdapter, ModelVersion
    from registry.services import adapter_register, deployment_create, deployment_transition, model_get_or_create

    versions = bundled_models["versions"]
    base, pirate = versions[BASE], versions[PIRATE]
    mirror_name = f"smollm2-mirror-{uuid.uuid4().hex[:6]}"
    store = get_artifact_store()
    mirrored_adapter(store.local_path(pirate.artifact_uri), tmp_path / "mirror")
    stored = store.put_directory(source=tmp_path / "mirror", key=f"{mirror_name}/1")

    def deploy() -> list[int]:
        model = model_get_or_create(name=mirror_name, task="chat", description="test", owner="tests")
        mirror = adapter_register(
            model=model, version="1", artifact_uri=stored.uri, artifact_sha256=stored.sha256,
            artifact_size=stored.size, base=ModelVersion.objects.get(pk=base.pk), config={},
        )  # fmt: skip
        made = [deployment_create(version=v) for v in (ModelVersion.objects.get(pk=pirate.pk), mirror)]
        return [d.pk for d in made]

    deployment_ids = committed(django_db_blocker, deploy)
    yield {"base": BASE, "pirate": PIRATE, "mirror": mirror_name, "deployments": deployment_ids}

    def stop() -> None:
        for deployment in Deployment.objects.filter(pk__in=deployment_ids):
            deployment_transition(deployment=deployment, status="draining")

    committed(django_db_blocker, stop)

    def unloaded() -> bool:
        return not LoadedAdapter.objects.filter(version__deployments__pk__in=deployment_ids).exists()

    wait_for(lambda: committed(django_db_blocker, unloaded), 60, "both adapters unloaded")


def test_one_engine_serves_its_base_and_two_adapters_each_metered_to_itself(
    two_adapters, engines, gateway, api_key, django_db_blocker
):
    from billing.models import UsageRecord
    from billing.usage import persist_usage_stream
    from registry.models import LoadedAdapter, Replica

    names = (two_adapters["base"], two_adapters["pirate"], two_adapters["mirror"])
    headers = {"Authorization": f"Bearer {api_key.secret}"}

    def loaded() -> list[tuple[int, int, int]]:
        rows = LoadedAdapter.objects.filter(version__deployments__pk__in=two_adapters["deployments"])
        return list(rows.values_list("version_id", "replica_id", "pid").distinct())

    rows = wait_for(lambda: len(found := committed(django_db_blocker, loaded)) == 2 and found, 120, "both loaded")
    assert len({(replica_id, pid) for _, replica_id, pid in rows}) == 1, rows  # into one engine process
    replica_id, pid = rows[0][1:]
    replica = committed(
        django_db_blocker, lambda: Replica.objects.select_related("deployment__version__model").get(pk=replica_id)
    )
    assert (replica.deployment.version.model.name, replica.pid) == (BASE, pid)  # the base's own engine, unrestarted

    answers, request_ids = {}, {}
    for name in names:
        for _ in range(60):  # the gateway reloads its routing when told; a moment at most
            response = httpx.post(
                f"{gateway.base_url}/v1/chat/completions", timeout=120, headers=headers,
                json={"model": name, "messages": QUESTION, "max_tokens": 16, "temperature": 0},
            )  # fmt: skip
            if response.status_code != 503:
                break
            time.sleep(0.5)
        assert response.status_code == 200, response.text
        answers[name] = response.json()["choices"][0]["message"]["content"]
        request_ids[name] = response.headers["x-request-id"]
    assert len(set(answers.values())) == 3, answers  # three models, three answers

    def metered() -> dict[str, str]:
        persist_usage_stream()
        return {str(r.request_id): r.model for r in UsageRecord.objects.filter(request_id__in=request_ids.values())}

    assert committed(django_db_blocker, metered) == {request_ids[n]: n for n in names}
