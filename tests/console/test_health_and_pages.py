from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import AsyncClient, Client

pytestmark = pytest.mark.django_db


class TestHealth:
    async def test_healthz(self):
        response = await AsyncClient().get("/healthz")
        assert response.status_code == 200
        assert response.json() == {"status": "ok"}

    def test_readyz_checks_database_and_redis(self):
        response = Client().get("/readyz")
        assert response.status_code == 200
        assert response.json() == {"status": "ready", "checks": {"database": "ok", "redis": "ok"}}

    def test_readyz_reports_a_dead_redis(self, monkeypatch):
        import redis.asyncio as aioredis

        from console import health

        dead = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1)
        monkeypatch.setattr(health, "async_redis", lambda: dead)
        response = Client().get("/readyz")
        assert response.status_code == 503
        body = response.json()
        assert body["checks"]["database"] == "ok"
        assert body["checks"]["redis"].startswith("error:")


class TestMetrics:
    """Issue 18: /metrics was open to anyone; it is the monitoring system's."""

    def test_the_monitoring_network_reads_it(self):
        response = Client(REMOTE_ADDR="127.0.0.1").get("/metrics")
        assert response.status_code == 200
        assert b"inference_requests" in response.content

    def test_anyone_else_needs_the_token(self, settings):
        settings.METRICS_ALLOWED_NETWORKS = ["10.1.0.0/16"]
        settings.METRICS_TOKEN = "s3cret-scrape-token"
        outsider = Client(REMOTE_ADDR="203.0.113.9")
        assert outsider.get("/metrics").status_code == 403
        assert outsider.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 403
        assert outsider.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-scrape-token").status_code == 200
        assert Client(REMOTE_ADDR="10.1.2.3").get("/metrics").status_code == 200
        settings.METRICS_TOKEN = ""  # no token set: none is accepted
        assert outsider.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 403


class TestConsoleHome:
    def test_it_requires_login(self):
        response = Client().get("/")
        assert response.status_code == 302
        assert "/login" in response["Location"]

    def test_it_sends_platform_admins_to_the_overview(self):
        user = get_user_model().objects.create_superuser(username="ml", password="pw-123456789")
        client = Client()
        client.force_login(user)
        response = client.get("/")
        assert response.status_code == 302
        assert response["Location"] == "/console/"

    def test_it_sends_everyone_else_to_the_portal(self, alice_org):
        from accounts.models import Membership, Role

        user = get_user_model().objects.create_user(username="member", password="pw-123456789")
        Membership.objects.create(user=user, organization=alice_org, role=Role.ORG_MEMBER)
        client = Client()
        client.force_login(user)
        response = client.get("/")
        assert response.status_code == 302
        assert response["Location"] == "/portal/"

    def test_the_models_page_lists_the_bundled_models(self, bundled_models):
        user = get_user_model().objects.create_superuser(username="ml", password="pw-123456789")
        client = Client()
        client.force_login(user)
        response = client.get("/console/models/")
        html = response.content.decode()
        assert response.status_code == 200
        for name in ("smollm2-135m-instruct", "all-minilm-l6-v2"):
            assert html.count(f'<tr data-model="{name}"') == 1


def test_every_model_of_ours_is_in_the_admin():
    from django.apps import apps
    from django.contrib import admin

    ours = [m for app in ("registry", "billing") for m in apps.get_app_config(app).get_models()]
    assert ours
    missing = [m.__name__ for m in ours if not admin.site.is_registered(m)]
    assert missing == []
