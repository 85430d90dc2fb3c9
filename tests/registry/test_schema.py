from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = pytest.mark.django_db


class TestMigrations:
    def test_all_migrations_are_applied(self):
        executor = MigrationExecutor(connection)
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
        assert plan == []

    def test_models_match_migrations(self):
        out = StringIO()
        # Exits with SystemExit(1) when a model change has no migration.
        call_command("makemigrations", "--check", "--dry-run", stdout=out)
        assert "No changes detected" in out.getvalue()

    def test_vector_extension_exists(self):
        with connection.cursor() as cursor:
            cursor.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
            row = cursor.fetchone()
        assert row is not None
        major, minor = (int(part) for part in row[0].split(".")[:2])
        assert (major, minor) >= (0, 8)

    def test_vector_type_works(self):
        with connection.cursor() as cursor:
            cursor.execute("SELECT '[1,2,2]'::vector <=> '[2,4,4]'::vector")
            (distance,) = cursor.fetchone()
        assert distance == pytest.approx(0.0, abs=1e-6)
