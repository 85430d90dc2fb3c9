"""Issue 34's audit of batches and files, without processes: one organisation's bad input file
or broken batch never stops another's, lines are claimed fairly between organisations, a
batch stops under an expired key, and the Files API's lines, quotas and retention."""

from __future__ import annotations

import io
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from django.db import DataError
from django.utils import timezone

from accounts.grants import KeyGrant
from accounts.services import api_key_create, organization_create
from serving.batches import files
from serving.batches import lines as batch_lines
from serving.batches import worker as batch_worker
from serving.models import Batch, BatchLine, StoredFile
from tests.support.batches import batch as make_batch
from tests.support.batches import stored_file

pytestmark = pytest.mark.django_db


def _line(custom_id: str = "c0", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "trust-model", "input": "x", **body}}  # fmt: skip


def _jsonl(*lines: dict[str, Any]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def _tenant(name: str) -> tuple[Any, Any]:
    org = organization_create(name=f"{name} {uuid.uuid4().hex[:6]}")
    return org, api_key_create(organization=org, name="k").api_key


def _validating(org: Any, key: Any, content: bytes) -> Batch:
    """A batch waiting for validation of a file stored as it is (as one stored before the
    upload checks were added, or written by the platform), bypassing the upload's checks."""
    file = stored_file(org, content)
    file.lines = max(1, content.count(b"\n"))
    file.save(update_fields=["lines"])
    return Batch.objects.create(
        public_id="batch_" + uuid.uuid4().hex[:24], organization=org, api_key=key, endpoint="/v1/embeddings",
        input_file=file, input_file_public_id=file.public_id, total=file.lines,
        expires_at=timezone.now() + timedelta(hours=24),
    )  # fmt: skip


# --- defect 1: a bad line stops every organisation's batches ----------------------------------


class TestUploadRefusesWhatTheDatabaseWould:
    def _check(self, content: bytes) -> str:
        with pytest.raises(files.BadFile) as refused:
            files.check_batch_file(io.BytesIO(content))
        return refused.value.message

    def test_a_nul_in_any_string_names_its_line_and_place(self):
        assert "Line 2" in self._check(_jsonl(_line("a"), _line("b", input="x\u0000y")))
        assert "body.input" in self._check(_jsonl(_line("b", input="x\u0000y")))
        assert "Line 1" in self._check(_jsonl(_line("a\u0000")))
        assert "Line 1" in self._check(_jsonl(_line("a", extra={"k\u0000": 1})))

    def test_an_escaped_backslash_before_u0000_is_no_nul(self):
        assert files.check_batch_file(io.BytesIO(_jsonl(_line("a", input="\\u0000")))) == 1

    def test_a_custom_id_longer_than_its_column(self):
        assert files.check_batch_file(io.BytesIO(_jsonl(_line("é" * 512)))) == 1
        assert "513 characters" in self._check(_jsonl(_line("é" * 513)))

    def test_a_model_name_longer_than_its_column(self):
        assert "Line 1" in self._check(_jsonl(_line("a", model="m" * 256)))

    def test_bom_crlf_and_bad_utf8_are_named(self):
        assert "byte-order mark" in self._check(b"\xef\xbb\xbf" + _jsonl(_line("a")))
        assert "CR LF" in self._check(_jsonl(_line("a")).replace(b"\n", b"\r\n"))
        assert "not UTF-8" in self._check(_jsonl(_line("a")).replace(b'"x"', b'"\xff"'))


class TestOneBadBatchStopsNobody:
    def test_a_file_with_a_nul_fails_its_batch_and_the_next_is_validated(self, store):
        bad_org, bad_key = _tenant("Bad file")
        good_org, good_key = _tenant("Good file")
        bad = _validating(bad_org, bad_key, _jsonl(_line("a"), _line("b", input="x\u0000y"), _line("c" * 513)))
        good = _validating(good_org, good_key, _jsonl(*(_line(f"g{i}") for i in range(5))))
        while batch_lines.validate_one():
            pass
        bad.refresh_from_db()
        good.refresh_from_db()
        assert bad.status == Batch.Status.FAILED
        assert [e["line"] for e in bad.errors] == [2, 3]
        assert all(e["code"] == "invalid_line" for e in bad.errors)
        assert not BatchLine.objects.filter(batch=bad).exists()
        assert good.status == Batch.Status.IN_PROGRESS
        assert BatchLine.objects.filter(batch=good).count() == 5

    def test_any_failure_writing_lines_fails_that_batch_only(self, store, monkeypatch):
        bad_org, bad_key = _tenant("Refused insert")
        good_org, good_key = _tenant("Accepted insert")
        bad = _validating(bad_org, bad_key, _jsonl(_line("a")))
        good = _validating(good_org, good_key, _jsonl(_line("a")))
        real = BatchLine.objects.bulk_create

        def refuse_the_first(rows: list[BatchLine], **kwargs: Any) -> list[BatchLine]:
            if rows and rows[0].batch_id == bad.pk:
                raise DataError("unsupported Unicode escape sequence")
            return real(rows, **kwargs)

        monkeypatch.setattr(BatchLine.objects, "bulk_create", refuse_the_first)
        while batch_lines.validate_one():
            pass
        bad.refresh_from_db()
        good.refresh_from_db()
        assert bad.status == Batch.Status.FAILED
        assert bad.errors[-1]["code"] == "validation_failed"
        assert "unsupported Unicode escape" in bad.errors[-1]["message"]
        assert good.status == Batch.Status.IN_PROGRESS

    def test_a_batch_still_validating_expires(self, store):
        org, key = _tenant("Late validation")
        late = _validating(org, key, _jsonl(_line("a")))
        Batch.objects.filter(pk=late.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
        assert batch_lines.expire_due() == 1
        late.refresh_from_db()
        assert late.status == Batch.Status.EXPIRED
        assert late.expired_at is not None

    def test_a_batch_whose_results_cannot_be_written_fails_alone(self, store, monkeypatch):
        org, key = _tenant("Finalize")
        broken = make_batch(org, key, lines={"succeeded": 2})
        fine = make_batch(org, key, lines={"succeeded": 2})
        BatchLine.objects.filter(batch__in=[broken, fine]).update(metered=True, status_code=200, response={})
        real = batch_lines._write_file

        def write(batch: Batch, rows: Any, name: str) -> StoredFile | None:
            if batch.pk == broken.pk:
                raise OSError("No space left on device")
            return real(batch, rows, name)

        monkeypatch.setattr(batch_lines, "_write_file", write)
        assert batch_lines.finalize_ready() == 1
        broken.refresh_from_db()
        fine.refresh_from_db()
        assert (broken.status, broken.errors[-1]["code"]) == (Batch.Status.FAILED, "finalize_failed")
        assert fine.status == Batch.Status.COMPLETED

    async def test_a_failing_housekeeping_step_leaves_the_others_running(self, monkeypatch):
        ran: list[str] = []

        async def broken() -> int:
            raise RuntimeError("a defect")

        def validate() -> bool:
            ran.append("validate")
            return False

        def finalize() -> int:
            ran.append("finalize")
            return 0

        monkeypatch.setattr(batch_worker, "meter_leftovers", broken)
        monkeypatch.setattr(batch_worker, "validate_one", validate)
        monkeypatch.setattr(batch_worker, "finalize_ready", finalize)
        await batch_worker.housekeeping()
        assert ran == ["validate", "finalize"]

    def test_an_answer_holding_nul_is_stored(self, store):
        org, key = _tenant("NUL answer")
        batch = make_batch(org, key, lines={"pending": 1})
        runnable = batch_lines.runnable_models()[batch.model]
        [line] = batch_lines.claim(batches=runnable, owner="w", limit=1)
        answer = {"choices": [{"message": {"content": "a\u0000b"}}]}
        assert batch_lines.store_answer(line, owner="w", succeeded=True, status_code=200, response=answer, error=None,
                                    event=None)  # fmt: skip
        stored = BatchLine.objects.get(pk=line.line_id)
        assert stored.response["choices"][0]["message"]["content"] == "a\ufffdb"


# --- defect 5: a batch runs under an expired key ------------------------------------------------


class TestExpiredKeys:
    def test_an_expired_or_revoked_key_stops_the_lines(self):
        _, key = _tenant("Expiry")
        grant = KeyGrant.of(key)
        assert batch_worker.key_stop_reason(grant) == ""
        key.expires_at = timezone.now() - timedelta(seconds=1)
        key.save(update_fields=["expires_at"])
        assert batch_worker.key_stop_reason(batch_worker._grant(key.pk)) == "key_expired"
        key.is_active = False
        key.save(update_fields=["is_active"])
        assert batch_worker.key_stop_reason(batch_worker._grant(key.pk)) == "key_revoked"

    async def test_a_line_under_an_expired_key_does_not_run(self, store, monkeypatch):
        from asgiref.sync import sync_to_async

        def setup() -> tuple[Batch, batch_lines.Claimed, KeyGrant]:
            org, key = _tenant("Expired batch")
            key.expires_at = timezone.now() - timedelta(seconds=1)
            key.save(update_fields=["expires_at"])
            batch = make_batch(org, key, lines={"pending": 1})
            [line] = batch_lines.claim(batches=batch_lines.runnable_models()[batch.model], owner="w", limit=1)
            grant = batch_worker._grant(key.pk)
            assert grant is not None
            return batch, line, grant

        batch, line, grant = await sync_to_async(setup)()

        async def must_not_run(*args: Any) -> Any:
            raise AssertionError("a line ran under an expired key")

        monkeypatch.setattr(batch_worker, "_execute", must_not_run)
        await batch_worker.run_line(line, grant, owner="w")
        await sync_to_async(batch.refresh_from_db)()
        assert batch.stop_reason == "key_expired"
        status = await sync_to_async(lambda: BatchLine.objects.get(pk=line.line_id).status)()
        assert status == BatchLine.Status.PENDING
        assert batch_lines.not_run_error("key_expired")[0] == "api_key_expired"


# --- the fair queue -------------------------------------------------------------------------


def _runnable(batch_id: int, org: int, weight: int = 1) -> batch_lines.Runnable:
    return batch_lines.Runnable(batch_id, f"batch_{batch_id}", org, weight, 1, "/v1/embeddings")


class TestFairShares:
    def test_a_newcomer_gets_the_free_slots_until_it_is_level(self):
        big, small = _runnable(1, org=10), _runnable(2, org=20)
        assert batch_lines.fair_shares([big, small], {1: 8}, 4) == {2: 4}
        shares = batch_lines.fair_shares([big, small], {1: 4, 2: 2}, 4)
        assert shares == {2: 3, 1: 1}  # level at 5 each

    def test_weights_share_in_proportion(self):
        heavy, light = _runnable(1, org=10, weight=3), _runnable(2, org=20, weight=1)
        assert batch_lines.fair_shares([heavy, light], {}, 8) == {1: 6, 2: 2}

    def test_the_batches_of_one_organisation_share_its_part(self):
        a1, a2, b = _runnable(1, org=10), _runnable(2, org=10), _runnable(3, org=20)
        assert batch_lines.fair_shares([a1, a2, b], {}, 8) == {1: 2, 2: 2, 3: 4}

    def test_ties_go_to_the_oldest(self):
        first, second = _runnable(1, org=10), _runnable(2, org=20)
        assert batch_lines.fair_shares([first, second], {}, 1) == {1: 1}


class TestFairClaim:
    def test_a_small_batch_behind_a_huge_one_gets_its_share(self, store):
        big_org, big_key = _tenant("Huge batch")
        small_org, small_key = _tenant("Small batch")
        huge = make_batch(big_org, big_key, model="fair-model", lines={"running": 8, "pending": 500})
        small = make_batch(small_org, small_key, model="fair-model", lines={"pending": 10})
        claimed = batch_lines.claim(batches=batch_lines.runnable_models()["fair-model"], owner="w", limit=4)
        assert {c.batch_id for c in claimed} == {small.pk}
        claimed = batch_lines.claim(batches=batch_lines.runnable_models()["fair-model"], owner="w", limit=6)
        # Level at 8 in flight each: small takes 4 more, then the two share the rest.
        counts = {b: sum(1 for c in claimed if c.batch_id == b) for b in (huge.pk, small.pk)}
        assert counts == {huge.pk: 1, small.pk: 5}

    def test_a_batch_with_fewer_lines_than_its_share_leaves_them_to_others(self, store):
        a_org, a_key = _tenant("Few lines")
        b_org, b_key = _tenant("Many lines")
        make_batch(a_org, a_key, model="fair-rest", lines={"pending": 1})
        many = make_batch(b_org, b_key, model="fair-rest", lines={"pending": 20})
        claimed = batch_lines.claim(batches=batch_lines.runnable_models()["fair-rest"], owner="w", limit=6)
        assert len(claimed) == 6
        assert sum(1 for c in claimed if c.batch_id == many.pk) == 5

    def test_the_weight_comes_from_the_organisation(self, store):
        from accounts.services import organization_update

        heavy_org, heavy_key = _tenant("Heavy")
        light_org, light_key = _tenant("Light")
        organization_update(organization=heavy_org, batch_weight=3)
        heavy = make_batch(heavy_org, heavy_key, model="fair-weight", lines={"pending": 20})
        make_batch(light_org, light_key, model="fair-weight", lines={"pending": 20})
        claimed = batch_lines.claim(batches=batch_lines.runnable_models()["fair-weight"], owner="w", limit=8)
        assert sum(1 for c in claimed if c.batch_id == heavy.pk) == 6

    def test_batch_weight_is_a_whole_number_in_range(self):
        from accounts.services import organization_update
        from core.errors import InvalidInput

        org, _ = _tenant("Weights")
        for bad in (0, 1001, "two", 1.5, True):
            with pytest.raises(InvalidInput):
                organization_update(organization=org, batch_weight=bad)
        assert organization_update(organization=org, batch_weight="7").batch_weight == 7


# --- defect 3: files quota and retention ----------------------------------------------------------


def _upload(tmp_path: Path, org_id: int, content: bytes) -> StoredFile:
    path = tmp_path / f"{uuid.uuid4().hex}.jsonl"
    path.write_bytes(content)
    return files.file_create(organization_id=org_id, api_key_id=None, upload=path, filename="in.jsonl",
                             purpose="batch")  # fmt: skip


class TestFilesQuotaAndRetention:
    def test_an_organisation_cannot_store_past_its_quota(self, store, settings, tmp_path):
        root = Path(settings.ARTIFACT_STORE["OPTIONS"]["root"])
        settings.FILES_ORG_MAX_FILES = 2
        org, _ = _tenant("File count")
        _upload(tmp_path, org.pk, _jsonl(_line("a")))
        _upload(tmp_path, org.pk, _jsonl(_line("a")))
        with pytest.raises(files.BadFile) as refused:
            _upload(tmp_path, org.pk, _jsonl(_line("a")))
        assert (refused.value.status, refused.value.code) == (403, "storage_quota_exceeded")
        assert StoredFile.objects.filter(organization=org).count() == 2
        assert len(list((root / "files" / str(org.pk)).rglob("*.jsonl"))) == 2  # the refused bytes went too
        other, _ = _tenant("File count, another")
        _upload(tmp_path, other.pk, _jsonl(_line("a")))  # its own quota

    def test_the_bytes_quota_counts_every_file(self, store, settings, tmp_path):
        org, _ = _tenant("File bytes")
        content = _jsonl(_line("a"))
        settings.FILES_ORG_MAX_BYTES = len(content) * 2
        _upload(tmp_path, org.pk, content)
        _upload(tmp_path, org.pk, content)
        with pytest.raises(files.BadFile) as refused:
            _upload(tmp_path, org.pk, content)
        assert refused.value.status == 403
        with pytest.raises(files.BadFile):
            files.file_quota_check(org.pk, incoming_bytes=1)

    def test_an_input_file_expires_unless_a_batch_still_reads_it(self, store, tmp_path):
        org, key = _tenant("Input retention")
        kept = _upload(tmp_path, org.pk, _jsonl(_line("a")))
        gone = _upload(tmp_path, org.pk, _jsonl(_line("a")))
        assert kept.expires_at is not None
        assert files.file_object(kept)["expires_at"] == int(kept.expires_at.timestamp())
        StoredFile.objects.filter(pk__in=[kept.pk, gone.pk]).update(expires_at=timezone.now() - timedelta(seconds=1))
        reading = make_batch(org, key, lines={"pending": 1}, input_file=kept)
        assert files.files_purge_expired() == 1
        assert StoredFile.objects.filter(pk=kept.pk).exists()
        assert not StoredFile.objects.filter(pk=gone.pk).exists()
        Batch.objects.filter(pk=reading.pk).update(status=Batch.Status.COMPLETED)
        assert files.files_purge_expired() == 1
        assert not StoredFile.objects.filter(pk=kept.pk).exists()

    def test_a_file_that_cannot_be_deleted_leaves_the_others_to_go(self, store, tmp_path, monkeypatch):
        org, _ = _tenant("Purge isolation")
        first = _upload(tmp_path, org.pk, _jsonl(_line("a")))
        second = _upload(tmp_path, org.pk, _jsonl(_line("a")))
        StoredFile.objects.filter(pk__in=[first.pk, second.pk]).update(expires_at=timezone.now() - timedelta(seconds=1))
        real = files.file_delete

        def delete(*, file: StoredFile) -> None:
            if file.pk == first.pk:
                raise PermissionError("read-only store")
            real(file=file)

        monkeypatch.setattr(files, "file_delete", delete)
        assert files.files_purge_expired() == 1
        assert not StoredFile.objects.filter(pk=second.pk).exists()

    def test_a_filename_cannot_break_a_header(self):
        assert files.clean_filename('C:\\folder\\a"b\r\nX-Evil: 1.jsonl') == "abX-Evil: 1.jsonl"
        assert files.clean_filename("données ✓.jsonl") == "données ✓.jsonl"
        assert files.clean_filename("\r\n") == "upload.jsonl"


# --- defect 8: batch lines share the caches with interactive requests -----------------------------


def test_a_batch_line_and_an_interactive_request_share_one_cache_scope(settings):
    """The engine's ``priority`` (a batch line's is lower) schedules an answer, it does not
    change it: it was part of the cache scope, so batch lines never met interactive answers."""
    from serving.gateway.routing import CacheRules
    from serving.semcache.lookup import embeddings_key
    from serving.semcache.policy import scope_of

    interactive = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    line = {**interactive, "priority": settings.BATCH_ENGINE_PRIORITY}

    def scope(payload: dict[str, Any]) -> str:
        return scope_of(payload=payload, version_id=3, organization_id=7, rules=CacheRules.defaults(),
                        default_temperature=1.0)  # fmt: skip

    assert scope(line) == scope(interactive)
    assert scope({**interactive, "temperature": 0.5}) != scope(interactive)  # the scope still tells answers apart
    embed = {"model": "e", "input": ["a"]}
    assert embeddings_key(payload={**embed, "priority": 10}, version_id=3, tenant="org:7") == embeddings_key(
        payload=embed, version_id=3, tenant="org:7"
    )
