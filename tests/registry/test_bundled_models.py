"""The bundled models: imported once per session into a real artifact store, then checked."""

from __future__ import annotations

import json

import pytest

from registry.artifacts import directory_digest, get_artifact_store
from registry.bundled import BUNDLED_MODELS, MINILM, SMOLLM2, import_bundled_models
from registry.models import ModelVersion

pytestmark = pytest.mark.django_db


class TestImport:
    def test_both_models_are_registered_with_checksums(self, bundled_models):
        store = get_artifact_store()
        for name in (SMOLLM2, MINILM):
            version = ModelVersion.objects.get(model__name=name)
            # Registered by the import; engine tests may have loaded it since.
            assert version.status in {"registered", "loading", "active"}
            sha256, size = directory_digest(store.local_path(version.artifact_uri))
            assert (version.artifact_sha256, version.artifact_size) == (sha256, size)
            assert size > 50_000_000

    def test_it_records_the_model_config(self, bundled_models):
        llm = ModelVersion.objects.get(model__name=SMOLLM2)
        assert llm.model.task == "chat"
        assert llm.config["vocab_size"] == 49152
        assert llm.config["max_seq_len"] == 8192
        embed = ModelVersion.objects.get(model__name=MINILM)
        assert embed.model.task == "embedding"
        assert embed.config["embedding_dim"] == 384
        digits = ModelVersion.objects.get(model__name="digits-mlp")
        assert (digits.model.task, digits.framework) == ("classification", "onnx")
        assert digits.config["signature"]["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}]
        assert digits.config["heldout_accuracy"] > 0.9

    def test_the_sentiment_model_is_judged_on_a_source_it_was_not_trained_on(self, bundled_models):
        sentiment = ModelVersion.objects.get(model__name="sentiment-minilm")
        config = sentiment.config
        assert config["signature"]["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
        assert config["tokenizer"]["file"] == "tokenizer.json"
        assert config["heldout_source"] not in config["trained_on"]
        # Another authorship pass, other domains and style: far above chance (50 %), per class too.
        assert config["heldout_rows"] >= 200
        assert config["heldout_accuracy"] >= 0.7
        for label in ("negative", "positive"):
            low, high = config["heldout_per_label"][label]["interval95"]
            assert 0.55 <= low <= config["heldout_per_label"][label]["accuracy"] <= high

    def test_a_second_import_changes_nothing(self, bundled_models):
        before = {v.pk: (v.artifact_sha256, v.artifact_uri) for v in ModelVersion.objects.all()}
        messages: list[str] = []
        import_bundled_models(progress=messages.append)
        after = {v.pk: (v.artifact_sha256, v.artifact_uri) for v in ModelVersion.objects.all()}
        assert after == before
        assert sum("up to date" in m for m in messages) == len(BUNDLED_MODELS) == 6
        assert not any("building" in m for m in messages)

    def test_a_corrupted_artifact_is_rebuilt(self, bundled_models):
        store = get_artifact_store()
        version = ModelVersion.objects.get(model__name=MINILM)
        path = store.local_path(version.artifact_uri) / "config.json"
        config = json.loads(path.read_text())
        path.write_text(json.dumps({**config, "tampered": True}))
        assert not store.verify(version.artifact_uri, version.artifact_sha256)

        messages: list[str] = []
        import_bundled_models(progress=messages.append)
        version.refresh_from_db()
        assert store.verify(version.artifact_uri, version.artifact_sha256)
        assert any(m.startswith(f"{MINILM}") and "building" in m for m in messages)
        assert ModelVersion.objects.filter(model__name=MINILM).count() == 1

    def test_the_chat_model_has_its_template_and_no_gguf_config(self, bundled_models):
        path = get_artifact_store().local_path(ModelVersion.objects.get(model__name=SMOLLM2).artifact_uri)
        config = json.loads((path / "config.json").read_text())
        assert "quantization_config" not in config
        assert config["dtype"] == "bfloat16"
        assert (path / "model.safetensors").exists()
        assert "im_start" in (path / "chat_template.jinja").read_text()


class TestConvertedModelWorks:
    def test_the_converted_weights_reproduce_the_gguf(self, bundled_models):
        """The bf16 artifact predicts what the GGUF itself predicts, within bf16 rounding.

        Both are evaluated in float32 on this machine, so the check holds on any CPU (a
        fixed greedy answer would not: for this prompt the two best first tokens are
        0.08 logprob apart, and bf16 kernels differ between CPUs).
        """
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from registry.bundled import BUNDLED_MODELS

        path = get_artifact_store().local_path(ModelVersion.objects.get(model__name=SMOLLM2).artifact_uri)
        gguf = next(m for m in BUNDLED_MODELS if m.name == SMOLLM2).source()
        tokenizer = AutoTokenizer.from_pretrained(path)
        converted = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        for question in ("What is the capital of France?", "Name three colours.", "What is the capital of Japan?"):
            inputs = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt",
                return_dict=True,
            )  # fmt: skip
            with torch.no_grad():
                ours = torch.log_softmax(converted(**inputs).logits[0, -1], -1)
                theirs = torch.log_softmax(reference(**inputs).logits[0, -1], -1)
            likely = torch.topk(theirs, 50).indices  # the tokens that matter; bf16 rounding moves them ~0.04
            assert (ours[likely] - theirs[likely]).abs().max() < 0.1, question
            best, second = torch.topk(theirs, 2).values
            if best - second > 0.2:  # a clear favourite stays the favourite
                assert ours.argmax() == theirs.argmax(), question

    def test_embedding_model_gives_unit_vectors(self, bundled_models):
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = get_artifact_store().local_path(ModelVersion.objects.get(model__name=MINILM).artifact_uri)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path)
        batch = tokenizer(
            ["a cat sat on the mat", "a kitten sat on a rug", "stock markets fell"], padding=True, return_tensors="pt"
        )
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1)
        vectors = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        assert vectors.shape == (3, 384)
        similar, unrelated = float(vectors[0] @ vectors[1]), float(vectors[0] @ vectors[2])
        assert similar > unrelated + 0.3
