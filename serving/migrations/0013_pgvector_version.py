"""Refuse a database whose pgvector is older than 0.8 (an external PostgreSQL), with one
sentence saying what to do, instead of failing later on the semantic cache's searches."""

from typing import Any

from django.db import migrations

from core.db import pgvector_problem


def check_pgvector(apps: Any, schema_editor: Any) -> None:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        row = cursor.fetchone()
    problem = pgvector_problem(row[0] if row else None)
    if problem is not None:
        raise RuntimeError(problem)


class Migration(migrations.Migration):
    dependencies = [
        ("serving", "0012_input_files_expire"),
    ]

    operations = [migrations.RunPython(check_pgvector, migrations.RunPython.noop, elidable=False)]
