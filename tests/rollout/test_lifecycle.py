"""What a version is now (rollout.selectors.lifecycle_of): one answer for every page."""

from __future__ import annotations

import pytest
from django.utils import timezone

from registry.models import Deployment, Model, ModelVersion
from rollout.models import Canary
from rollout.selectors import lifecycle_of

pytestmark = pytest.mark.django_db


def version(model: Model, name: str) -> ModelVersion:
    return ModelVersion.objects.create(model=model, version=name, framework="pytorch", artifact_uri=f"local://lc/{name}",
                                       artifact_sha256="0" * 64, artifact_size=1)  # fmt: skip


def labels(*versions: ModelVersion) -> dict[str, str]:
    now = lifecycle_of(versions=list(versions))
    return {v.version: f"{now[v.pk].state}: {now[v.pk].label}" for v in versions}


def test_each_state_in_words():
    model = Model.objects.create(name="lc-chat", task="chat")
    v1, v2, v3, v4 = (version(model, n) for n in ("1", "2", "3", "4"))
    Deployment.objects.create(version=v1, status="running", traffic_weight=75)
    Deployment.objects.create(version=v2, status="running", traffic_weight=25)
    Deployment.objects.create(version=v3, status="stopped", traffic_weight=0)
    assert labels(v1, v2, v3, v4) == {
        "1": "serving: serving 75 %", "2": "serving: serving 25 %", "3": "stopped: stopped",
        "4": "registered: registered, not deployed",
    }  # fmt: skip
    now = timezone.now()
    canary = Canary.objects.create(model=model, base_version=v1, canary_version=v2, steps=[25, 100],
                                   interval_seconds=60, step_started_at=now, next_decision_at=now)  # fmt: skip
    assert labels(v1, v2) == {"1": "base: canary base at 75 %", "2": "canary: canary at 25 %"}
    Canary.objects.filter(pk=canary.pk).update(status="rolled_back")
    Deployment.objects.filter(version=v2).update(traffic_weight=0)
    assert labels(v1, v2) == {"1": "serving: serving 75 %", "2": "rolled_back: rolled back"}
    Canary.objects.filter(pk=canary.pk).update(status="promoted")
    Deployment.objects.filter(version=v2).update(traffic_weight=100)
    assert labels(v2)["2"] == "promoted: promoted, serving 100 %"
    Deployment.objects.create(version=v4, status="pending", traffic_weight=0)
    assert labels(v4)["4"] == "deployed: deployed, no traffic"


def test_the_models_and_version_pages_say_it(admin_client):
    model = Model.objects.create(name="lc-page", task="chat")
    v1 = version(model, "1")
    Deployment.objects.create(version=v1, status="running", traffic_weight=100)
    listed = admin_client.get("/console/models/", {"q": "lc-page"}).content.decode()
    assert '<span class="status status-serving" data-lifecycle="serving">serving 100 %</span>' in listed
    detail = admin_client.get("/console/models/lc-page/1/").content.decode()
    assert 'data-lifecycle="serving">serving 100 %' in detail
    assert 'id="version-actions"' in detail
