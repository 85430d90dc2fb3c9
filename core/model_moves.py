"""Moving models between apps without moving their tables (issue 19's accounts/ and rollout/).

The models' state moves with ``SeparateDatabaseAndState``; this keeps their content types
(and so permissions and admin history) by renaming the content types' app label, both ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import migrations


def move_content_types(models: Sequence[str], *, source: str, target: str) -> migrations.RunPython:
    """A migration step moving the content types of ``models`` (lower-case names) from app
    ``source`` to app ``target``; reversed, back again."""

    def between(to: str, other: str) -> Any:
        def move(apps: Any, schema_editor: Any) -> None:
            content_type = apps.get_model("contenttypes", "ContentType")
            for model in models:
                if not content_type.objects.filter(app_label=to, model=model).exists():
                    content_type.objects.filter(app_label=other, model=model).update(app_label=to)

        return move

    return migrations.RunPython(between(target, source), between(source, target))
