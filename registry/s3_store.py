"""The S3-compatible artifact store (AWS S3, MinIO, Cloudflare R2) and the per-host cache engines load from.

An artifact stored as ``key`` is the objects ``<key>/<relative path>`` of the bucket plus
``<key>/.artifact-manifest.json``: every file's SHA-256 and size and the directory digest
(``registry.artifacts.directory_digest``). The manifest is written last, so an artifact whose
upload died half-way has none and is not there. ``local_path`` downloads an artifact once per
host into ``cache_root``, checks every byte against the manifest, and renames it into place;
the cache stays under ``cache_max_bytes`` by evicting the least recently used artifacts that
no process is using (docs/architecture.md, "Artifacts and the bundled models").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO, Any, BinaryIO, cast

import boto3
from boto3.exceptions import Boto3Error
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from django.core.exceptions import ImproperlyConfigured

from registry.artifacts import (
    _CHUNK,
    ArtifactChecksumMismatch,
    ArtifactStore,
    ArtifactUnavailable,
    StoredArtifact,
    _make_readable,
    file_sha256,
)

logger = logging.getLogger(__name__)

MANIFEST = ".artifact-manifest.json"
# Inside a cache entry: the artifact's files, the manifest they were checked against (its
# presence marks a complete entry), and the stamp whose mtime is the entry's last use.
FILES, RECORD, USED = "files", "artifact.json", "used"
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}


def manifest_digest(files: dict[str, str]) -> str:
    """``directory_digest``'s SHA-256 from each file's relative path and SHA-256 (same order)."""
    manifest = hashlib.sha256()
    for rel in sorted(files, key=PurePosixPath):
        manifest.update(f"{rel}\0{files[rel]}\n".encode())
    return manifest.hexdigest()


def _entry_name(bucket: str, key: str) -> str:
    """A cache folder's name: readable, and unique by a hash of the whole location."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{bucket}_{key}")[:80].lstrip(".")
    return f"{readable}-{hashlib.sha256(f'{bucket}/{key}'.encode()).hexdigest()[:16]}"


