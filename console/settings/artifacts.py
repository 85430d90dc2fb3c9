"""The artifact store (registry.artifacts) and uploads of model artifacts."""

from __future__ import annotations

import os
from typing import Any

from core import embedded

from .env import envint

# The artifact store is pluggable: swap BACKEND for an object-store implementation of
# registry.artifacts.ArtifactStore without touching callers.
#: The artifact store: its backend class (ARTIFACT_STORE_BACKEND) and its root folder (ARTIFACT_ROOT).
ARTIFACT_STORE: dict[str, Any] = {
    "BACKEND": os.environ.get("ARTIFACT_STORE_BACKEND", "registry.artifacts.LocalArtifactStore"),
    "OPTIONS": {"root": os.environ.get("ARTIFACT_ROOT", str(embedded.VAR_DIR / "artifacts"))},
}
# The request body: a folder's files or one .tar/.zip, and the unpacked size of an archive.
# Uploads stream to temporary files.
#: The largest artifact the console accepts as an upload (bytes).
ARTIFACT_UPLOAD_MAX_BYTES = envint("ARTIFACT_UPLOAD_MAX_BYTES", 2 * 1024**3)
