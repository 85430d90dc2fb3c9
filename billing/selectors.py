"""Reads for accounts, always scoped to what the asking user may see."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone

from billing.models import ApiKey, BudgetAlert, Invitation, Membership, Organization, Plan, Price, Role, Tier


def api_key_by_hash(*, key_hash: str) -> ApiKey | None:
    return ApiKey.objects.select_related("organization").filter(key_hash=key_hash).first()


def is_platform_admin(user: Any) -> bool:
    """The ML team: superusers and anyone holding the platform-admin role."""
    if not getattr(user, "is_authenticated", False):
        return False
    return bool(user.is_superuser) or Membership.objects.filter(user=user, role=Role.PLATFORM_ADMIN).exists()


def organizations_visible_to(user: Any) -> QuerySet[Organization]:
    if is_platform_admin(user):
        return Organization.objects.all()
    return Organization.objects.filter(memberships__user=user).distinct()


def role_in(user: Any, organization: Organization) -> str | None:
    """The user's role in ``organization`` (platform admins act as its admin), or None."""
    if is_platform_admin(user):
        return Role.PLATFORM_ADMIN
    membership = Membership.objects.filter(user=user, organization=organization).first()
    return membership.role if membership else None


# Limits a key may have, each capped by its organisation's plan (money is Decimal).
KEY_CEILING_FIELDS = ("rate_limit_rpm", "rate_limit_tpm", "max_concurrent", "monthly_token_quota", "monthly_spend_cap")
# Tiers in order: a key's tier is at most its organisation's.
TIER_RANK = {Tier.FREE: 0, Tier.PAID: 1}


def plan_key_ceilings(*, organization: Organization) -> dict[str, int | Decimal | None]:
    """The most a key of ``organization`` may have of each limit, unless a platform admin sets it.

    The plan is the organisation's own limit where a platform admin set one, else the
    ceiling of its tier's ``Plan``; None means no ceiling.
    """
    plan = Plan.objects.filter(tier=organization.tier).first()
    ceilings: dict[str, int | Decimal | None] = {}
    for field in KEY_CEILING_FIELDS:
        own = getattr(organization, field)
        ceilings[field] = own if own is not None else (getattr(plan, field) if plan is not None else None)
    return ceilings


def prices_in_effect_or_later(*, model_ids: list[int]) -> QuerySet[Price]:
    """Prices of these models that apply now or will (the routing table keeps them all)."""
    now = timezone.now()
    return Price.objects.filter(model_id__in=model_ids).exclude(effective_to__lte=now).order_by("-effective_from")


def invitations_pending_for(user: Any) -> QuerySet[Invitation]:
    """The invitations waiting for ``user`` to accept them (matched by username)."""
    return (
        Invitation.objects.filter(username=user.get_username(), accepted_at__isnull=True)
        .select_related("organization", "invited_by")
        .order_by("-created_at")
    )


def api_keys_of(*, organization_id: int) -> QuerySet[ApiKey]:
    """An organisation's keys, newest first (revoked and rotated ones included)."""
    return ApiKey.objects.filter(organization_id=organization_id).select_related("rotated_to").order_by("-created_at")


def budget_alerts_of(*, organization_id: int, month: str) -> QuerySet[BudgetAlert]:
    """The budget alerts an organisation (or one of its keys) crossed in ``month`` (YYYY-MM, UTC)."""
    return (
        BudgetAlert.objects.filter(organization_id=organization_id, month=month)
        .select_related("api_key")
        .order_by("-created_at")
    )
