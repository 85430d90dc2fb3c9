"""Bad input by hand for the Files and Batch APIs (issue 34), against a real gateway: each case
is a clear 4xx in OpenAI's error shape, and nothing is stored (no file row, no bytes in the
store), no batch is made and nothing is billed. Also what the audit measured: a body is not
read before its sender is known, and an upload goes to disk as it arrives."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.gateway import ApiKeyFixture
from tests.support.processes import Gateway, start_gateway

pytestmark = pytest.mark.django_db

MAX_FILES = 3


@pytest.fixture(scope="module")
def store_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bad-files-store")


@pytest.fixture(scope="module")
def files_gateway(django_db_setup, tmp_path_factory, store_root) -> Iterator[Gateway]:
    gateway = start_gateway(
        tmp_path_factory.mktemp("bad-files-gateway"),
        ARTIFACT_ROOT=str(store_root),
        FILES_ORG_MAX_FILES=str(MAX_FILES),
        FILES_MAX_BYTES=str(64 * 1024 * 1024),
    )
    yield gateway
    gateway.stop()


def _line(custom_id: str = "a", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "all-minilm-l6-v2", "input": "x", **body}}  # fmt: skip


def _jsonl(*lines: dict[str, Any]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def _upload(gateway: Gateway, secret: str | None, content: bytes, *, filename: str = "in.jsonl") -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.post(f"{gateway.base_url}/v1/files", headers=headers, data={"purpose": "batch"},
                      files={"file": (filename, content, "application/jsonl")}, timeout=60)  # fmt: skip


def _assert_refused(response: httpx.Response, status: int, *, says: str = "", code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert says in error["message"], error
    if code is not None:
        assert error["code"] == code


def _nothing_stored(organization_id: int, store_root: Path) -> None:
    from billing.models import UsageRecord
    from serving.models import Batch, StoredFile

    assert not StoredFile.objects.filter(organization_id=organization_id).exists()
    assert not Batch.objects.filter(organization_id=organization_id).exists()
    assert not list((store_root / "files" / str(organization_id)).glob("*"))
    assert not UsageRecord.objects.filter(organization_id=organization_id).exists()


CASES = {
    "a NUL in a string": (_jsonl(_line("a"), _line("b", input="x\u0000y")), "Line 2 has a NUL character"),
    "a NUL in a custom_id": (_jsonl(_line("a\u0000")), "Line 1 has a NUL character"),
    "a custom_id of 513 characters": (_jsonl(_line("c" * 513)), "Line 1 has a custom_id of 513 characters"),
    "50,001 lines": (_jsonl(*(_line(f"l{i}") for i in range(50_001))), "more than 50000 requests"),
    "invalid UTF-8": (_jsonl(_line("a")).replace(b'"x"', b'"\xc3\x28"'), "Line 1 is not UTF-8"),
    "a BOM": (b"\xef\xbb\xbf" + _jsonl(_line("a")), "byte-order mark"),
    "CRLF line ends": (_jsonl(_line("a"), _line("b")).replace(b"\n", b"\r\n"), "Line 1 ends with CR LF"),
    "an empty file": (b"", "no request"),
    "blank lines only": (b"\n\n  \n", "no request"),
    "a line that is not an object": (b"[1, 2]\n", "Line 1 is not a JSON object"),
    "a lone surrogate": (b'{"custom_id": "\\ud800", "method": "POST"}\n', "Line 1 is not JSON"),
    "a model name longer than its column": (_jsonl(_line("a", model="m" * 256)), "Line 1 names a model"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_upload_is_a_clear_400_and_nothing_is_stored(files_gateway, api_key, store_root, case):
    content, says = CASES[case]
    _assert_refused(_upload(files_gateway, api_key.secret, content), 400, says=says, code="invalid_file")
    _nothing_stored(api_key.organization_id, store_root)


def test_a_batch_of_bad_fields_is_a_clear_400_and_nothing_is_made(files_gateway, api_key, store_root):
    url = f"{files_gateway.base_url}/v1/batches"
    headers = {"Authorization": f"Bearer {api_key.secret}"}
    for body, param in [
        ({"input_file_id": "file-\u0000", "endpoint": "/v1/embeddings"}, "input_file_id"),
        ({"input_file_id": "f" * 5000, "endpoint": "/v1/embeddings"}, "input_file_id"),
        ({"input_file_id": "file-x", "endpoint": "/v1/embeddings", "metadata": {"k": "v\u0000"}}, "metadata"),
        ({"input_file_id": "file-x", "endpoint": "/v1/embeddings", "completion_window": "1h"}, "completion_window"),
        ({"input_file_id": "file-x", "endpoint": "/v9/anything"}, "endpoint"),
    ]:
        response = httpx.post(url, headers=headers, json=body, timeout=30)
        assert response.status_code in (400, 404), response.text
        assert response.json()["error"]["param"] == param
    for query in ("after=%00", f"after={'a' * 500}"):
        response = httpx.get(f"{url}?{query}", headers=headers, timeout=30)
        _assert_refused(response, 400)
    response = httpx.get(f"{files_gateway.base_url}/v1/files/file-%00", headers=headers, timeout=30)
    _assert_refused(response, 404)
    _nothing_stored(api_key.organization_id, store_root)


def test_past_its_storage_quota_an_organisation_gets_a_403(files_gateway, api_key, store_root):
    for _ in range(MAX_FILES):
        assert _upload(files_gateway, api_key.secret, _jsonl(_line("a"))).status_code == 200
    refused = _upload(files_gateway, api_key.secret, _jsonl(_line("a")))
    _assert_refused(refused, 403, says=f"its limit of {MAX_FILES}", code="storage_quota_exceeded")
    from serving.models import StoredFile

    assert StoredFile.objects.filter(organization_id=api_key.organization_id).count() == MAX_FILES
    assert len(list((store_root / "files" / str(api_key.organization_id)).glob("*"))) == MAX_FILES


def _send_headers_only(gateway: Gateway, headers: dict[str, str], *, declared: int, sent: int) -> tuple[bytes, float]:
    """A POST that declares a large body and sends only its first ``sent`` bytes: what the
    gateway answers, and how long it took (a gateway that waits for the whole body answers
    nothing before the timeout)."""
    boundary = uuid.uuid4().hex
    lines = ["POST /v1/files HTTP/1.1", f"Host: 127.0.0.1:{gateway.port}",
             f"Content-Type: multipart/form-data; boundary={boundary}", f"Content-Length: {declared}",
             *(f"{name}: {value}" for name, value in headers.items())]  # fmt: skip
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as connection:
        connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + b"x" * sent)
        answer = b""
        try:
            while b"\r\n\r\n" not in answer:
                chunk = connection.recv(65536)
                if not chunk:
                    break
                answer += chunk
        except TimeoutError:
            pass
    return answer, time.monotonic() - started


def test_an_upload_without_a_key_is_refused_before_its_body_is_read(files_gateway):
    answer, took = _send_headers_only(files_gateway, {}, declared=100 * 1024 * 1024, sent=64 * 1024)
    assert answer.startswith(b"HTTP/1.1 401"), (answer[:200], took)
    answer, _ = _send_headers_only(files_gateway, {"Authorization": "Bearer sk-nobody"}, declared=50 * 1024 * 1024,
                                   sent=1024)  # fmt: skip
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


def test_an_upload_past_the_request_rate_is_refused_before_its_body_is_read(files_gateway, make_api_key):
    key: ApiKeyFixture = make_api_key(rate_limit_rpm=1)
    assert _upload(files_gateway, key.secret, _jsonl(_line("a"))).status_code == 200
    answer, _ = _send_headers_only(files_gateway, {"Authorization": f"Bearer {key.secret}"},
                                   declared=10 * 1024 * 1024, sent=1024)  # fmt: skip
    assert answer.startswith(b"HTTP/1.1 429"), answer[:200]


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_an_upload_goes_to_disk_as_it_arrives(files_gateway, api_key, store_root):
    """The gateway's peak memory grows by far less than the file: its body is spooled to disk
    (before: read whole into memory, then joined: twice the file)."""
    line = _line("x", input="y" * 900)
    content = b"".join(orjson.dumps({**line, "custom_id": f"c{i}"}) + b"\n" for i in range(40_000))
    assert len(content) > 38 * 1024 * 1024
    before = _peak_rss_kib(files_gateway.process.pid)
    uploaded = _upload(files_gateway, api_key.secret, content)
    assert uploaded.status_code == 200, uploaded.text
    grown_mib = (_peak_rss_kib(files_gateway.process.pid) - before) / 1024
    assert grown_mib < len(content) / 1024 / 1024 / 2, f"peak memory grew {grown_mib:.0f} MiB"


def test_a_scoped_key_cannot_tell_a_model_outside_its_scope_from_a_missing_one(
    files_gateway, make_api_key, fake_model, store_root
):
    """Issue 34, defect 11, on the seeds' batch: the same 400 for both (before: 403 for a real one)."""
    key = make_api_key(allowed_models=["only-this-one"])
    bodies = []
    for model in (fake_model.name, f"missing-{uuid.uuid4().hex[:6]}"):
        response = httpx.post(f"{files_gateway.base_url}/api/v1/batch", json={"model": model, "inputs": ["hi"]},
                              headers={"Authorization": f"Bearer {key.secret}"}, timeout=30)  # fmt: skip
        assert response.status_code == 400, response.text
        bodies.append(response.json()["error"] | {"message": response.json()["error"]["message"].replace(model, "M")})
    assert bodies[0] == bodies[1]
    assert bodies[0]["code"] == "model_not_found"
    _nothing_stored(key.organization_id, store_root)