class S3ArtifactStore(ArtifactStore):
    """Artifacts in an S3-compatible bucket, addressed as ``s3://<bucket>/<key>``.

    Writes go to ``bucket``; reads take the bucket from the URI. ``local_path`` keeps a shared
    lock on the artifact's cache entry until ``release`` (or the process ends), so no other
    process evicts an artifact this one is using.
    """

    scheme = "s3"

    def __init__(
        self,
        *,
        bucket: str,
        cache_root: str | os.PathLike[str],
        cache_max_bytes: int = 0,
        endpoint_url: str = "",
        region: str = "",
        access_key_id: str = "",
        secret_access_key: str = "",
        addressing_style: str = "auto",
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_attempts: int = 3,
    ) -> None:
        if not bucket:
            raise ImproperlyConfigured("S3ArtifactStore needs a bucket: set ARTIFACT_S3_BUCKET.")
        self.bucket = bucket
        self.cache_root = Path(cache_root)
        self.cache_max_bytes = cache_max_bytes
        self.endpoint = endpoint_url or "the default S3 endpoint"
        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            s3={"addressing_style": addressing_style},
            # MinIO and R2 do not all take the newer default checksums: send them when required.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url or None,
            region_name=region or None,
            aws_access_key_id=access_key_id or None,
            aws_secret_access_key=secret_access_key or None,
            config=config,
        )
        self._held: dict[str, IO[bytes]] = {}  # cache entry -> its lock file, locked shared
        self._entry_locks: dict[str, threading.Lock] = {}
        self._entry_locks_guard = threading.Lock()

    # --- Addresses and errors --------------------------------------------------------------

    def uri_for(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _check_key(self, key: str) -> str:
        parts = key.split("/")
        if not key or any(part in ("", ".", "..") for part in parts) or parts[-1] == MANIFEST:
            raise ValueError(f"artifact key {key!r} is not a usable object key")
        return key

    def _parse(self, uri: str) -> tuple[str, str]:
        if not uri.startswith("s3://"):
            raise ValueError(f"{uri!r} is not an s3:// artifact URI")
        bucket, _, key = uri[len("s3://") :].partition("/")
        if not bucket:
            raise ValueError(f"{uri!r} names no bucket (s3://<bucket>/<key>)")
        return bucket, self._check_key(key)

    @contextlib.contextmanager
    def _talking(self, uri: str) -> Iterator[None]:
        """Store errors as ArtifactUnavailable, saying what to check."""
        try:
            yield
        except ClientError as exc:
            error = exc.response.get("Error", {})
            raise ArtifactUnavailable(
                f"the artifact store refused {uri} ({error.get('Code', '?')}: {error.get('Message', exc)}); "
                "check the bucket and ARTIFACT_S3_ACCESS_KEY_ID / ARTIFACT_S3_SECRET_ACCESS_KEY"
            ) from exc
        except (BotoCoreError, Boto3Error) as exc:
            raise ArtifactUnavailable(
                f"the artifact store at {self.endpoint} cannot be reached for {uri} ({exc}); "
                "check ARTIFACT_S3_ENDPOINT_URL and that the server is up"
            ) from exc

    def _head(self, bucket: str, key: str) -> dict[str, Any] | None:
        try:
            return cast(dict[str, Any], self.client.head_object(Bucket=bucket, Key=key))
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) in _NOT_FOUND:
                return None
            raise

    def _manifest(self, bucket: str, key: str) -> dict[str, Any] | None:
        try:
            body = self.client.get_object(Bucket=bucket, Key=f"{key}/{MANIFEST}")["Body"]
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) in _NOT_FOUND:
                return None
            raise
        with contextlib.closing(body):
            try:
                manifest = json.loads(body.read())
                if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
                    raise ValueError("no files")
            except ValueError as exc:
                raise ArtifactUnavailable(f"s3://{bucket}/{key}/{MANIFEST} is not a manifest ({exc})") from exc
        return manifest

    def _list(self, bucket: str, key: str) -> dict[str, int]:
        """The objects under ``key/``: relative name -> size."""
        found: dict[str, int] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{key}/"):
            for item in page.get("Contents", ()):
                found[item["Key"][len(key) + 1 :]] = int(item["Size"])
        return found

    # --- Writes ------------------------------------------------------------------------------

    def put_file(self, *, source: Path, key: str) -> StoredArtifact:
        uri = self.uri_for(self._check_key(key))
        sha256, size = file_sha256(source), source.stat().st_size
        with self._talking(uri):  # one object: S3 shows all of it or none (multipart included)
            self.client.upload_file(str(source), self.bucket, key, ExtraArgs={"Metadata": {"sha256": sha256}})
        return StoredArtifact(uri=uri, sha256=sha256, size=size)

    def put_directory(self, *, source: Path, key: str) -> StoredArtifact:
        uri = self.uri_for(self._check_key(key))
        paths = {path.relative_to(source).as_posix(): path for path in source.rglob("*") if path.is_file()}
        if not paths:
            raise ValueError(f"artifact directory {source} is empty")
        if MANIFEST in paths:
            raise ValueError(f"{MANIFEST} is the store's own file name")
        files: dict[str, dict[str, Any]] = {
            rel: {"sha256": file_sha256(path), "size": path.stat().st_size} for rel, path in paths.items()
        }
        sha256 = manifest_digest({rel: meta["sha256"] for rel, meta in files.items()})
        size = sum(int(meta["size"]) for meta in files.values())
        with self._talking(uri):
            # The old manifest goes first and the new one last: while files change, the
            # artifact reads as absent, never as a mix of two uploads.
            self.client.delete_object(Bucket=self.bucket, Key=f"{key}/{MANIFEST}")
            stale = set(self._list(self.bucket, key)) - set(paths)
            for number, (rel, path) in enumerate(sorted(paths.items()), start=1):
                self.client.upload_file(
                    str(path), self.bucket, f"{key}/{rel}", ExtraArgs={"Metadata": {"sha256": files[rel]["sha256"]}}
                )
                logger.info("uploaded %s: %s (%d of %d files)", uri, rel, number, len(paths))
            manifest = {"sha256": sha256, "size": size, "files": files}
            self.client.put_object(
                Bucket=self.bucket, Key=f"{key}/{MANIFEST}", Body=json.dumps(manifest).encode(),
                ContentType="application/json",
            )  # fmt: skip
            for rel in sorted(stale):
                self.client.delete_object(Bucket=self.bucket, Key=f"{key}/{rel}")
        self._drop_cached(uri)
        return StoredArtifact(uri=uri, sha256=sha256, size=size)

    def delete_file(self, uri: str) -> None:
        bucket, key = self._parse(uri)
        with self._talking(uri):
            self.client.delete_object(Bucket=bucket, Key=key)

    # --- Reads ---------------------------------------------------------------------------------

    def exists(self, uri: str) -> bool:
        """A stored file, or a directory artifact (with or without a manifest: ``digest`` says
        why one without cannot be used). One in this host's cache is there without asking: the
        gateway asks for every version on each routing refresh, and keeps serving while the
        store is down."""
        bucket, key = self._parse(uri)
        if (self.cache_root / _entry_name(bucket, key) / RECORD).exists():
            return True
        with self._talking(uri):
            if self._head(bucket, f"{key}/{MANIFEST}") is not None or self._head(bucket, key) is not None:
                return True
            page = self.client.list_objects_v2(Bucket=bucket, Prefix=f"{key}/", MaxKeys=1)
            return bool(page.get("Contents"))

    def digest(self, uri: str) -> tuple[str, int]:
        """The digest recorded when the artifact was stored (``local_path`` checks the files
        against it before any use); a file's from its object metadata."""
        bucket, key = self._parse(uri)
        with self._talking(uri):
            manifest = self._manifest(bucket, key)
            if manifest is not None:
                return str(manifest["sha256"]), int(manifest["size"])
            head = self._head(bucket, key)
        if head is not None and head.get("Metadata", {}).get("sha256"):
            return str(head["Metadata"]["sha256"]), int(head["ContentLength"])
        raise ArtifactUnavailable(
            f"{uri} has no {MANIFEST}: it was not stored through the platform; upload it from the console or the API"
        )

    def verify(self, uri: str, sha256: str) -> bool:
        """The manifest records ``sha256`` and every file it lists is there with its size (the
        bytes themselves are checked by ``local_path`` on the host that uses them)."""
        bucket, key = self._parse(uri)
        with self._talking(uri):
            manifest = self._manifest(bucket, key)
            if manifest is None or manifest.get("sha256") != sha256:
                return False
            listed = self._list(bucket, key)
        return all(listed.get(rel) == meta.get("size") for rel, meta in manifest["files"].items())

    def open_file(self, uri: str) -> BinaryIO:
        bucket, key = self._parse(uri)
        handle = tempfile.TemporaryFile()  # noqa: SIM115 (the caller's to close; deleted when closed)
        try:
            with self._talking(uri):
                if self._head(bucket, key) is None:
                    raise FileNotFoundError(errno.ENOENT, "no such stored file", uri)
                self.client.download_fileobj(bucket, key, handle)
        except BaseException:
            handle.close()
            raise
        handle.seek(0)
        return cast(BinaryIO, handle)

    # --- The per-host cache ------------------------------------------------------------------

    def local_path(self, uri: str) -> Path:
        """The artifact's folder in this host's cache, downloaded and checked on first use.

        Each entry has two lock files. Its use lock is held shared by every process using it,
        from here until ``release(uri)`` (or the process's end), and taken exclusive, without
        waiting, only to evict it: an entry in use is never evicted. Its fetch lock is held
        exclusive by the one process downloading it; the others asking for it wait there,
        then find it in place.
        """
        bucket, key = self._parse(uri)
        name = _entry_name(bucket, key)
        entry = self.cache_root / name
        with self._entry_lock(name):  # this process's threads, one at a time per entry
            if name not in self._held:
                handle = self._open_lock(name, "use")
                try:
                    fcntl.flock(handle, fcntl.LOCK_SH)  # waits only for an eviction under way
                except BaseException:
                    handle.close()
                    raise
                self._held[name] = handle
            if not (entry / RECORD).exists():
                try:
                    with self._open_lock(name, "fetch") as fetching:
                        fcntl.flock(fetching, fcntl.LOCK_EX)
                        if not (entry / RECORD).exists():
                            self._fetch(uri, bucket, key, name)
                except BaseException:
                    self._let_go(name)
                    raise
            now = time.time_ns()
            (entry / USED).touch()
            os.utime(entry / USED, ns=(now, now))
        return entry / FILES

    def has_local_copy(self, uri: str) -> bool:
        """Whether this host's cache holds the artifact, checked (``local_path`` need not download)."""
        return (self.cache_root / _entry_name(*self._parse(uri)) / RECORD).exists()

    def metadata_path(self, uri: str, names: frozenset[str]) -> Path:
        """Only the artifact's top-level files named in ``names``, each checked against the
        manifest, in ``cache_root/.meta/<entry>/`` (never evicted: a few files), or the whole
        entry when this host has it already: a gateway reads a model's tokenizer without
        downloading its weights. Fetched once per host; concurrent fetches each download and
        the first rename wins."""
        bucket, key = self._parse(uri)
        name = _entry_name(bucket, key)
        if (self.cache_root / name / RECORD).exists():
            return self.cache_root / name / FILES
        meta = self.cache_root / ".meta" / name
        if (meta / RECORD).exists():
            return meta / FILES
        with self._talking(uri):
            manifest = self._manifest(bucket, key)
        if manifest is None:
            raise ArtifactUnavailable(f"there is no artifact at {uri} (no {MANIFEST})")
        files: dict[str, dict[str, Any]] = manifest["files"]
        meta.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{name}.incoming-", dir=meta.parent))
        try:
            (staging / FILES).mkdir()
            wanted = sorted(rel for rel in files if rel in names)
            for rel in wanted:
                got = self._download(uri, bucket, f"{key}/{rel}", staging / FILES / rel)
                if got != files[rel]["sha256"]:
                    raise ArtifactChecksumMismatch(
                        f"{uri}: {rel} downloaded with SHA-256 {got}, but it was stored with "
                        f"{files[rel]['sha256']}: the object changed after upload; store the artifact again"
                    )
            _make_readable(staging / FILES)
            staging.chmod(0o755)
            (staging / RECORD).write_text(json.dumps({"uri": uri, "sha256": manifest["sha256"], "files": wanted}))
            try:
                staging.rename(meta)
            except OSError:  # another process put it in place meanwhile
                shutil.rmtree(staging, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return meta / FILES

    def release(self, uri: str) -> None:
        name = _entry_name(*self._parse(uri))
        with self._entry_lock(name):
            self._let_go(name)

    def _let_go(self, name: str) -> None:
        handle = self._held.pop(name, None)
        if handle is not None:
            handle.close()  # closing the lock file drops its lock

    def _entry_lock(self, name: str) -> threading.Lock:
        with self._entry_locks_guard:
            return self._entry_locks.setdefault(name, threading.Lock())

    def _open_lock(self, name: str, kind: str) -> IO[bytes]:
        # Lock files stay when entries go: a lock on a deleted file would guard nothing.
        locks = self.cache_root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        return open(locks / f"{name}.{kind}", "ab")

    def _fetch(self, uri: str, bucket: str, key: str, name: str) -> None:
        """Download, check and rename into place. Call holding the entry's use lock (shared) and
        its fetch lock (exclusive)."""
        with self._talking(uri):
            manifest = self._manifest(bucket, key)
        if manifest is None:
            raise ArtifactUnavailable(
                f"there is no artifact at {uri} (no {MANIFEST}): store it through the platform, "
                "from the console or the API"
            )
        files: dict[str, dict[str, Any]] = manifest["files"]
        for leftover in self.cache_root.glob(f"{name}.incoming-*"):  # a download that died half-way
            shutil.rmtree(leftover, ignore_errors=True)
        self._make_room(int(manifest["size"]), keep=name)
        staging = Path(tempfile.mkdtemp(prefix=f"{name}.incoming-", dir=self.cache_root))
        try:
            got: dict[str, str] = {}
            for number, rel in enumerate(sorted(files), start=1):
                target = staging / FILES / rel
                if not target.resolve().is_relative_to(staging / FILES):
                    raise ArtifactUnavailable(f"{uri}'s manifest names a file outside it: {rel!r}")
                target.parent.mkdir(parents=True, exist_ok=True)
                got[rel] = self._download(uri, bucket, f"{key}/{rel}", target)
                if got[rel] != files[rel]["sha256"]:
                    raise ArtifactChecksumMismatch(
                        f"{uri}: {rel} downloaded with SHA-256 {got[rel]}, but it was stored with "
                        f"{files[rel]['sha256']}: the object changed after upload; store the artifact again"
                    )
                logger.info("downloaded %s: %s (%d of %d files)", uri, rel, number, len(files))
            if manifest_digest(got) != manifest["sha256"]:
                raise ArtifactChecksumMismatch(
                    f"{uri}: the downloaded files' digest differs from the manifest's {manifest['sha256']}; "
                    "store the artifact again"
                )
            _make_readable(staging / FILES)
            staging.chmod(0o755)
            record = {"uri": uri, "sha256": manifest["sha256"], "size": manifest["size"]}
            (staging / RECORD).write_text(json.dumps(record))
            shutil.rmtree(self.cache_root / name, ignore_errors=True)  # an incomplete entry, if any
            staging.rename(self.cache_root / name)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _download(self, uri: str, bucket: str, key: str, target: Path) -> str:
        digest = hashlib.sha256()
        with self._talking(uri):
            body = self.client.get_object(Bucket=bucket, Key=key)["Body"]
            with contextlib.closing(body), open(target, "wb") as out:
                for chunk in body.iter_chunks(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
        return digest.hexdigest()

    def _make_room(self, needed: int, *, keep: str) -> None:
        """Evict least recently used entries until ``needed`` more bytes fit under
        ``cache_max_bytes``, skipping any a process holds (in use, or being fetched)."""
        if self.cache_max_bytes <= 0:
            return
        entries: list[tuple[int, int, str]] = []
        for entry in self.cache_root.iterdir():
            if entry.name == keep or entry.name.startswith(".") or ".incoming-" in entry.name:
                continue
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                size = int(json.loads((entry / RECORD).read_text())["size"])
                used = (entry / USED).stat().st_mtime_ns if (entry / USED).exists() else 0
                entries.append((used, size, entry.name))
        total = sum(size for _, size, _ in entries)
        for _, size, victim in sorted(entries):
            if total + needed <= self.cache_max_bytes:
                break
            if self._evict(victim):
                total -= size
        if total + needed > self.cache_max_bytes:
            logger.warning(
                "artifact cache %s goes over ARTIFACT_CACHE_MAX_BYTES (%d + %d > %d bytes): the rest is in use",
                self.cache_root, total, needed, self.cache_max_bytes,
            )  # fmt: skip

    def _evict(self, name: str) -> bool:
        """Remove the entry unless some process holds its lock; True when removed."""
        with self._open_lock(name, "use") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            entry = self.cache_root / name
            (entry / RECORD).unlink(missing_ok=True)  # incomplete from here on
            shutil.rmtree(entry, ignore_errors=True)
            logger.info("evicted %s from the artifact cache", name)
            return True

    def _drop_cached(self, uri: str) -> None:
        """After a new upload: this host's cached copy is out of date (kept while in use)."""
        name = _entry_name(*self._parse(uri))
        with self._entry_lock(name):
            self._let_go(name)
            if (self.cache_root / name).exists() and not self._evict(name):
                logger.warning("the cached copy of %s is in use and stays until released", uri)
