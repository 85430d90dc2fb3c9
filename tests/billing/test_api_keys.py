from __future__ import annotations

import hashlib
from datetime import datetime
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connection, transaction

from billing.models import ApiKey
from billing.services import api_key_create, api_key_hash

pytestmark = pytest.mark.django_db


class TestApiKeyCreate:
    def test_it_stores_only_the_hash(self, alice_org):
        issued = api_key_create(organization=alice_org, name="ci")
        assert issued.secret.startswith("sk-")
        assert len(issued.secret) >= 40
        stored = ApiKey.objects.get(pk=issued.api_key.pk)
        assert stored.key_hash == hashlib.sha256(issued.secret.encode()).hexdigest()
        # No column of the row holds the secret (or any long piece of it).
        with connection.cursor() as cursor:
            cursor.execute("SELECT row_to_json(k)::text FROM billing_apikey k WHERE id = %s", [stored.pk])
            (row_json,) = cursor.fetchone()
        assert issued.secret[3:] not in row_json
        assert issued.secret[12:30] not in row_json
        assert stored.prefix == issued.secret[:10]

    def test_keys_are_unique_and_random(self, alice_org):
        secrets = {api_key_create(organization=alice_org, name=f"k{i}").secret for i in range(20)}
        assert len(secrets) == 20

    def test_the_database_refuses_a_duplicate_hash(self, alice_org, bob_org):
        issued = api_key_create(organization=alice_org, name="one")
        with pytest.raises(IntegrityError), transaction.atomic():
            ApiKey.objects.create(key_hash=issued.api_key.key_hash, prefix="sk-x", organization=bob_org, name="dup")

    def test_the_database_refuses_a_hash_that_is_not_sha256(self, alice_org):
        with pytest.raises(IntegrityError), transaction.atomic():
            ApiKey.objects.create(key_hash="sk-plaintext-secret", prefix="sk-x", organization=alice_org, name="bad")

    def test_it_validates_limits_and_expiry(self, alice_org):
        with pytest.raises(ValueError, match="positive"):
            api_key_create(organization=alice_org, name="x", rate_limit_rpm=0)
        with pytest.raises(ValueError, match="timezone-aware"):
            api_key_create(organization=alice_org, name="x", expires_at=datetime(2030, 1, 1))  # noqa: DTZ001

    def test_defaults_match_the_schema(self, alice_org):
        key = api_key_create(organization=alice_org, name="d").api_key
        assert (key.rate_limit_rpm, key.rate_limit_tpm, key.allowed_models, key.is_active) == (60, 100_000, [], True)


class TestCreateApiKeyCommand:
    def test_it_prints_the_key_alone_on_stdout(self, alice_org):
        out, err = StringIO(), StringIO()
        call_command(
            "create_api_key",
            "--org",
            "Alice Corp",
            "--name",
            "cli",
            "--rpm",
            "120",
            "--tpm",
            "5000",
            stdout=out,
            stderr=err,
        )
        secret = out.getvalue().strip()
        assert "\n" not in secret
        assert secret.startswith("sk-")
        key = ApiKey.objects.get(key_hash=api_key_hash(secret))
        assert (key.organization, key.name, key.rate_limit_rpm, key.rate_limit_tpm) == (alice_org, "cli", 120, 5000)
        assert "will not be shown again" in err.getvalue()

    def test_it_restricts_models(self, alice_org):
        out = StringIO()
        call_command(
            "create_api_key",
            "--org",
            "Alice Corp",
            "--name",
            "m",
            "--model",
            "a",
            "--model",
            "b",
            stdout=out,
            stderr=StringIO(),
        )
        assert ApiKey.objects.get(key_hash=api_key_hash(out.getvalue().strip())).allowed_models == ["a", "b"]

    def test_it_rejects_an_unknown_org(self, db):
        with pytest.raises(CommandError, match="no organisation"):
            call_command("create_api_key", "--org", "Nobody", "--name", "x", stdout=StringIO(), stderr=StringIO())

    def test_it_rejects_bad_limits(self, alice_org):
        with pytest.raises(CommandError, match="positive"):
            call_command(
                "create_api_key",
                "--org",
                "Alice Corp",
                "--name",
                "x",
                "--rpm",
                "-1",
                stdout=StringIO(),
                stderr=StringIO(),
            )
