"""The artifact store (registry.artifacts) and uploads of model artifacts."""

from __future__ import annotations

import os
from typing import Any

from core import embedded

from .env import envfloat, envint

#: The artifact store's backend: registry.artifacts.LocalArtifactStore (folders) or registry.s3_store.S3ArtifactStore.
ARTIFACT_STORE_BACKEND = os.environ.get("ARTIFACT_STORE_BACKEND", "registry.artifacts.LocalArtifactStore")
#: The local store's folder (LocalArtifactStore).
ARTIFACT_ROOT = os.environ.get("ARTIFACT_ROOT", str(embedded.VAR_DIR / "artifacts"))
#: The S3-compatible store's bucket, where uploads go (S3ArtifactStore; required by it).
ARTIFACT_S3_BUCKET = os.environ.get("ARTIFACT_S3_BUCKET", "")
#: The S3-compatible server's URL (MinIO: http://host:9000; R2: https://<account>.r2.cloudflarestorage.com); empty: AWS.
ARTIFACT_S3_ENDPOINT_URL = os.environ.get("ARTIFACT_S3_ENDPOINT_URL", "")
#: The bucket's region (R2: auto); empty: boto3's default.
ARTIFACT_S3_REGION = os.environ.get("ARTIFACT_S3_REGION", "")
#: The access key; empty: boto3's default credentials (AWS_* variables, instance profile).
ARTIFACT_S3_ACCESS_KEY_ID = os.environ.get("ARTIFACT_S3_ACCESS_KEY_ID", "")
#: The secret access key that goes with ARTIFACT_S3_ACCESS_KEY_ID.
ARTIFACT_S3_SECRET_ACCESS_KEY = os.environ.get("ARTIFACT_S3_SECRET_ACCESS_KEY", "")
#: How buckets are addressed: auto, path (MinIO) or virtual.
ARTIFACT_S3_ADDRESSING_STYLE = os.environ.get("ARTIFACT_S3_ADDRESSING_STYLE", "auto")
#: Seconds to connect to the S3-compatible server before it counts as unreachable.
ARTIFACT_S3_CONNECT_TIMEOUT = envfloat("ARTIFACT_S3_CONNECT_TIMEOUT", 5.0)
#: This host's cache of artifacts downloaded from the S3-compatible store (engines load from it).
ARTIFACT_CACHE_ROOT = os.environ.get("ARTIFACT_CACHE_ROOT", str(embedded.VAR_DIR / "artifact-cache"))
#: The cache's size limit (bytes): least recently used artifacts not in use are evicted; 0: no limit.
ARTIFACT_CACHE_MAX_BYTES = envint("ARTIFACT_CACHE_MAX_BYTES", 0)

# The artifact store is pluggable: swap BACKEND for an object-store implementation of
# registry.artifacts.ArtifactStore without touching callers.
_S3_OPTIONS: dict[str, Any] = {
    "bucket": ARTIFACT_S3_BUCKET,
    "endpoint_url": ARTIFACT_S3_ENDPOINT_URL,
    "region": ARTIFACT_S3_REGION,
    "access_key_id": ARTIFACT_S3_ACCESS_KEY_ID,
    "secret_access_key": ARTIFACT_S3_SECRET_ACCESS_KEY,
    "addressing_style": ARTIFACT_S3_ADDRESSING_STYLE,
    "connect_timeout": ARTIFACT_S3_CONNECT_TIMEOUT,
    "cache_root": ARTIFACT_CACHE_ROOT,
    "cache_max_bytes": ARTIFACT_CACHE_MAX_BYTES,
}
#: The artifact store: its backend class (ARTIFACT_STORE_BACKEND) and that backend's options (from the settings above).
ARTIFACT_STORE: dict[str, Any] = {
    "BACKEND": ARTIFACT_STORE_BACKEND,
    "OPTIONS": _S3_OPTIONS if ARTIFACT_STORE_BACKEND.endswith(".S3ArtifactStore") else {"root": ARTIFACT_ROOT},
}
# The request body: a folder's files or one .tar/.zip, and the unpacked size of an archive.
# Uploads stream to temporary files.
#: The largest artifact the console accepts as an upload (bytes).
ARTIFACT_UPLOAD_MAX_BYTES = envint("ARTIFACT_UPLOAD_MAX_BYTES", 2 * 1024**3)
