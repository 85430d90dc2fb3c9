"""The S3-compatible artifact store against a real S3-compatible HTTP server (moto's, started here):
every method of the interface, registration by s3:// URI, the per-host cache (one download per host,
checked before use, least recently used evicted unless in use) and the errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest

from registry import artifacts
from registry.artifacts import ArtifactChecksumMismatch, ArtifactUnavailable, directory_digest
from registry.models import ModelVersion
from registry.s3_store import MANIFEST, S3ArtifactStore, manifest_digest
from registry.services import model_version_create_from_upload
from serving.supervisor.weights import Weights
from tests.support.processes import BASE_DIR, free_port, start_process, stop_process

CREDENTIALS = {"region": "us-east-1", "access_key_id": "testing", "secret_access_key": "testing"}


_closed: list[socket.socket] = []


def closed_endpoint() -> str:
    """An address nothing answers at, for the whole run: a port bound and never listened on
    (a free port found and let go could be taken by another test's server meanwhile)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _closed.append(sock)  # kept open (bound) until the run ends
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3-compatible server, on a port of its own for this module."""
    port = free_port()
    process = start_process(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{endpoint}/moto-api/", timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or process.poll() is not None:
                stop_process(process, grace=0)
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)
    yield endpoint
    stop_process(process, grace=2)


@pytest.fixture
def bucket(s3_endpoint) -> str:
    """A fresh bucket for each test."""
    name = f"models-{uuid.uuid4().hex[:12]}"
    raw_client(s3_endpoint).create_bucket(Bucket=name)
    return name


def raw_client(endpoint: str) -> Any:
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
    )  # fmt: skip


def options(endpoint: str, bucket: str, cache_root: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "bucket": bucket, "endpoint_url": endpoint, "cache_root": str(cache_root), "addressing_style": "path",
        **CREDENTIALS, **overrides,
    }  # fmt: skip


@pytest.fixture
def make_store(s3_endpoint, bucket, tmp_path):
    """Stores on this test's bucket; each is what one process of a host would have (one cache)."""

    def make(**overrides: Any) -> S3ArtifactStore:
        return S3ArtifactStore(**options(s3_endpoint, bucket, tmp_path / "cache", **overrides))

    return make


def file_gets(store: S3ArtifactStore) -> list[str]:
    """The artifact files (not manifests) the store GETs from now on."""
    seen: list[str] = []

    def count(params: dict[str, Any], **_: Any) -> None:
        if not params["Key"].endswith(MANIFEST):
            seen.append(params["Key"])

    store.client.meta.events.register("before-parameter-build.s3.GetObject", count)
    return seen


def make_artifact(tmp_path: Path, name: str, weights: bytes = b"w" * 1000) -> Path:
    source = tmp_path / "src" / name
    (source / "tokenizer").mkdir(parents=True)
    (source / "config.json").write_text('{"max_position_embeddings": 2048}')
    (source / "model.safetensors").write_bytes(weights)
    (source / "tokenizer" / "vocab.json").write_text('{"a": 1}')
    return source


def cache_entries(cache_root: Path) -> list[str]:
    return sorted(p.name for p in cache_root.iterdir() if not p.name.startswith(".")) if cache_root.exists() else []


class TestInterface:
    def test_a_directory_is_stored_with_its_digest_and_fetched_whole(self, make_store, bucket, tmp_path):
        store = make_store()
        source = make_artifact(tmp_path, "gpt-tiny")
        stored = store.put_directory(source=source, key="gpt-tiny/v1")
        assert stored.uri == f"s3://{bucket}/gpt-tiny/v1" == store.uri_for("gpt-tiny/v1")
        assert (stored.sha256, stored.size) == directory_digest(source)
        assert store.exists(stored.uri)
        assert store.digest(stored.uri) == (stored.sha256, stored.size)
        assert store.verify(stored.uri, stored.sha256)
        assert not store.verify(stored.uri, "0" * 64)
        path = store.local_path(stored.uri)
        assert directory_digest(path) == (stored.sha256, stored.size)
        assert (path / "tokenizer" / "vocab.json").read_text() == '{"a": 1}'
        assert path.stat().st_mode & 0o755 == 0o755

    def test_a_missing_artifact_does_not_exist_and_does_not_verify(self, make_store, bucket):
        store = make_store()
        assert not store.exists(f"s3://{bucket}/gpt-tiny/nowhere")
        assert not store.verify(f"s3://{bucket}/gpt-tiny/nowhere", "0" * 64)
        with pytest.raises(ArtifactUnavailable, match="no artifact at"):
            store.local_path(f"s3://{bucket}/gpt-tiny/nowhere")

    def test_a_missing_file_fails_verify(self, make_store, s3_endpoint, bucket, tmp_path):
        store = make_store()
        stored = store.put_directory(source=make_artifact(tmp_path, "gpt-tiny"), key="gpt-tiny/v1")
        raw_client(s3_endpoint).delete_object(Bucket=bucket, Key="gpt-tiny/v1/tokenizer/vocab.json")
        assert not store.verify(stored.uri, stored.sha256)

    def test_storing_again_replaces_the_files_and_this_hosts_cached_copy(self, make_store, tmp_path):
        store = make_store()
        first = store.put_directory(source=make_artifact(tmp_path, "one"), key="gpt-tiny/v1")
        store.local_path(first.uri)
        store.release(first.uri)
        source = tmp_path / "src" / "two"
        source.mkdir(parents=True)
        (source / "model.safetensors").write_bytes(b"other weights")
        second = store.put_directory(source=source, key="gpt-tiny/v1")
        assert second.sha256 != first.sha256
        path = store.local_path(second.uri)
        assert sorted(p.name for p in path.iterdir()) == ["model.safetensors"]
        assert directory_digest(path)[0] == second.sha256

    def test_an_empty_folder_and_bad_keys_are_refused(self, make_store, bucket, tmp_path):
        store = make_store()
        (tmp_path / "empty").mkdir()
        with pytest.raises(ValueError, match="empty"):
            store.put_directory(source=tmp_path / "empty", key="gpt-tiny/v1")
        for uri in ("local://gpt-tiny/v1", "s3://", f"s3://{bucket}", f"s3://{bucket}/../x", f"s3://{bucket}/a//b"):
            with pytest.raises(ValueError, match=r"URI|names no|not a usable object key"):
                store.exists(uri)

    def test_a_file_is_stored_opened_and_deleted(self, make_store, bucket, tmp_path):
        store = make_store()
        source = tmp_path / "upload.jsonl"
        source.write_bytes(b'{"a": 1}\n{"b": 2}\n')
        stored = store.put_file(source=source, key="files/7/file-abc.jsonl")
        assert stored.uri == f"s3://{bucket}/files/7/file-abc.jsonl"
        assert (stored.sha256, stored.size) == (artifacts.file_sha256(source), 18)
        assert store.exists(stored.uri)
        assert store.digest(stored.uri) == (stored.sha256, stored.size)
        with store.open_file(stored.uri) as handle:
            assert list(handle) == [b'{"a": 1}\n', b'{"b": 2}\n']
        store.delete_file(stored.uri)
        store.delete_file(stored.uri)  # gone already: nothing
        assert not store.exists(stored.uri)
        with pytest.raises(FileNotFoundError):
            store.open_file(stored.uri)

    def test_the_manifest_digest_is_directory_digest(self, tmp_path):
        # Path order is not string order ("a/b" < "a-c" as paths, not as strings).
        for rel in ("a/b", "a-c", "a.b/c", "z", "a/b-c/d"):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(rel)
        files = [path for path in tmp_path.rglob("*") if path.is_file()]
        hashes = {path.relative_to(tmp_path).as_posix(): artifacts.file_sha256(path) for path in files}
        assert manifest_digest(hashes) == directory_digest(tmp_path)[0]


class TestRegistration:
    @pytest.fixture
    def s3_store(self, settings, s3_endpoint, bucket, tmp_path) -> Iterator[artifacts.ArtifactStore]:
        settings.ARTIFACT_STORE = {
            "BACKEND": "registry.s3_store.S3ArtifactStore",
            "OPTIONS": options(s3_endpoint, bucket, tmp_path / "cache"),
        }
        artifacts.get_artifact_store.cache_clear()
        yield artifacts.get_artifact_store()
        artifacts.get_artifact_store.cache_clear()

    def body(self, uri: str) -> dict[str, Any]:
        return {"name": "gpt-tiny", "version": "v2.1", "framework": "pytorch", "artifact_uri": uri, "config": {}}

    def test_an_s3_uri_is_registered_hashed_through_the_store(self, ml, s3_store, tmp_path):
        stored = s3_store.put_directory(source=make_artifact(tmp_path, "gpt-tiny"), key="gpt-tiny/v2.1")
        response = ml.post("/api/v1/models", self.body(stored.uri), format="json")
        assert response.status_code == 201, response.content
        assert (response.json()["artifact_sha256"], response.json()["artifact_size"]) == (stored.sha256, stored.size)

    def test_a_missing_s3_artifact_is_a_400_naming_artifact_uri(self, ml, s3_store, bucket):
        response = ml.post("/api/v1/models", self.body(f"s3://{bucket}/gpt-tiny/nowhere"), format="json")
        assert response.status_code == 400
        assert f"no artifact at s3://{bucket}/gpt-tiny/nowhere" in response.json()["artifact_uri"][0]

    def test_files_put_there_by_hand_are_a_400_saying_how_to_store_them(self, ml, s3_store, s3_endpoint, bucket):
        raw_client(s3_endpoint).put_object(Bucket=bucket, Key="gpt-tiny/v2.1/model.safetensors", Body=b"w")
        response = ml.post("/api/v1/models", self.body(f"s3://{bucket}/gpt-tiny/v2.1"), format="json")
        assert response.status_code == 400
        assert "upload it from the console or the API" in response.json()["artifact_uri"][0]

    def test_an_upload_is_stored_in_the_bucket_and_registered(self, people, s3_store, bucket, tmp_path):
        version = model_version_create_from_upload(
            actor=people["ml"], name="gpt-tiny", version="v3", framework="pytorch",
            source=make_artifact(tmp_path, "upload"), config={},
        )  # fmt: skip
        assert version.artifact_uri == f"s3://{bucket}/gpt-tiny/v3"
        assert version.artifact_sha256 == directory_digest(tmp_path / "src" / "upload")[0]

    def test_an_unreachable_store_is_a_400_saying_so(self, ml, settings, bucket, tmp_path):
        settings.ARTIFACT_STORE = {
            "BACKEND": "registry.s3_store.S3ArtifactStore",
            "OPTIONS": options(closed_endpoint(), bucket, tmp_path / "cache", max_attempts=1),
        }
        artifacts.get_artifact_store.cache_clear()
        try:
            response = ml.post("/api/v1/models", self.body(f"s3://{bucket}/gpt-tiny/v2.1"), format="json")
        finally:
            artifacts.get_artifact_store.cache_clear()
        assert response.status_code == 400
        assert "cannot be reached" in response.json()["artifact_uri"][0]
        assert not ModelVersion.objects.filter(model__name="gpt-tiny").exists()


class TestCache:
    def test_a_second_use_is_served_from_the_cache(self, make_store, tmp_path):
        store = make_store()
        stored = store.put_directory(source=make_artifact(tmp_path, "gpt-tiny"), key="gpt-tiny/v1")
        gets = file_gets(store)
        first = store.local_path(stored.uri)
        assert len(gets) == 3
        again = make_store()  # another process of the same host
        gets_again = file_gets(again)
        assert again.local_path(stored.uri) == first
        assert store.local_path(stored.uri) == first
        assert (len(gets), gets_again) == (3, [])

    def test_replicas_starting_together_download_once(self, make_store, tmp_path):
        stored = make_store().put_directory(source=make_artifact(tmp_path, "gpt-tiny"), key="gpt-tiny/v1")
        stores = [make_store() for _ in range(4)]
        gets: list[str] = []
        for store in stores:

            def slow(params: dict[str, Any], **_: Any) -> None:
                if not params["Key"].endswith(MANIFEST):
                    gets.append(params["Key"])
                    time.sleep(0.2)  # long enough for every thread to be waiting

            store.client.meta.events.register("before-parameter-build.s3.GetObject", slow)
        barrier = threading.Barrier(len(stores))
        paths: list[Path] = []

        def start(store: S3ArtifactStore) -> None:
            barrier.wait()
            paths.append(store.local_path(stored.uri))

        threads = [threading.Thread(target=start, args=(store,)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(paths) == 4
        assert len(set(paths)) == 1
        assert len(gets) == 3  # each file once

    def test_processes_starting_together_download_once(self, make_store, s3_endpoint, bucket, tmp_path):
        stored = make_store().put_directory(source=make_artifact(tmp_path, "gpt-tiny"), key="gpt-tiny/v1")
        script = f"""
import json, sys, time
from registry.s3_store import MANIFEST, S3ArtifactStore
store = S3ArtifactStore(**json.loads(sys.argv[1]))
gets = []
def slow(params, **_):
    if not params["Key"].endswith(MANIFEST):
        gets.append(params["Key"])
        time.sleep(0.3)
store.client.meta.events.register("before-parameter-build.s3.GetObject", slow)
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
print(json.dumps({{"path": str(store.local_path({stored.uri!r})), "gets": len(gets)}}))
"""
        config = json.dumps(options(s3_endpoint, bucket, tmp_path / "cache"))
        at = str(time.time() + 3)  # all start then, once their imports are done
        processes = [
            subprocess.Popen([sys.executable, "-c", script, config, at], cwd=BASE_DIR, stdout=subprocess.PIPE)
            for _ in range(3)
        ]
        results = [json.loads(process.communicate(timeout=60)[0]) for process in processes]
        assert len({result["path"] for result in results}) == 1
        assert sorted(result["gets"] for result in results) == [0, 0, 3]

    def test_a_changed_object_is_a_checksum_error_and_leaves_nothing_in_the_cache(
        self, make_store, s3_endpoint, bucket, tmp_path
    ):
        store = make_store()
        stored = store.put_directory(source=make_artifact(tmp_path, "gpt-tiny"), key="gpt-tiny/v1")
        raw_client(s3_endpoint).put_object(Bucket=bucket, Key="gpt-tiny/v1/model.safetensors", Body=b"x" * 1000)
        with pytest.raises(ArtifactChecksumMismatch, match=r"model\.safetensors downloaded with SHA-256 .* changed"):
            store.local_path(stored.uri)
        assert cache_entries(tmp_path / "cache") == []
        with pytest.raises(ArtifactChecksumMismatch):  # and again: nothing half-done was kept
            make_store().local_path(stored.uri)
        assert cache_entries(tmp_path / "cache") == []

    def test_an_unreachable_store_is_a_clear_error(self, tmp_path, bucket):
        store = S3ArtifactStore(**options(closed_endpoint(), bucket, tmp_path / "cache", max_attempts=1))
        uri = f"s3://{bucket}/gpt-tiny/v1"
        for call in (store.local_path, store.exists, store.digest, store.open_file):
            with pytest.raises(ArtifactUnavailable, match=r"cannot be reached .* check ARTIFACT_S3_ENDPOINT_URL"):
                call(uri)
        assert cache_entries(tmp_path / "cache") == []

    def test_a_cached_artifact_is_served_while_the_store_is_down(self, make_store, bucket, tmp_path):
        stored = make_store().put_directory(source=make_artifact(tmp_path, "gpt-tiny"), key="gpt-tiny/v1")
        path = make_store().local_path(stored.uri)
        down = S3ArtifactStore(**options(closed_endpoint(), bucket, tmp_path / "cache", max_attempts=1))
        assert down.exists(stored.uri)
        assert down.local_path(stored.uri) == path
        with pytest.raises(ArtifactUnavailable, match="cannot be reached"):  # one not cached is asked for
            down.exists(f"s3://{bucket}/gpt-tiny/v2")

    def test_a_gateway_fetches_only_the_tokenizer_files_checked_and_once(self, make_store, bucket, tmp_path):
        from serving.gateway.routing import TOKENIZER_FILES

        source = make_artifact(tmp_path, "gpt-tiny")
        (source / "tokenizer.json").write_text('{"model": {}}')
        stored = make_store().put_directory(source=source, key="gpt-tiny/v1")
        store = make_store()
        gets = file_gets(store)
        path = store.metadata_path(stored.uri, TOKENIZER_FILES)
        assert sorted(p.name for p in path.iterdir()) == ["config.json", "tokenizer.json"]
        assert sorted(gets) == ["gpt-tiny/v1/config.json", "gpt-tiny/v1/tokenizer.json"]  # never the weights
        assert cache_entries(tmp_path / "cache") == []  # no engine's entry: nothing to evict or lock
        down = S3ArtifactStore(**options(closed_endpoint(), bucket, tmp_path / "cache", max_attempts=1))
        assert down.metadata_path(stored.uri, TOKENIZER_FILES) == path  # once per host
        whole = make_store().local_path(stored.uri)  # once the engine's copy is here, that one serves
        assert make_store().metadata_path(stored.uri, TOKENIZER_FILES) == whole

    def test_a_changed_tokenizer_file_is_a_checksum_error(self, make_store, s3_endpoint, bucket, tmp_path):
        stored = make_store().put_directory(source=make_artifact(tmp_path, "gpt-tiny"), key="gpt-tiny/v1")
        raw_client(s3_endpoint).put_object(Bucket=bucket, Key="gpt-tiny/v1/config.json", Body=b"{}")
        with pytest.raises(ArtifactChecksumMismatch, match=r"config\.json downloaded with SHA-256"):
            make_store().metadata_path(stored.uri, frozenset({"config.json"}))
        with pytest.raises(ArtifactUnavailable, match="there is no artifact"):
            make_store().metadata_path(f"s3://{bucket}/gpt-tiny/v9", frozenset({"config.json"}))

    def test_the_least_recently_used_is_evicted_to_make_room(self, make_store, tmp_path):
        store = make_store(cache_max_bytes=2500)  # room for two ~1 kB artifacts
        uris = {
            name: store.put_directory(source=make_artifact(tmp_path, name), key=f"m/{name}").uri
            for name in ("a", "b", "c")
        }
        for name in ("a", "b", "a"):  # a is used last
            store.local_path(uris[name])
            store.release(uris[name])
        store.local_path(uris["c"])
        entries = cache_entries(tmp_path / "cache")
        assert len(entries) == 2
        assert any(entry.startswith("models-") and "_m_a-" in entry for entry in entries)
        assert not any("_m_b-" in entry for entry in entries)

    def test_an_artifact_in_use_is_never_evicted(self, make_store, tmp_path):
        replica = make_store(cache_max_bytes=2500)
        other = make_store(cache_max_bytes=2500)
        uris = {
            name: other.put_directory(source=make_artifact(tmp_path, name), key=f"m/{name}").uri
            for name in ("a", "b", "c")
        }
        in_use = replica.local_path(uris["a"])  # the oldest, held by a running replica
        other.local_path(uris["b"])
        other.release(uris["b"])
        other.local_path(uris["c"])
        assert in_use.is_dir()
        assert [e for e in cache_entries(tmp_path / "cache") if "_m_b-" in e] == []
        other.release(uris["c"])
        replica.release(uris["a"])
        other.local_path(uris["b"])  # a is free now and the least recently used
        assert not in_use.exists()

    def test_a_supervisors_artifact_is_held_while_its_engines_use_it(self, make_store, tmp_path):
        """``serving.supervisor.weights``: fetched beside the loop, held (one store object for the
        supervisor's life) until no engine uses it, then evictable like any other."""
        other = make_store(cache_max_bytes=2500)  # another process of the host, room for two
        uris = {
            name: other.put_directory(source=make_artifact(tmp_path, name), key=f"m/{name}").uri
            for name in ("a", "b", "c")
        }
        reports: list[str] = []
        weights = Weights(reports.append, store=make_store(cache_max_bytes=2500))
        try:
            deadline = time.monotonic() + 20
            while not weights.prepare(uris["a"], time.monotonic(), needed=lambda: True):
                assert time.monotonic() < deadline, reports
                time.sleep(0.05)
            in_use = weights.path(uris["a"])
            assert in_use.is_dir()
            assert any("fetched" in r for r in reports)
            weights.release_unused([uris["a"]], time.monotonic())  # an engine uses it: kept
            for name in ("b", "c"):
                other.local_path(uris[name])
                other.release(uris[name])
            assert in_use.is_dir()
            weights.release_unused([], time.monotonic())  # its last engine stopped
            other.local_path(uris["b"])  # a is the least recently used, and free
            assert not in_use.exists()
        finally:
            weights.close()
