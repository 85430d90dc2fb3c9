from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from accounts.models import ApiKey, Membership
from accounts.services import api_key_hash

pytestmark = pytest.mark.django_db


def _bootstrap() -> str:
    out = StringIO()
    call_command("bootstrap", "--skip-models", stdout=out)
    return out.getvalue()


class TestBootstrap:
    def test_it_creates_admin_orgs_and_a_working_demo_key(self, tmp_path, monkeypatch):
        creds = tmp_path / "bootstrap.json"
        monkeypatch.setenv("BOOTSTRAP_CREDENTIALS", str(creds))
        monkeypatch.delenv("PLATFORM_ADMIN_PASSWORD", raising=False)
        output = _bootstrap()
        saved = json.loads(creds.read_text())
        assert oct(creds.stat().st_mode & 0o777) == "0o600"
        admin = get_user_model().objects.get(username="admin")
        assert admin.is_superuser
        assert admin.check_password(saved["admin_password"])
        assert Membership.objects.get(user=admin).role == "platform_admin"
        key = ApiKey.objects.get(key_hash=api_key_hash(saved["demo_key"]))
        assert key.organization.name == "Demo"
        assert saved["demo_key"] in output

    def test_a_second_run_reuses_everything(self, tmp_path, monkeypatch):
        monkeypatch.setenv("BOOTSTRAP_CREDENTIALS", str(tmp_path / "bootstrap.json"))
        first = _bootstrap()
        second = _bootstrap()
        assert ApiKey.objects.filter(organization__name="Demo").count() == 1
        assert get_user_model().objects.filter(username="admin").count() == 1
        key_line = next(line for line in first.splitlines() if "demo API key" in line)
        assert key_line in second

    def test_the_admin_password_comes_from_the_environment(self, tmp_path, monkeypatch):
        monkeypatch.setenv("BOOTSTRAP_CREDENTIALS", str(tmp_path / "bootstrap.json"))
        monkeypatch.setenv("PLATFORM_ADMIN_PASSWORD", "from-env-password-1")
        _bootstrap()
        assert get_user_model().objects.get(username="admin").check_password("from-env-password-1")
