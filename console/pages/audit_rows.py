"""An audit entry as the console shows it: a creation in one line, an update as the fields it
changed (before → after), its target linked to the page that shows it, its actor named."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from django.template.defaultfilters import filesizeformat
from django.urls import reverse

from registry.audit_selectors import AuditTarget, TargetPlace, audit_target_places
from registry.models import AuditEntry
from registry.services import SYSTEM_ACTOR_NAMES


@dataclass(frozen=True)
class Change:
    field: str
    before: str
    after: str


@dataclass(frozen=True)
class AuditRow:
    entry: AuditEntry
    summary: str  # one line: what a creation made, a deletion removed, or why (a decision's reasons)
    changes: list[Change]  # an update's fields that changed, nested ones as a.b
    record: list[Change]  # a creation's (or deletion's) whole record, shown folded
    target_label: str  # "deployment #12"
    target_url: str | None  # its console page; None when it was deleted or has none
    target_filter: str  # "deployment:12": the log of this target and what is under it; "" if none
    actor: str
    system: bool  # the actor is a part of the platform (canary controller, autoscaler, ...)


def _show(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A JSON object's leaves by dotted path ({"autoscale": {"enabled": true}} → autoscale.enabled)."""
    if not isinstance(value, dict):
        return {} if value is None else {"value": value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(item, dict) and item:
            out.update(_flat(item, path))
        else:
            out[path] = item
    return out


def _plural(count: Any, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _created(entry: AuditEntry, after: dict[str, Any]) -> str:
    """One line for an entry with no before: what was made, or what happened."""
    action, get = entry.action, after.get
    if action == "model.create":
        return f"created model {get('name', entry.target)} ({get('task', '?')})"
    if action == "model_version.register":
        sha = str(get("artifact_sha256") or "")
        size = get("artifact_size")
        facts = [f"sha256 {sha[:4]}…" if sha else "", filesizeformat(size) if isinstance(size, int) else ""]
        details = ", ".join(fact for fact in facts if fact)
        return f"registered {get('model', '?')} {get('version', '?')}" + (f" ({details})" if details else "")
    if action == "deployment.create":
        line = (
            f"deployed {get('model', '?')} {get('version', '?')}: {_plural(get('replicas'), 'replica')} "
            f"(min {get('min_replicas')}, max {get('max_replicas')}), {get('traffic_weight', 0)} % of traffic"
        )
        return line + (", canary" if get("is_canary") else "") + (f", GPU {get('gpu_type')}" if get("gpu_type") else "")
    if action == "canary.create":
        steps = " → ".join(str(step) for step in get("steps") or [])
        line = (
            f"started a canary of {get('model', entry.target)}: {get('canary_version')} against "
            f"{get('base_version')}, steps {steps} %, judged every {get('interval_seconds')} s"
        )
        return line + (", promoted at the end by itself" if get("auto_promote") else "")
    if action == "replica.ready":
        seconds = get("load_seconds")
        took = f" in {seconds:.1f} s" if isinstance(seconds, int | float) else ""
        return f"{get('model', '?')} {get('version', '?')} ready on {get('host', '?')}{took}"
    if action == "bundled.import":
        return "started an import of the bundled models" + (", rebuilding every one" if get("force") else "")
    if action == "shadow.set":
        line = f"mirrors {get('percent')} % of the requests to version {get('candidate')}"
        return line + ("" if get("enabled", True) else " (disabled)")
    if action == "deployment.swap.done":
        outcome, reason = get("outcome", "closed"), get("reason")
        return f"hot-swap {outcome}" + (f": {reason}" if reason and reason != outcome else "")
    facts = [f"{key} {_show(value)}" for key, value in _flat(after).items() if not isinstance(value, list)][:4]
    return f"{action}: " + ", ".join(facts) if facts else action


def _removed(entry: AuditEntry, before: dict[str, Any], label: str) -> str:
    if entry.action == "shadow.delete":
        return f"stopped mirroring requests to version {before.get('candidate')}"
    return f"removed {label}"


def _target(entry: AuditEntry, place: TargetPlace | None) -> tuple[str, str | None]:
    """The target in words and its console page (None: deleted, or no page shows it)."""
    kind, key = entry.target_type, entry.target
    if entry.action == "bundled.import":
        return "the bundled models", reverse("console:bundled-models")
    if entry.action == "price.set":
        return f"the price of {key}", f"{reverse('console:prices')}?{urlencode({'model': key})}" if place else None
    if kind == "model":
        url = f"{reverse('console:models')}?{urlencode({'q': key})}" if place else None
        return f"model {key}", url
    if kind == "model_version":
        name, _, version = key.partition(":")
        url = reverse("console:model-version", args=[name, version]) if place else None
        return f"version {key}", url
    if kind == "deployment":
        if place is None:
            return f"deployment #{key}", None
        query = {"model": place.model, **({"stopped": "1"} if place.stopped else {})}
        return f"deployment #{key}", f"{reverse('console:deployments')}?{urlencode(query)}#deployment-{key}"
    if kind == "replica":
        if place is None or place.version is None:
            return f"replica #{key}", None
        return f"replica #{key}", f"{reverse('console:model-version', args=[place.model, place.version])}#replica-{key}"
    if kind == "canary":
        return f"canary of {key}", reverse("console:canary", args=[key]) if place else None
    return f"{kind} {key}", None


def audit_row(entry: AuditEntry, place: TargetPlace | None) -> AuditRow:
    before = entry.before if isinstance(entry.before, dict) else None
    after = entry.after if isinstance(entry.after, dict) else None
    label, url = _target(entry, place)
    summary, changes, record = "", [], []
    if before is None:
        summary = _created(entry, after or {})
        record = [Change(field, "", _show(value)) for field, value in _flat(after).items()]
    elif after is None:
        summary = _removed(entry, before, label)
        record = [Change(field, _show(value), "") for field, value in _flat(before).items()]
    else:
        reasons = after.get("reasons")
        if "reasons" not in before and isinstance(reasons, list):
            summary = "; ".join(str(reason) for reason in reasons)
        old, new = _flat(before), _flat({k: v for k, v in after.items() if not (k == "reasons" and summary)})
        fields = [*old, *(name for name in new if name not in old)]
        changes = [
            Change(name, _show(old.get(name)), _show(new.get(name)))
            for name in fields
            # A figure added empty (an autoscale entry's observations from a person) says nothing.
            if old.get(name, ...) != new.get(name, ...) and (name in old or new.get(name) not in (None, {}, []))
        ]
    target = AuditTarget.parse(f"{entry.target_type}:{entry.target}")
    system = entry.actor_id is None and entry.actor_name in SYSTEM_ACTOR_NAMES
    return AuditRow(
        entry=entry,
        summary=summary,
        changes=changes,
        record=record,
        target_label=label,
        target_url=url,
        target_filter=str(target) if target is not None else "",
        actor=entry.actor_name or "the operator",
        system=system,
    )


def audit_rows(entries: Iterable[AuditEntry]) -> list[AuditRow]:
    """The rows of ``entries``, their targets looked up together (a few queries a page)."""
    entries = list(entries)
    places = audit_target_places(entries=entries)
    return [audit_row(entry, places.get((entry.target_type, entry.target))) for entry in entries]


def describe_target(text: str) -> str:
    """A target filter in words: what the log shows with it."""
    target = AuditTarget.parse(text)
    if target is None:
        return f"target {text}"
    return {
        "model": f"model {target.key} and everything under it",
        "model_version": f"version {target.key} with its deployments and replicas",
        "deployment": f"deployment #{target.key} and its replicas",
        "replica": f"replica #{target.key}",
        "canary": f"the canaries of {target.key}",
    }[target.type]
