"""LoRA adapters as model versions (registry side): the adapter folder read and refused, its base
checked, registration through the management API, and the bundled adapter trained at import."""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.test import Client

from core.errors import InvalidInput
from registry import artifacts
from registry.adapters import (
    ADAPTER_FRAMEWORK,
    AdapterFacts,
    clean_base,
    is_adapter_framework,
    lora_name,
    read_adapter,
)
from registry.models import Adapter, AuditEntry, Deployment, Model, ModelVersion
from registry.services import adapter_register, model_version_create
from tests.support.registry import make_version

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def peft_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real PEFT LoRA adapter (r=4 on q_proj and v_proj) of a tiny random Llama, as
    ``save_pretrained`` writes it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=128,
    )  # fmt: skip
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    folder = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(folder)
    (folder / "README.md").unlink(missing_ok=True)
    return folder


def copy_of(folder: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for path in folder.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


class TestReadAdapter:
    def test_it_reads_a_folder_peft_made(self, peft_folder):
        assert sorted(p.name for p in peft_folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert read_adapter(peft_folder) == AdapterFacts(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))

    def test_the_framework_is_named_loosely(self):
        assert is_adapter_framework(" LoRA ")
        assert not is_adapter_framework("transformers")

    def refusal(self, folder: Path) -> str:
        with pytest.raises(InvalidInput) as caught:
            read_adapter(folder)
        assert caught.value.field == "artifact_uri"
        return caught.value.message

    def test_a_folder_without_its_config_is_refused(self, peft_folder, tmp_path):
        folder = copy_of(peft_folder, tmp_path / "a")
        (folder / "adapter_config.json").unlink()
        assert "holds adapter_config.json" in self.refusal(folder)

    def test_a_config_that_is_not_json_is_refused(self, peft_folder, tmp_path):
        folder = copy_of(peft_folder, tmp_path / "a")
        (folder / "adapter_config.json").write_text("{not json")
        assert "not valid JSON" in self.refusal(folder)
        (folder / "adapter_config.json").write_text("[1, 2]")
        assert "a JSON object" in self.refusal(folder)

    def test_another_peft_type_is_refused(self, peft_folder, tmp_path):
        folder = copy_of(peft_folder, tmp_path / "a")
        edit_config(folder, peft_type="IA3")
        assert "peft_type is 'IA3'" in self.refusal(folder)

    @pytest.mark.parametrize("rank", [0, 17, "8", 8.0, True, None])
    def test_a_rank_outside_1_to_the_maximum_is_refused(self, peft_folder, tmp_path, rank):
        folder = copy_of(peft_folder, tmp_path / "a")
        edit_config(folder, r=rank)
        assert "from 1 to 16 (LORA_MAX_RANK)" in self.refusal(folder)

    def test_the_maximum_rank_follows_the_setting(self, peft_folder, tmp_path, settings):
        folder = copy_of(peft_folder, tmp_path / "a")
        edit_config(folder, r=32)
        settings.LORA_MAX_RANK = 32
        assert read_adapter(folder).rank == 32
        settings.LORA_MAX_RANK = 16
        assert "from 1 to 16" in self.refusal(folder)

    def test_a_folder_without_weights_is_refused(self, peft_folder, tmp_path):
        folder = copy_of(peft_folder, tmp_path / "a")
        (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
        assert read_adapter(folder).rank == 4  # the older format is accepted
        (folder / "adapter_model.bin").unlink()
        assert "no weights" in self.refusal(folder)

    def test_a_config_over_64_kib_is_refused(self, peft_folder, tmp_path):
        folder = copy_of(peft_folder, tmp_path / "a")
        edit_config(folder, padding="x" * 64 * 1024)
        assert "over 64 KiB" in self.refusal(folder)


class TestMaxRankSetting:
    def test_only_the_ranks_vllm_accepts_load(self, monkeypatch):
        import importlib

        from console.settings import supervisor

        monkeypatch.setenv("LORA_MAX_RANK", "24")
        with pytest.raises(ImproperlyConfigured, match="LORA_MAX_RANK must be one of vLLM's"):
            importlib.reload(supervisor)
        monkeypatch.setenv("LORA_MAX_RANK", "64")
        assert importlib.reload(supervisor).LORA_MAX_RANK == 64
        monkeypatch.delenv("LORA_MAX_RANK")
        assert importlib.reload(supervisor).LORA_MAX_RANK == 16


def base_of(name: str, task: str = "chat", framework: str = "transformers") -> ModelVersion:
    version = make_version(Model.objects.create(name=name, task=task), "1")
    ModelVersion.objects.filter(pk=version.pk).update(framework=framework)
    version.refresh_from_db()
    return version


class TestCleanBase:
    def test_a_chat_or_completion_llm_is_accepted(self):
        for task in ("chat", "completion"):
            base = base_of(f"llm-{task}", task=task)
            assert clean_base(base) is base

    @pytest.mark.parametrize(
        ("task", "framework", "words"),
        [
            ("chat", "lora", "itself an adapter"),
            ("chat", "openai-upstream", "external upstream"),
            ("classification", "onnx", "small model"),
            ("embedding", "sentence-transformers", "embedding model"),
            ("classification", "transformers", "classification model"),
        ],
    )
    def test_what_cannot_carry_an_adapter_is_refused(self, task, framework, words):
        with pytest.raises(InvalidInput) as caught:
            clean_base(base_of("not-a-base", task=task, framework=framework))
        assert caught.value.field == "base"
        assert words in caught.value.message

    def test_the_engine_knows_an_adapter_by_model_at_version(self):
        assert lora_name(make_version(Model.objects.create(name="pirate", task="chat"), "2")) == "pirate@2"


@pytest.fixture
def stored_adapter(store, peft_folder, tmp_path) -> artifacts.StoredArtifact:
    return store.put_directory(source=peft_folder, key="pirate/1")


def adapter_body(uri: str, **overrides: Any) -> dict[str, Any]:
    body = {
        "name": "pirate", "version": "1", "framework": "lora", "artifact_uri": uri,
        "base": {"model": "llm", "version": "1"}, "config": {"note": "arr"},
    }  # fmt: skip
    return {**body, **overrides}


class TestRegistrationApi:
    @pytest.fixture(autouse=True)
    def base(self, db) -> ModelVersion:
        AuditEntry.objects.all().delete()  # session fixtures commit entries; this test's transaction hides them
        return base_of("llm")

    def test_an_adapter_is_registered_on_its_base(self, ml, stored_adapter, base):
        response = ml.post("/api/v1/models", adapter_body(stored_adapter.uri), format="json")
        assert response.status_code == 201, response.content
        body = response.json()
        assert body["framework"] == ADAPTER_FRAMEWORK
        assert body["adapter"] == {"base": {"model": "llm", "version": "1"}, "rank": 4, "lora_name": "pirate@1"}
        assert body["config"] == {
            "note": "arr", "lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "base": "llm:1",
        }  # fmt: skip
        assert (body["artifact_sha256"], body["artifact_size"]) == (stored_adapter.sha256, stored_adapter.size)
        adapter = Adapter.objects.get(version__model__name="pirate")
        assert (adapter.base, adapter.rank) == (base, 4)
        assert list(base.adapters.all()) == [adapter]
        assert Model.objects.get(name="pirate").task == "chat"  # the base's
        entry = AuditEntry.objects.get(action="model_version.register")
        assert entry.after["base"] == "llm:1"
        assert ml.get("/api/v1/models/pirate").json()["versions"][0]["adapter"]["rank"] == 4
        llm = ml.get("/api/v1/models/llm").json()["versions"][0]
        assert llm["adapter"] is None

    def test_registering_it_again_is_idempotent_and_other_values_conflict(self, ml, stored_adapter, base):
        assert ml.post("/api/v1/models", adapter_body(stored_adapter.uri), format="json").status_code == 201
        again = ml.post("/api/v1/models", adapter_body(stored_adapter.uri), format="json")
        assert again.status_code == 200
        assert AuditEntry.objects.filter(action="model_version.register").count() == 1
        base_of("other-llm")
        other_base = {"model": "other-llm", "version": "1"}
        moved = ml.post("/api/v1/models", adapter_body(stored_adapter.uri, base=other_base), format="json")
        assert moved.status_code == 409
        assert "base" in moved.json()["detail"]
        configured = ml.post("/api/v1/models", adapter_body(stored_adapter.uri, config={}), format="json")
        assert configured.status_code == 409
        assert "config" in configured.json()["detail"]
        assert Adapter.objects.get(version__model__name="pirate").base == base

    def refused(self, ml, body: dict[str, Any], field: str) -> str:
        response = ml.post("/api/v1/models", body, format="json")
        assert response.status_code == 400, response.content
        errors = response.json()
        assert field in errors, errors
        assert not ModelVersion.objects.filter(model__name="pirate").exists()
        return " ".join(errors[field])

    def test_a_lora_version_without_a_base_is_a_400(self, ml, stored_adapter):
        body = adapter_body(stored_adapter.uri)
        del body["base"]
        assert "names its base" in self.refused(ml, body, "base")

    def test_a_base_for_another_framework_is_a_400(self, ml, stored_adapter):
        body = adapter_body(stored_adapter.uri, framework="transformers")
        assert "Only a lora (adapter) version has a base" in self.refused(ml, body, "base")

    def test_a_base_not_registered_is_a_400(self, ml, stored_adapter):
        body = adapter_body(stored_adapter.uri, base={"model": "llm", "version": "9"})
        assert "no registered version llm:9" in self.refused(ml, body, "base")

    def test_a_base_that_cannot_carry_adapters_is_a_400(self, ml, stored_adapter):
        base_of("minilm", task="embedding", framework="sentence-transformers")
        body = adapter_body(stored_adapter.uri, base={"model": "minilm", "version": "1"})
        assert "adapters are for chat or completion" in self.refused(ml, body, "base")

    def test_an_adapter_on_an_adapter_is_a_400(self, ml, stored_adapter, store, peft_folder):
        assert ml.post("/api/v1/models", adapter_body(stored_adapter.uri), format="json").status_code == 201
        second = store.put_directory(source=peft_folder, key="pirate2/1")
        body = adapter_body(second.uri, name="pirate2", base={"model": "pirate", "version": "1"})
        response = ml.post("/api/v1/models", body, format="json")
        assert response.status_code == 400
        assert "itself an adapter" in " ".join(response.json()["base"])

    def test_a_folder_that_is_not_an_adapter_is_a_400(self, ml, store, peft_folder, tmp_path):
        folder = copy_of(peft_folder, tmp_path / "bad")
        edit_config(folder, r=64)
        stored = store.put_directory(source=folder, key="pirate/1")
        assert "from 1 to 16" in self.refused(ml, adapter_body(stored.uri), "artifact_uri")

    def test_a_missing_artifact_is_a_400(self, ml, store):
        assert "no artifact" in self.refused(ml, adapter_body("local://nowhere/1"), "artifact_uri")

    def test_a_task_other_than_the_bases_is_a_400(self, ml, stored_adapter):
        body = adapter_body(stored_adapter.uri, task="completion")
        assert "its base llm:1 is chat" in self.refused(ml, body, "task")
        assert not Model.objects.filter(name="pirate").exists()

    def test_gpu_requirements_are_refused_for_an_adapter(self, ml, stored_adapter):
        body = adapter_body(stored_adapter.uri, gpu_requirements={"count": 1})
        assert "base's replicas" in self.refused(ml, body, "gpu_requirements")

    def test_lora_is_refused_without_a_base_by_the_plain_registration(self, store, stored_adapter):
        with pytest.raises(InvalidInput) as caught:
            model_version_create(
                actor=None, name="pirate", version="1", framework="lora", artifact_uri=stored_adapter.uri, config={}
            )
        assert caught.value.field == "framework"


@pytest.fixture
def admin_browser(db) -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser(username="registrar", password="pw-123456789"))
    return client


class TestConsole:
    def test_the_form_offers_eligible_bases_and_registers_an_adapter(self, admin_browser, stored_adapter):
        base = base_of("llm")
        base_of("minilm", task="embedding", framework="sentence-transformers")
        page = admin_browser.get("/console/models/register/").content.decode()
        assert "Base version (adapters only)" in page
        assert f'<option value="{base.pk}">llm:1</option>' in page
        assert "minilm:1" not in page
        form = {"name": "pirate", "version": "1", "framework": "lora", "artifact_uri": stored_adapter.uri,
                "task": "", "config": "{}", "base": str(base.pk)}  # fmt: skip
        response = admin_browser.post("/console/models/register/", form)
        assert response.status_code == 302, response.content.decode()
        adapter_page = admin_browser.get(response["Location"]).content.decode()
        assert "LoRA adapter (rank 4) on" in adapter_page
        assert 'href="/console/models/llm/1/"' in adapter_page
        base_page = admin_browser.get("/console/models/llm/1/").content.decode()
        assert 'data-adapter="pirate:1"' in base_page

    def test_a_base_without_lora_is_refused_by_the_form(self, admin_browser, stored_adapter):
        base = base_of("llm")
        form = {"name": "pirate", "version": "1", "framework": "transformers", "artifact_uri": stored_adapter.uri,
                "task": "", "config": "{}", "base": str(base.pk)}  # fmt: skip
        response = admin_browser.post("/console/models/register/", form)
        assert response.status_code == 200
        assert "Only a lora (adapter) version has a base" in response.content.decode()
        assert not ModelVersion.objects.filter(model__name="pirate").exists()


class TestBundledAdapter:
    def test_the_session_import_registered_it_on_the_bundled_chat_model(self, bundled_models):
        from registry.bundled import PIRATE, SMOLLM2

        version = ModelVersion.objects.select_related("adapter__base__model").get(model__name=PIRATE)
        assert version.framework == ADAPTER_FRAMEWORK
        assert version.model.task == "chat"
        base = ModelVersion.objects.get(model__name=SMOLLM2)
        assert (version.adapter.base, version.adapter.rank) == (base, 8)
        assert version.version == base.version
        assert version.config["base"] == f"{SMOLLM2}:{base.version}"
        assert version.config["target_modules"] == ["q_proj", "v_proj"]
        assert version.config["train_loss"] < 1.0
        assert artifacts.get_artifact_store().verify(version.artifact_uri, version.artifact_sha256)

    def test_its_stored_weights_load(self, bundled_models):
        from safetensors.torch import load_file

        from registry.bundled import PIRATE

        version = ModelVersion.objects.get(model__name=PIRATE)
        folder = artifacts.get_artifact_store().local_path(version.artifact_uri)
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        weights = load_file(folder / "adapter_model.safetensors")
        lora_a = [name for name in weights if "q_proj.lora_A" in name]
        assert len(lora_a) == 30  # every layer of SmolLM2 135M
        assert tuple(weights[lora_a[0]].shape) == (8, 576)
        assert any(float(tensor.abs().sum()) > 0 for name, tensor in weights.items() if "lora_B" in name)

    def test_registering_it_again_through_the_service_keeps_one_adapter_row(self, bundled_models):
        from registry.bundled import PIRATE

        version = ModelVersion.objects.get(model__name=PIRATE)
        again = adapter_register(
            model=version.model, version=version.version, artifact_uri=version.artifact_uri,
            artifact_sha256=version.artifact_sha256, artifact_size=version.artifact_size,
            base=version.adapter.base, config={"train_loss": version.config["train_loss"]},
        )  # fmt: skip
        assert again.pk == version.pk
        assert Adapter.objects.filter(version=version).count() == 1

    def test_bootstrap_deploys_the_bundled_models_but_not_the_adapter(self, bundled_models):
        from console.management.commands.bootstrap import Command
        from registry.bundled import PIRATE, SMOLLM2

        Deployment.objects.filter(version__model__name__in=[SMOLLM2, PIRATE]).delete()
        out = StringIO()
        Command(stdout=out)._ensure_default_deployments()
        assert Deployment.objects.filter(version__model__name=SMOLLM2).exists()
        assert not Deployment.objects.filter(version__model__name=PIRATE).exists()
        assert PIRATE not in out.getvalue()
