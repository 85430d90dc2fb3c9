"""Registry rows for tests that need a model's versions without artifacts of their own."""

from __future__ import annotations

from registry.models import Model, ModelVersion


def make_version(model: Model, version: str) -> ModelVersion:
    """A registered version of ``model`` whose artifact is a name only (nothing is stored)."""
    return ModelVersion.objects.create(
        model=model, version=version, framework="pytorch", artifact_uri=f"local://{model.name}/{version}",
        artifact_sha256="0" * 64, artifact_size=1,
    )  # fmt: skip
