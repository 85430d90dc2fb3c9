"""Writes of shadow traffic that operators start: set or remove a model's shadow policy (audited)."""

from __future__ import annotations

import logging
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import transaction

from core.errors import InvalidInput
from core.events import publish_routing_change
from registry.models import Model, ModelVersion
from registry.selectors import model_traffic_split
from registry.services import Actor, audit_record
from serving.gateway.models import ShadowPolicy

logger = logging.getLogger(__name__)


def _shadow_snapshot(policy: ShadowPolicy | None) -> dict[str, Any] | None:
    if policy is None:
        return None
    return {"candidate": policy.candidate.version, "percent": str(policy.percent), "enabled": policy.enabled}


def shadow_policy_set(
    *, model: Model, candidate: ModelVersion, percent: Decimal | int | str, enabled: bool = True, actor: Actor = None
) -> ShadowPolicy:
    """Mirror ``percent`` % of ``model``'s requests to ``candidate`` (see ``serving.shadow.traffic``),
    replacing the model's policy if it has one; every gateway applies it at once. Audited.

    Refused (``InvalidInput`` on ``candidate``) for a version of another model, and for the
    version taking all of the model's traffic: the primary of every request, never mirrored to."""
    if candidate.model_id != model.pk:
        raise InvalidInput("candidate", f"Version {candidate.version} is not a version of {model.name}.")
    # A request is mirrored only when it was routed to another version (serving.shadow.traffic).
    split = model_traffic_split(model=model)
    if split.get(candidate.version, 0) > 0 and not any(w > 0 for v, w in split.items() if v != candidate.version):
        raise InvalidInput(
            "candidate",
            f"{model.name}:{candidate.version} answers every request of {model.name} itself, so no copy would "
            "go to it: mirror to a version that takes no traffic, or only part of it.",
        )
    try:
        share = Decimal(str(percent))
    except InvalidOperation:
        raise InvalidInput("percent", "Give a number from 0 to 100.") from None
    if not share.is_finite() or not 0 <= share <= 100 or share != share.quantize(Decimal("0.01")):
        raise InvalidInput("percent", "Give a number from 0 to 100, with at most two decimals.")
    share = share.quantize(Decimal("0.01"))
    with transaction.atomic():
        before = ShadowPolicy.objects.select_related("candidate").select_for_update().filter(model=model).first()
        snapshot = _shadow_snapshot(before)
        policy, _ = ShadowPolicy.objects.update_or_create(
            model=model, defaults={"candidate": candidate, "percent": share, "enabled": enabled}
        )
        audit_record(actor=actor, action="shadow.set", target_type="model", target=model.name, before=snapshot,
                     after=_shadow_snapshot(policy))  # fmt: skip
        publish_routing_change("shadow")
    return policy


def shadow_policy_delete(*, model: Model, actor: Actor = None) -> bool:
    """Stop mirroring ``model``'s requests; False if it had no policy. Audited."""
    with transaction.atomic():
        policy = ShadowPolicy.objects.select_related("candidate").select_for_update().filter(model=model).first()
        if policy is None:
            return False
        snapshot = _shadow_snapshot(policy)
        policy.delete()
        audit_record(actor=actor, action="shadow.delete", target_type="model", target=model.name, before=snapshot,
                     after=None)  # fmt: skip
        publish_routing_change("shadow")
    return True
