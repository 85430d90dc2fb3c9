"""Registering an external upstream (an OpenAI-compatible server the platform does not run):
its address and key checked at the edge, the key stored sealed and never shown again."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.errors import InvalidInput
from registry.models import AuditEntry, ModelVersion, Upstream
from registry.selectors import upstream_targets
from registry.services import upstream_key_set, upstream_version_create
from registry.upstreams import clean_url

pytestmark = pytest.mark.django_db

KEY = "sk-upstream-0123456789abcdef"


def body(**change: Any) -> dict[str, Any]:
    data = {
        "name": "ext-chat",
        "version": "v1",
        "framework": "openai-upstream",
        "upstream": {"url": "http://10.0.0.7:8000/v1/", "model": "meta-llama/Llama-3.1-8B-Instruct", "api_key": KEY},
        "config": {"max_seq_len": 8192},
    }
    data.update(change)
    return data


class TestSealedKey:
    def test_the_key_is_stored_sealed_and_opens_again_for_the_data_plane(self):
        version, created = upstream_version_create(
            actor=None, name="ext-chat", version="v1", url="https://llm.internal/", served_model="m", api_key=KEY,
            config={},
        )  # fmt: skip
        assert created
        assert version.framework == "openai-upstream"
        assert version.artifact_uri == ""
        row = Upstream.objects.get(version=version)
        assert KEY not in row.api_key_sealed
        assert row.api_key_sealed
        target = upstream_targets(version_ids=[version.pk])[version.pk]
        assert (target.url, target.served_model, target.api_key) == ("https://llm.internal", "m", KEY)
        assert target.auth_headers == {"authorization": f"Bearer {KEY}"}
        audit = AuditEntry.objects.get(action="model_version.register", target=str(version))
        assert KEY not in json.dumps(audit.after)
        assert audit.after["upstream"]["api_key"] == "set"

    def test_a_key_sealed_under_another_secret_key_is_never_used(self, settings):
        version, _ = upstream_version_create(
            actor=None, name="ext-chat", version="v1", url="http://h:1", served_model="m", api_key=KEY, config={}
        )
        settings.SECRET_KEY = "another-secret-key-" + "x" * 40
        assert upstream_targets(version_ids=[version.pk]) == {}
        upstream_key_set(actor=None, version=version, api_key="sk-new")  # set again under the new one
        assert upstream_targets(version_ids=[version.pk])[version.pk].api_key == "sk-new"

    def test_an_upstream_without_a_key_sends_no_authorization(self):
        version, _ = upstream_version_create(
            actor=None, name="ext-chat", version="v1", url="http://h:1", served_model="m", config={}
        )
        assert Upstream.objects.get(version=version).api_key_sealed == ""
        assert upstream_targets(version_ids=[version.pk])[version.pk].auth_headers == {}


class TestRefused:
    @pytest.mark.parametrize(
        "url",
        ["ftp://h/x", "http://user:pw@h:8000", "http://h:8000?x=1", "http://h:8000#f", "not a url", "http://",
         "http://h:99999", "http://h\x00:1", "http://" + "h" * 600],
    )  # fmt: skip
    def test_a_bad_url_names_upstream_url(self, url):
        with pytest.raises(InvalidInput) as refused:
            clean_url(url)
        assert refused.value.field == "upstream.url"

    @pytest.mark.parametrize(
        ("change", "field"),
        [({"api_key": "sk bad"}, "upstream.api_key"), ({"api_key": "sk\r\nX-Evil: 1"}, "upstream.api_key"),
         ({"api_key": "k" * 4097}, "upstream.api_key"), ({"served_model": " "}, "upstream.model"),
         ({"served_model": "a\x00b"}, "upstream.model"), ({"task": "classification"}, "task")],
    )  # fmt: skip
    def test_bad_input_names_its_field_and_registers_nothing(self, change, field):
        values = {"url": "http://h:1", "served_model": "m", "api_key": KEY, "config": {}, **change}
        with pytest.raises(InvalidInput) as refused:
            upstream_version_create(actor=None, name="ext-chat", version="v1", **values)
        assert refused.value.field == field
        assert not ModelVersion.objects.filter(model__name="ext-chat").exists()

    def test_an_artifact_version_of_the_upstream_framework_is_refused(self, tmp_path):
        """Without its upstream no replica could ever serve it: registered by artifact, it is refused."""
        from registry.services import model_version_create

        with pytest.raises(InvalidInput) as refused:
            model_version_create(actor=None, name="ext-chat", version="v1", framework="openai-upstream",
                                 artifact_uri="local://ext-chat/v1", config={})  # fmt: skip
        assert refused.value.field == "framework"
        assert not ModelVersion.objects.filter(model__name="ext-chat").exists()


class TestManagementApi:
    def test_it_registers_and_never_shows_the_key(self, ml):
        response = ml.post("/api/v1/models", body(), format="json")
        assert response.status_code == 201, response.content
        assert KEY not in response.content.decode()
        data = response.json()
        assert data["framework"] == "openai-upstream"
        assert data["upstream"] == {
            "url": "http://10.0.0.7:8000", "model": "meta-llama/Llama-3.1-8B-Instruct", "has_api_key": True
        }  # fmt: skip
        listed = ml.get("/api/v1/models/ext-chat")
        assert listed.status_code == 200
        assert KEY not in listed.content.decode()
        assert listed.json()["versions"][0]["upstream"]["url"] == "http://10.0.0.7:8000"

    def test_the_same_again_is_a_200_and_another_upstream_a_409(self, ml):
        assert ml.post("/api/v1/models", body(), format="json").status_code == 201
        assert ml.post("/api/v1/models", body(), format="json").status_code == 200
        moved = body(upstream={**body()["upstream"], "url": "http://10.0.0.8:8000"})
        conflict = ml.post("/api/v1/models", moved, format="json")
        assert conflict.status_code == 409
        assert "upstream.url" in conflict.json()["detail"]
        rekeyed = body(upstream={**body()["upstream"], "api_key": "sk-other"})
        assert ml.post("/api/v1/models", rekeyed, format="json").status_code == 409

    @pytest.mark.parametrize(
        ("data", "field"),
        [(body(upstream=None), "upstream"), ({**body(), "artifact_uri": "local://x/1"}, "artifact_uri"),
         ({k: v for k, v in body().items() if k != "upstream"}, "upstream"),
         (body(framework="transformers"), "upstream"),
         (body(upstream={"url": "http://u:p@h:1", "model": "m"}), "upstream.url"),
         (body(upstream={"url": "http://h:1", "model": "m", "api_key": "a\nb"}), "upstream.api_key")],
    )  # fmt: skip
    def test_bad_bodies_are_400s_naming_the_field(self, ml, data, field):
        data = {k: v for k, v in data.items() if v is not None}
        response = ml.post("/api/v1/models", data, format="json")
        assert response.status_code == 400, response.content
        assert field in response.json(), response.json()
        assert not ModelVersion.objects.filter(model__name="ext-chat").exists()

    def test_only_the_platform_team_registers_one(self, people):
        from tests.support.api import client_for

        assert client_for(people["alice"]).post("/api/v1/models", body(), format="json").status_code == 403
