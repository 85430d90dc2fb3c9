"""OpenAI's Files API (/v1/files) through a real gateway with the unmodified openai SDK:
upload, list, read, delete; every line checked on upload; limits; one organisation's
files invisible to another's keys."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from tests.support.processes import Gateway, start_gateway

pytestmark = pytest.mark.django_db

MAX_BYTES, MAX_LINES = 4096, 5


@pytest.fixture(scope="module")
def files_gateway(django_db_setup, tmp_path_factory) -> Iterator[Gateway]:
    gateway = start_gateway(
        tmp_path_factory.mktemp("files-gateway"),
        FILES_MAX_BYTES=str(MAX_BYTES),
        FILES_MAX_LINES=str(MAX_LINES),
        ARTIFACT_ROOT=str(tmp_path_factory.mktemp("files-store")),  # uploads kept apart from the models
    )
    yield gateway
    gateway.stop()


def _client(gateway: Gateway, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0, timeout=30)


def _line(custom_id: str, **changes: object) -> dict[str, object]:
    line: dict[str, object] = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]},
    }
    return {**line, **changes}


def _jsonl(*lines: object) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def test_the_sdk_uploads_lists_reads_and_deletes_a_file(files_gateway, api_key):
    client = _client(files_gateway, api_key.secret)
    content = _jsonl(_line("a"), _line("b", url="/v1/embeddings", body={"model": "m", "input": "x"}))
    created = client.files.create(file=("requests.jsonl", content), purpose="batch")
    assert created.id.startswith("file-")
    assert (created.bytes, created.filename, created.purpose, created.status) == (
        len(content), "requests.jsonl", "batch", "processed",
    )  # fmt: skip
    assert client.files.retrieve(created.id).id == created.id
    assert created.id in [f.id for f in client.files.list()]
    assert client.files.content(created.id).read() == content
    assert client.files.delete(created.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    assert created.id not in [f.id for f in client.files.list()]


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        ([_line("a"), "not json"], "Line 2 is not JSON"),
        ([_line("a"), {"method": "POST"}], "Line 2 has no custom_id"),
        ([_line("a"), _line("b"), _line("a")], "Line 3 repeats custom_id 'a'"),
        ([_line("a", url="/v1/images/generations")], "Line 1 has url '/v1/images/generations'"),
        ([_line("a", method="GET")], 'Line 1 has no method "POST"'),
        ([_line("a", body={"messages": []})], "Line 1 has no body.model"),
        ([_line(str(i)) for i in range(MAX_LINES + 1)], f"more than {MAX_LINES} requests"),
        ([], "no request"),
    ],
)
def test_every_line_is_checked_on_upload(files_gateway, api_key, lines, says):
    client = _client(files_gateway, api_key.secret)
    content = b"".join((line.encode() if isinstance(line, str) else orjson.dumps(line)) + b"\n" for line in lines)
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("bad.jsonl", content), purpose="batch")
    assert says in refused.value.message
    assert refused.value.code == "invalid_file"
    assert refused.value.param == "file"
    assert client.files.list().data == []  # nothing kept of a refused upload


def test_size_purpose_and_form_are_refused_clearly(files_gateway, api_key):
    client = _client(files_gateway, api_key.secret)
    padded = _line("a", body={"model": "m", "messages": [{"role": "user", "content": "x" * MAX_BYTES}]})
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_BYTES}"):
        client.files.create(file=("big.jsonl", _jsonl(padded)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as purpose:
        client.files.create(file=("a.jsonl", _jsonl(_line("a"))), purpose="fine-tune")
    assert purpose.value.param == "purpose"
    headers = {"Authorization": f"Bearer {api_key.secret}"}
    huge = httpx.post(f"{files_gateway.base_url}/v1/files", headers=headers, content=b"x" * (2 * 1024 * 1024),
                      timeout=30)  # fmt: skip
    assert huge.status_code == 413  # refused by its Content-Length, before it is read
    not_multipart = httpx.post(f"{files_gateway.base_url}/v1/files", headers=headers, json={"file": "x"})
    assert not_multipart.status_code == 400
    assert httpx.post(f"{files_gateway.base_url}/v1/files", files={"purpose": (None, "batch")}).status_code == 401


def test_an_organisation_sees_only_its_files(files_gateway, api_key, make_api_key):
    ours = _client(files_gateway, api_key.secret)
    theirs = _client(files_gateway, make_api_key().secret)
    created = ours.files.create(file=("mine.jsonl", _jsonl(_line("a"))), purpose="batch")
    for call in (theirs.files.retrieve, theirs.files.content, theirs.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(created.id)
    assert created.id not in [f.id for f in theirs.files.list()]
    assert ours.files.retrieve(created.id).id == created.id  # still there


def test_the_list_pages_in_either_order(files_gateway, api_key):
    client = _client(files_gateway, api_key.secret)
    ids = [client.files.create(file=(f"{i}.jsonl", _jsonl(_line("a"))), purpose="batch").id for i in range(3)]
    first = client.files.list(limit=2, order="asc")
    assert [f.id for f in first.data] == ids[:2]
    assert first.has_more is True
    rest = client.files.list(limit=2, order="asc", after=ids[1])
    assert [f.id for f in rest.data] == ids[2:]
    assert rest.has_more is False
    assert [f.id for f in client.files.list(order="desc")] == ids[::-1]
    with pytest.raises(openai.BadRequestError):
        client.files.list(limit=0)


def test_the_admin_lists_files_read_only(tmp_path, store):
    from django.contrib.auth import get_user_model
    from django.test import Client

    from accounts.services import organization_create
    from serving.batches.files import file_create

    upload = tmp_path / "requests.jsonl"
    upload.write_bytes(_jsonl(_line("a"), _line("b")))
    org = organization_create(name="Files admin")
    stored = file_create(organization_id=org.pk, api_key_id=None, upload=upload, filename="r.jsonl", purpose="batch")
    assert (stored.lines, stored.bytes) == (2, upload.stat().st_size)
    assert store.local_path(stored.uri).read_bytes() == upload.read_bytes()
    root = get_user_model().objects.create_superuser(username="files-root", password="pw-1234567890")
    client = Client()
    client.force_login(root)
    assert stored.public_id in client.get("/admin/serving/storedfile/").content.decode()
    assert client.get(f"/admin/serving/storedfile/{stored.pk}/delete/").status_code == 403
    assert client.get("/admin/serving/storedfile/add/").status_code == 403


def test_a_file_named_in_any_script_downloads_under_its_name(files_gateway, api_key):
    """Issue 34, defect 9: a name outside Latin-1 broke the download's Content-Disposition."""
    from urllib.parse import unquote

    client = _client(files_gateway, api_key.secret)
    name = "données ✓ 数据.jsonl"
    created = client.files.create(file=(name, _jsonl(_line("a"))), purpose="batch")
    assert created.filename == name
    response = httpx.get(f"{files_gateway.base_url}/v1/files/{created.id}/content",
                         headers={"Authorization": f"Bearer {api_key.secret}"}, timeout=30)  # fmt: skip
    assert response.status_code == 200, response.text
    disposition = response.headers["content-disposition"]
    assert disposition.startswith("attachment; filename*=utf-8''")
    assert unquote(disposition.split("''", 1)[1]) == name
    plain = client.files.create(file=("a plain name.jsonl", _jsonl(_line("a"))), purpose="batch")
    response = httpx.get(f"{files_gateway.base_url}/v1/files/{plain.id}/content",
                         headers={"Authorization": f"Bearer {api_key.secret}"}, timeout=30)  # fmt: skip
    assert response.headers["content-disposition"] == 'attachment; filename="a plain name.jsonl"'
