"""Production settings: no default SECRET_KEY, HTTPS-only cookies, HSTS; `check --deploy` is clean.

Settings are read once per process, so each case runs in a child process. DATABASE_URL and
REDIS_URL point at nothing: settings never connect at import, and neither does the check.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BASE_DIR = Path(__file__).resolve().parents[2]
PRINT_SETTINGS = """
import json, django
from django.conf import settings
django.setup()
from django.test import Client
names = ["DEBUG", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_HSTS_SECONDS",
         "SECURE_HSTS_INCLUDE_SUBDOMAINS", "SECURE_HSTS_PRELOAD", "SECURE_SSL_REDIRECT",
         "SECURE_PROXY_SSL_HEADER", "SECURE_CONTENT_TYPE_NOSNIFF", "X_FRAME_OPTIONS", "SECURE_REFERRER_POLICY"]
out = {name: getattr(settings, name) for name in names}
client = Client()
out["redirects"] = {path: client.get(path).status_code for path in ("/", "/healthz", "/accounts/login/")}
out["behind_proxy"] = client.get("/accounts/login/", HTTP_X_FORWARDED_PROTO="https").status_code
print(json.dumps(out))
"""


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "DEBUG", "PLATFORM_ENV"}}
    base.update(
        {
            "DJANGO_SETTINGS_MODULE": "console.settings",
            # Nothing listens there: a connection attempt would fail the command.
            "DATABASE_URL": "postgresql://nobody@127.0.0.1:9/nothing",
            "REDIS_URL": "redis://127.0.0.1:9/0",
        }
    )
    base.update(env)
    return subprocess.run([sys.executable, *args], cwd=BASE_DIR, env=base, capture_output=True, text=True, timeout=180)


@pytest.fixture
def strong_key() -> str:
    return secrets.token_urlsafe(64)


class TestProduction:
    def test_check_deploy_is_clean(self, tmp_path, strong_key):
        result = run(
            "manage.py", "check", "--deploy", "--fail-level", "WARNING",
            PLATFORM_ENV="production", SECRET_KEY=strong_key, PLATFORM_VAR_DIR=str(tmp_path),
            ALLOWED_HOSTS="platform.example.com",
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert "System check identified no issues" in result.stdout
        assert not (tmp_path / "secret_key").exists()

    def test_a_missing_secret_key_is_a_one_line_error(self, tmp_path):
        result = run("manage.py", "check", PLATFORM_ENV="production", PLATFORM_VAR_DIR=str(tmp_path))
        assert result.returncode != 0
        last = result.stderr.strip().splitlines()[-1]
        assert last == (
            "django.core.exceptions.ImproperlyConfigured: SECRET_KEY must be set when PLATFORM_ENV=production"
        )
        assert not (tmp_path / "secret_key").exists()

    def test_debug_is_refused(self, tmp_path, strong_key):
        result = run("manage.py", "check", PLATFORM_ENV="production", SECRET_KEY=strong_key, DEBUG="true")
        assert result.returncode != 0
        assert "DEBUG must be off when PLATFORM_ENV=production" in result.stderr

    def test_https_everywhere_except_the_probes(self, strong_key):
        result = run("-c", PRINT_SETTINGS, PLATFORM_ENV="production", SECRET_KEY=strong_key)
        assert result.returncode == 0, result.stderr
        values = json.loads(result.stdout.strip().splitlines()[-1])
        assert values["DEBUG"] is False
        assert values["SESSION_COOKIE_SECURE"] is values["CSRF_COOKIE_SECURE"] is True
        assert values["SECURE_HSTS_SECONDS"] == 31_536_000
        assert values["SECURE_HSTS_INCLUDE_SUBDOMAINS"] is values["SECURE_HSTS_PRELOAD"] is True
        assert values["SECURE_SSL_REDIRECT"] is True
        assert values["SECURE_PROXY_SSL_HEADER"] is None  # proxy headers are not trusted by default
        assert (values["SECURE_CONTENT_TYPE_NOSNIFF"], values["X_FRAME_OPTIONS"]) == (True, "DENY")
        assert values["SECURE_REFERRER_POLICY"] == "same-origin"
        assert values["redirects"] == {"/": 301, "/healthz": 200, "/accounts/login/": 301}
        assert values["behind_proxy"] == 301  # X-Forwarded-Proto is ignored unless trusted

    def test_proxy_headers_when_trusted_and_hsts_from_the_environment(self, strong_key):
        result = run(
            "-c", PRINT_SETTINGS, PLATFORM_ENV="production", SECRET_KEY=strong_key, TRUST_PROXY_HEADERS="1",
            SECURE_HSTS_SECONDS="600", SECURE_HSTS_PRELOAD="false",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        values = json.loads(result.stdout.strip().splitlines()[-1])
        assert values["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
        assert (values["SECURE_HSTS_SECONDS"], values["SECURE_HSTS_PRELOAD"]) == (600, False)
        assert values["behind_proxy"] == 200


class TestDevelopment:
    def test_a_secret_key_is_made_once_and_kept(self, tmp_path):
        show = "from django.conf import settings; print(settings.SECRET_KEY)"
        first = run("-c", show, PLATFORM_VAR_DIR=str(tmp_path))
        assert first.returncode == 0, first.stderr
        path = tmp_path / "secret_key"
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        key = first.stdout.strip()
        assert len(key) >= 50
        assert path.read_text().strip() == key
        second = run("-c", show, PLATFORM_VAR_DIR=str(tmp_path))
        assert second.stdout.strip() == key
        assert [p.name for p in tmp_path.iterdir()] == ["secret_key"]  # no temporary files left

    def test_processes_starting_at_once_agree_on_one_key(self, tmp_path):
        show = "from django.conf import settings; print(settings.SECRET_KEY)"
        base = {k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "PLATFORM_ENV"}}
        base.update(
            DJANGO_SETTINGS_MODULE="console.settings",
            PLATFORM_VAR_DIR=str(tmp_path),
            DATABASE_URL="postgresql://nobody@127.0.0.1:9/nothing",
            REDIS_URL="redis://127.0.0.1:9/0",
        )
        children = [
            subprocess.Popen([sys.executable, "-c", show], cwd=BASE_DIR, env=base, stdout=subprocess.PIPE, text=True)
            for _ in range(4)
        ]
        keys = {child.communicate(timeout=180)[0].strip() for child in children}
        assert len(keys) == 1
        assert keys == {(tmp_path / "secret_key").read_text().strip()}

    def test_a_configured_secret_key_is_used_as_is(self, tmp_path, strong_key):
        result = run(
            "-c", "from django.conf import settings; print(settings.SECRET_KEY)",
            SECRET_KEY=strong_key, PLATFORM_VAR_DIR=str(tmp_path),
        )  # fmt: skip
        assert result.stdout.strip() == strong_key
        assert not (tmp_path / "secret_key").exists()


class TestRedisSentinel:
    """REDIS_SENTINELS configures every client the platform makes for the master Sentinel names
    (tests/faults/test_sentinel.py drives them through a real failover)."""

    SHOW = """
