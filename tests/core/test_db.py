"""The database the platform needs: pgvector 0.8 or newer (an external PostgreSQL may have less)."""

from __future__ import annotations

import pytest
from django.db import connection

from core.db import pgvector_problem


@pytest.mark.parametrize("version", ["0.8.0", "0.8.5", "0.9", "1.0.1"])
def test_pgvector_from_0_8_is_enough(version: str) -> None:
    assert pgvector_problem(version) is None


@pytest.mark.parametrize("version", ["0.7.4", "0.5.1", "0.1"])
def test_an_older_pgvector_is_refused_saying_what_to_do(version: str) -> None:
    problem = pgvector_problem(version)
    assert problem is not None
    assert f"pgvector {version} is installed" in problem
    assert "0.8 or newer" in problem
    assert "ALTER EXTENSION vector UPDATE" in problem


def test_no_or_an_unreadable_pgvector_is_refused() -> None:
    assert "not installed" in str(pgvector_problem(None))
    assert "cannot be read" in str(pgvector_problem("dev-build"))


@pytest.mark.django_db
def test_the_test_database_passed_the_migrations_check() -> None:
    from django.db.migrations.recorder import MigrationRecorder

    assert MigrationRecorder.Migration.objects.filter(app="serving", name="0013_pgvector_version").exists()
    with connection.cursor() as cursor:
        cursor.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        (version,) = cursor.fetchone()
    assert pgvector_problem(version) is None
