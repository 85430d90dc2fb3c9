from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connection, transaction

from accounts.models import ApiKey
from accounts.services import api_key_create, api_key_hash

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
        # Shown as sk-…abcd: 14 of ~46 characters, the secret's middle never kept.
        assert stored.masked == f"sk-…{issued.secret[-4:]}"
        assert ApiKey(prefix="sk-AbCdEfG").masked == "sk-AbCdEfG…"  # made before the last four were kept

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


def create_key_command(*args: str) -> ApiKey:
    out = StringIO()
    call_command("create_api_key", "--org", "Alice Corp", "--name", "big", *args, stdout=out, stderr=StringIO())
    return ApiKey.objects.get(key_hash=api_key_hash(out.getvalue().strip()))


class TestOperatorInput:
    """Limits are 64-bit, bounded by what the limiter counts exactly, and bad input is one clear line."""

    def test_a_large_tpm_is_stored(self, alice_org):
        key = create_key_command("--tpm", "100000000000", "--rpm", "1000000", "--concurrent", "100000")
        key.refresh_from_db()
        assert (key.rate_limit_tpm, key.rate_limit_rpm, key.max_concurrent) == (10**11, 10**6, 10**5)

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (("--tpm", str(10**16)), "--tpm: must be at most 1000000000000000"),
            (("--rpm", str(10**16)), "--rpm: must be at most"),
            (("--concurrent", "0"), "--concurrent: must be positive"),
            (("--token-quota", str(2**64)), "--token-quota: must be at most"),
            (("--spend-cap", "100000000"), "--spend-cap: must be less than 100000000"),
            (("--spend-cap", "0.0000001"), "--spend-cap: must have at most 6 decimal places"),
            (("--spend-cap", "abc"), "--spend-cap"),
            (("--spend-cap", "NaN"), "--spend-cap"),
            (("--alert-percent", "150"), "--alert-percent: must be a whole number between 1 and 100"),
            (("--expires-in-days", "0"), "--expires-in-days"),
            (("--expires-in-days", "1e9"), "--expires-in-days"),
            (("--expires-in-days", "nan"), "--expires-in-days"),
            (("--name", "x" * 256), "--name: must be at most 255 characters"),
            (("--name", "  "), "--name: cannot be empty"),
            (("--model", "m" * 256), "--model: must be at most 255 characters"),
        ],
    )
    def test_bad_input_is_a_clear_command_error(self, alice_org, args, message):
        with pytest.raises(CommandError) as excinfo:
            create_key_command(*args)
        assert message in str(excinfo.value)
        assert "\n" not in str(excinfo.value).strip()
        assert not ApiKey.objects.exists()

    def test_the_command_line_prints_no_traceback(self):
        # Parsing fails before the database is touched, so the development settings do.
        result = subprocess.run(
            [sys.executable, "manage.py", "create_api_key", "--org", "x", "--name", "y", "--spend-cap", "abc"],
            cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120,
            env={**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings"},
        )  # fmt: skip
        assert result.returncode != 0
        assert "Traceback" not in result.stderr
        assert "--spend-cap" in result.stderr

    def test_an_expiry_in_the_past_is_refused(self, alice_org):
        with pytest.raises(ValueError, match="expires_at: must be in the future"):
            api_key_create(organization=alice_org, name="x", expires_at=datetime(2000, 1, 1, tzinfo=UTC))


class TestPlanAtAdmission:
    """Defect 1 of issue 18: a key is admitted only within its organisation's current plan,
    whatever it was created with, and rotation cannot carry a grant past the plan."""

    @pytest.fixture
    def downgraded(self, alice_org, django_user_model):
        from accounts.models import Membership, Role
        from accounts.services import organization_update

        big = api_key_create(
            organization=alice_org, name="big", tier="paid", rate_limit_rpm=10_000, rate_limit_tpm=10_000_000,
            max_concurrent=256,
        ).api_key  # fmt: skip
        organization_update(organization=alice_org, tier="free")
        admin = django_user_model.objects.create_user("alice-admin", password="pw")
        Membership.objects.create(user=admin, organization=alice_org, role=Role.ORG_ADMIN)
        return ApiKey.objects.select_related("organization").get(pk=big.pk), admin

    def test_an_old_key_is_admitted_within_the_plan_it_is_on_now(self, downgraded):
        from accounts.grants import KeyGrant

        key, _ = downgraded
        grant = KeyGrant.of(key)
        assert grant.tier == "free"
        # The seeded free plan: 60 RPM, 100,000 TPM, 4 at once.
        assert (grant.key_limits.rpm, grant.key_limits.tpm, grant.key_limits.concurrent) == (60, 100_000, 4)

    def test_rotation_keeps_the_plan_bounds(self, downgraded):
        from datetime import timedelta

        from accounts.services import api_key_rotate

        key, admin = downgraded
        with pytest.raises(ValueError, match="plan"):  # what the org admin may not create
            api_key_create(organization=key.organization, name="x", rate_limit_rpm=10_000, actor=admin)
        first = api_key_rotate(api_key=key, grace=timedelta(0), actor=admin).api_key
        second = api_key_rotate(api_key=first, grace=timedelta(0), actor=admin).api_key
        for rotated in (first, second):
            rotated.refresh_from_db()
            assert rotated.tier == "free"
            assert (rotated.rate_limit_rpm, rotated.rate_limit_tpm, rotated.max_concurrent) == (60, 100_000, 4)

    def test_a_key_with_no_limit_of_its_own_gets_the_ceiling(self, alice_org):
        from accounts.grants import KeyGrant
        from accounts.services import organization_update

        key = api_key_create(organization=alice_org, name="open", max_concurrent=None).api_key
        assert KeyGrant.of(key).key_limits.concurrent == 256  # the paid plan's ceiling
        organization_update(organization=alice_org, max_concurrent=3)
        key = ApiKey.objects.select_related("organization").get(pk=key.pk)
        assert KeyGrant.of(key).key_limits.concurrent == 3  # the organisation's own limit