import json
from django.conf import settings
host = settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0]
print(json.dumps({"sentinels": settings.REDIS_SENTINELS, "master": settings.REDIS_SENTINEL_MASTER,
                  "broker": settings.CELERY_BROKER_URL, "broker_options": settings.CELERY_BROKER_TRANSPORT_OPTIONS,
                  "cache": settings.CACHES["default"]["OPTIONS"].get("pool_class"),
                  "channels": {k: v for k, v in host.items() if k != "sentinel_kwargs"}}))
"""

    def show(self, **env: str) -> dict[str, Any]:
        result = run("-c", "import django; django.setup()\n" + self.SHOW, **env)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.strip().splitlines()[-1])

    def test_it_reaches_every_client(self):
        found = self.show(REDIS_SENTINELS="10.0.0.1:26379, 10.0.0.2:26380,sentinel-3", REDIS_SENTINEL_MASTER="platform",
                          REDIS_URL="redis://:s3cret@unused:6379/4")  # fmt: skip
        assert found["sentinels"] == [["10.0.0.1", 26379], ["10.0.0.2", 26380], ["sentinel-3", 26379]]
        assert found["broker"] == (
            "sentinel://:s3cret@10.0.0.1:26379/4;sentinel://:s3cret@10.0.0.2:26380/4;sentinel://:s3cret@sentinel-3:26379/4"
        )
        assert found["broker_options"]["master_name"] == "platform"
        assert found["cache"] == "core.redis.SentinelPool"
        channels = found["channels"]
        assert channels["master_name"] == "platform"
        assert channels["db"] == 4
        assert channels["password"] == "s3cret"
        assert "address" not in channels

    def test_without_it_nothing_changes(self):
        found = self.show(REDIS_URL="redis://127.0.0.1:9/2")
        assert found["sentinels"] == []
        assert found["broker"] == "redis://127.0.0.1:9/2"
        assert "master_name" not in found["broker_options"]
        assert found["cache"] is None
        assert found["channels"]["address"] == "redis://127.0.0.1:9/2"
