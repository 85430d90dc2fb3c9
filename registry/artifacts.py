"""The artifact store: where model weights live, addressed by URI, checked by SHA-256.

The backend is chosen in settings.ARTIFACT_STORE so an object store can replace the local
folder; callers only use ``get_artifact_store()`` and the ``ArtifactStore`` interface.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

from django.conf import settings
from django.utils.module_loading import import_string

_CHUNK = 1 << 20


class ArtifactUnavailable(ValueError):
    """The artifact cannot be had: its store is unreachable or refuses us, or what came back
    differs from what was recorded. A ValueError, so callers that refuse an unusable artifact
    (``registry.services._artifact_digest``: a 400 naming ``artifact_uri``) refuse this too; the
    message says what failed and what to check."""


class ArtifactChecksumMismatch(ArtifactUnavailable):
    """A downloaded artifact's files differ from the digest recorded when it was stored."""


@dataclass(frozen=True)
class StoredArtifact:
    uri: str
    sha256: str
    size: int


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def directory_digest(root: Path) -> tuple[str, int]:
    """SHA-256 and total size of a directory artifact.

    The digest covers every file's relative path and content hash, in sorted order, so it
    is stable across machines and detects a renamed, missing, extra or changed file.
    """
    manifest = hashlib.sha256()
    total = 0
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:
        raise ValueError(f"artifact directory {root} is empty")
    for path in files:
        rel = path.relative_to(root).as_posix()
        manifest.update(f"{rel}\0{file_sha256(path)}\n".encode())
        total += path.stat().st_size
    return manifest.hexdigest(), total


def _make_readable(root: Path) -> None:
    """Engines may run as another user: directories 0755, files 0644."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


class ArtifactStore(ABC):
    scheme: str

    def uri_for(self, key: str) -> str:
        """The URI that ``put_directory``/``put_file`` give the artifact stored as ``key``."""
        return f"{self.scheme}://{key}"

    def release(self, uri: str) -> None:  # noqa: B027 (optional: only a caching store has work to do)
        """This process no longer uses ``local_path(uri)``: a cache may evict it (no-op here)."""

    @abstractmethod
    def put_directory(self, *, source: Path, key: str) -> StoredArtifact:
        """Store the files under ``source`` as artifact ``key``, replacing any previous copy."""

    @abstractmethod
    def local_path(self, uri: str) -> Path:
        """A local directory holding the artifact's files, for an engine to load."""

    def has_local_copy(self, uri: str) -> bool:
        """Whether ``local_path(uri)`` answers without a download (here always: the files are local)."""
        return True

    def metadata_path(self, uri: str, names: frozenset[str]) -> Path:
        """A local directory holding at least those of the artifact's top-level files named in
        ``names`` (a tokenizer, a generation config: what a gateway reads of a model). Here the
        whole artifact; a store that downloads fetches only those. ``ArtifactUnavailable`` when
        there is no such artifact."""
        if not self.exists(uri):
            raise ArtifactUnavailable(f"there is no artifact at {uri}")
        return self.local_path(uri)

    @abstractmethod
    def exists(self, uri: str) -> bool: ...

    @abstractmethod
    def put_file(self, *, source: Path, key: str) -> StoredArtifact:
        """Store one file (a customer's upload, a batch's output) as ``key``, whole or not at all."""

    @abstractmethod
    def open_file(self, uri: str) -> BinaryIO:
        """A stored file, opened for reading."""

    @abstractmethod
    def delete_file(self, uri: str) -> None:
        """Remove a stored file (nothing when it is gone already)."""

    def digest(self, uri: str) -> tuple[str, int]:
        """SHA-256 and size of the stored artifact (see ``directory_digest``).

        Raises ValueError for an empty artifact and OSError for one that cannot be read.
        """
        return directory_digest(self.local_path(uri))

    def verify(self, uri: str, sha256: str) -> bool:
        """True when the stored artifact is present and its digest matches ``sha256``."""
        if not self.exists(uri):
            return False
        return self.digest(uri)[0] == sha256


class LocalArtifactStore(ArtifactStore):
    """Artifacts as folders under ``root``; URIs look like ``local://<key>``."""

    scheme = "local"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"artifact key {key!r} escapes the store")
        return path

    def _key(self, uri: str) -> str:
        prefix = f"{self.scheme}://"
        if not uri.startswith(prefix):
            raise ValueError(f"{uri!r} is not a {self.scheme}:// artifact URI")
        return uri[len(prefix) :]

    def put_directory(self, *, source: Path, key: str) -> StoredArtifact:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Copy next to the target and swap it in with a rename, so a reader never sees a
        # half-written artifact and a failed copy leaves the previous one intact.
        staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=target.parent))
        try:
            shutil.copytree(source, staging, dirs_exist_ok=True)
            _make_readable(staging)
            sha256, size = directory_digest(staging)
            if target.exists():
                retired = Path(tempfile.mkdtemp(prefix=".retired-", dir=target.parent))
                target.rename(retired / "old")
                staging.rename(target)
                shutil.rmtree(retired, ignore_errors=True)
            else:
                staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return StoredArtifact(uri=f"{self.scheme}://{key}", sha256=sha256, size=size)

    def local_path(self, uri: str) -> Path:
        return self._path(self._key(uri))

    def exists(self, uri: str) -> bool:
        path = self.local_path(uri)
        return path.is_dir() and any(path.iterdir())

    def put_file(self, *, source: Path, key: str) -> StoredArtifact:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Copied beside the target and renamed into place: a reader sees all of it or none.
        fd, staging = tempfile.mkstemp(prefix=".incoming-", dir=target.parent)
        os.close(fd)
        try:
            shutil.copyfile(source, staging)
            os.chmod(staging, 0o644)
            Path(staging).rename(target)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
        return StoredArtifact(uri=f"{self.scheme}://{key}", sha256=file_sha256(target), size=target.stat().st_size)

    def open_file(self, uri: str) -> BinaryIO:
        return self.local_path(uri).open("rb")

    def delete_file(self, uri: str) -> None:
        self.local_path(uri).unlink(missing_ok=True)


@lru_cache(maxsize=1)
def get_artifact_store() -> ArtifactStore:
    config: dict[str, Any] = settings.ARTIFACT_STORE
    backend = import_string(config["BACKEND"])
    store: ArtifactStore = backend(**config.get("OPTIONS", {}))
    return store
