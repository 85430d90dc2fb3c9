"""The paraphrase tier's local models (serving/semcache/paraphrase.py, verifier_build.py): the
in-process embedder gives the replica's vectors, the cross-encoder scores a paraphrase above a
one-word trap, the build is skipped when current and redone when a file is corrupt, and
without an artifact the tier is off. The examples are written here, not taken from the data.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
from django.test import override_settings

from serving.semcache import paraphrase, verifier_build

# A build small enough for a test: a few pairs, one epoch, no calibration.
TINY = verifier_build.Recipe(max_pairs_per_source=24, epochs=1, calibrate=False)


@pytest.fixture
def models(cache_verifier: Path) -> paraphrase.LocalModels:
    """The built artifact (tests/support/fixtures.py: built once per session if not current)."""
    loaded = paraphrase.local_models()
    assert loaded is not None
    return loaded


def test_the_embedder_matches_the_torch_reference(models):
    texts = [
        "Who wrote the novel Middlemarch?",
        "ok",
        "My laptop's battery drains overnight even when it is shut down; what settings should I check first? " * 3,
    ]
    reference = verifier_build.reference_embeddings(texts)
    batch = np.array(models.embed(texts))  # padded together
    assert batch.shape == (3, 384)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-4)
    assert (batch * reference).sum(axis=1).min() >= 0.999
    alone = np.array(models.embed([texts[0]]))
    assert float(alone[0] @ reference[0]) >= 0.999


def test_a_paraphrase_scores_above_a_one_word_trap(models):
    cached = "How long should I boil an egg to get a soft yolk?"
    paraphrase_score, trap_score, number_trap = models.score([
        (cached, "For a runny yolk, how many minutes do I boil an egg?"),
        (cached, "How long should I boil an egg to get a hard yolk?"),
        ("How long should I boil 2 eggs?", "How long should I boil 6 eggs?"),
    ])  # fmt: skip
    assert 0.0 <= trap_score < paraphrase_score <= 1.0
    assert number_trap == 0.0  # other numbers: never served
    assert models.score([]) == []


def test_thresholds_come_from_the_calibration(models):
    strict, loose = models.threshold_for(0.005), models.threshold_for(0.05)
    assert loose <= strict  # a looser bound never needs a higher threshold
    assert math.isinf(models.threshold_for(0.0)) or models.threshold_for(0.0) >= strict
    assert len(models.digest) == 64


def test_the_build_is_skipped_when_current_and_redone_when_a_file_is_corrupt(tmp_path, monkeypatch):
    folder = tmp_path / "verifier"
    lines: list[str] = []
    first = verifier_build.build(folder, recipe=TINY, progress=lines.append)
    assert set(first["files"]) == {paraphrase.TOKENIZER, paraphrase.CROSS_ENCODER, paraphrase.EMBEDDER}

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("an up-to-date artifact was rebuilt")

    with monkeypatch.context() as patched:
        patched.setattr(verifier_build, "_Trainer", no_training)
        lines.clear()
        assert verifier_build.build(folder, recipe=TINY, progress=lines.append) == first
        assert any("up to date" in line for line in lines)

    embedder = folder / paraphrase.EMBEDDER
    embedder.write_bytes(embedder.read_bytes()[:-10] + b"corrupted!")
    assert "does not match its checksum" in verifier_build.is_current(folder, verifier_build.inputs_digest(TINY))
    lines.clear()
    second = verifier_build.build(folder, recipe=TINY, progress=lines.append)
    assert any("does not match its checksum" in line for line in lines)
    assert verifier_build.is_current(folder, verifier_build.inputs_digest(TINY)) == ""
    assert second["files"][paraphrase.EMBEDDER] == first["files"][paraphrase.EMBEDDER]  # deterministic


def test_the_shipped_weights_were_trained_from_the_tuning_data_as_it_is():
    """The tuned weights in the repository are what ``build_cache_verifier --train`` learned from
    the tuning files and recipe of this checkout: edit either without training again and this
    fails (a build would then train in place, minutes per installation)."""
    record, why = verifier_build.shipped_training()
    assert record is not None, why
    assert record["training_digest"] == verifier_build.training_digest()
    assert record["calibration"]["sources"], "a shipped training carries its calibration"
    assert verifier_build.shipped_training(TINY) == (None, "a recipe of its own")


def test_trained_weights_are_saved_and_loaded_as_they_were(tmp_path):
    """float16 differences for the tuned layers, float32 for the head: the logits barely move."""
    import torch

    trainer = verifier_build._Trainer(TINY)
    model = trainer.model()
    with torch.no_grad():  # as if trained: every tuned weight moved, the head too
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    keys = [("How do I reset my password?", "What are the steps to reset my password?"), ("Hi", "Bye")]
    path = tmp_path / "weights.npz"
    trainer.save(model.eval(), path)
    loaded = trainer.load(path)
    assert np.allclose(trainer.logits(loaded, keys), trainer.logits(model, keys), atol=1e-3)
    assert not np.allclose(trainer.logits(trainer.model().eval(), keys), trainer.logits(model, keys), atol=1e-3)


def test_without_an_artifact_the_tier_is_off_and_says_why(tmp_path, caplog):
    with override_settings(SEMANTIC_CACHE_VERIFIER_DIR=str(tmp_path / "absent")), caplog.at_level(logging.WARNING):
        paraphrase.forget()
        assert paraphrase.local_models() is None
        assert paraphrase.local_models() is None  # logged once
    paraphrase.forget()
    (record,) = [r for r in caplog.records if r.name == "serving.semcache.paraphrase"]
    assert "paraphrase tier is off" in record.getMessage()
    assert "build_cache_verifier" in record.getMessage()


# One lookalike trap of each kind, written here: the cached prompt, then the new one.
TRAPS = {
    "antonym": ("How do I enable two-factor authentication on my account?",
                "How do I disable two-factor authentication on my account?"),
    "negation": ("Can I take ibuprofen with food?", "Can I take ibuprofen without food?"),
    "direction": ("How do I convert kilograms to pounds?", "How do I convert pounds to kilograms?"),
    "scope": ("What should I do before a job interview?", "What should I do after a job interview?"),
    "entity": ("What is the population of Canada?", "What is the population of Australia?"),
    "number": ("How many calories are in 2 eggs?", "How many calories are in 5 eggs?"),
    "role_swap": ("Can a landlord evict a tenant in winter?", "Can a tenant evict a landlord in winter?"),
    "specificity": ("How do I make bread?", "How do I make gluten-free sourdough bread?"),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(TRAPS))
def test_the_verifier_refuses_a_trap_of_each_kind_at_a_one_percent_bound(models, kind):
    cached, query = TRAPS[kind]
    [score] = models.score([(cached, query)])
    assert score < models.threshold_for(0.01), (kind, score)


def test_the_request_path_never_waits_for_a_load(cache_verifier):
    import time

    paraphrase.forget()
    assert paraphrase.ready() is None  # loading in a thread: this lookup goes without
    deadline = time.monotonic() + 60
    while paraphrase.ready() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(paraphrase.ready(), paraphrase.LocalModels)
