"""The one guard for status fields that move by a transition table.

A model with such a field declares ``TRANSITIONS`` (current value → the values it may move
to); every move goes through ``transition`` (which locks the row and checks the *stored*
value, so two callers cannot both make a move that is only legal from the same state) or,
for a row its caller has locked already, ``check_transition``. Used by the registry
(versions, deployments, replicas), rollout (canaries) and billing (invoices).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from django.db import models, transaction

M = TypeVar("M", bound=models.Model)


class IllegalTransition(Exception):
    """A status change that the object's transition table does not allow."""

    def __init__(self, obj: models.Model, field: str, current: str, target: str) -> None:
        self.current = current
        self.target = target
        super().__init__(f"{type(obj).__name__} {obj.pk}: {field} cannot go from {current!r} to {target!r}")


def _table(obj: models.Model) -> Mapping[str, frozenset[str]]:
    table: Mapping[str, frozenset[str]] = type(obj).TRANSITIONS  # type: ignore[attr-defined]
    return table


def check_transition(obj: models.Model, target: str, *, field: str = "status") -> None:
    """Refuse (``IllegalTransition``) a move of ``obj.<field>`` to ``target`` that its model's
    table does not allow from the value ``obj`` holds, and set it. For a row the caller
    locked (``select_for_update``) in the transaction that will save it."""
    current = getattr(obj, field)
    if target not in _table(obj).get(current, frozenset()):
        raise IllegalTransition(obj, field, current, target)
    setattr(obj, field, target)


def transition(obj: M, target: str, *, field: str = "status", **fields: Any) -> M:
    """Move ``obj.<field>`` to ``target`` if the table allows it from the stored value, with
    ``fields`` written in the same UPDATE (and any ``auto_now`` field), atomically.

    Returns the row as locked and written; ``obj`` gets the values written too."""
    model_cls = type(obj)
    with transaction.atomic():
        locked = model_cls._default_manager.select_for_update().get(pk=obj.pk)
        check_transition(locked, target, field=field)
        for name, value in fields.items():
            setattr(locked, name, value)
        stamped = [f.name for f in model_cls._meta.concrete_fields if getattr(f, "auto_now", False)]
        locked.save(update_fields=[field, *fields, *stamped])
    for name in (field, *fields, *stamped):
        setattr(obj, name, getattr(locked, name))
    return locked
