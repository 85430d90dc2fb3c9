"""Reads for accounts (organisations, members, invitations, keys, plans), always scoped to
what the asking user may see."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import Count, Q, QuerySet

from accounts.models import CAP_FIELDS, ApiKey, Invitation, Membership, Organization, Plan, Role, Tier
from accounts.permissions import is_platform_admin


def api_key_by_hash(*, key_hash: str) -> ApiKey | None:
    return ApiKey.objects.select_related("organization").filter(key_hash=key_hash).first()


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
KEY_CEILING_FIELDS = CAP_FIELDS


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


def invitations_pending_for(user: Any) -> QuerySet[Invitation]:
    """The invitations waiting for ``user`` to accept them (matched by username)."""
    return (
        Invitation.objects.filter(username=user.get_username(), accepted_at__isnull=True)
        .select_related("organization", "invited_by")
        .order_by("-created_at")
    )


def invitations_pending_of(*, organization_id: int) -> QuerySet[Invitation]:
    """An organisation's invitations not yet accepted, newest first (for its admins: they
    list the usernames invited, which say nothing of which usernames exist)."""
    return (
        Invitation.objects.filter(organization_id=organization_id, accepted_at__isnull=True)
        .select_related("invited_by")
        .order_by("-created_at", "-pk")
    )


def api_keys_of(*, organization_id: int) -> QuerySet[ApiKey]:
    """An organisation's keys, newest first (revoked and rotated ones included)."""
    return ApiKey.objects.filter(organization_id=organization_id).select_related("rotated_to").order_by("-created_at")


def organizations_listed(*, q: str = "", tier: str = "") -> QuerySet[Organization]:
    """Organisations by name, with ``member_count`` and ``active_key_count``; ``q`` matches
    the name or slug, ``tier`` one tier."""
    found = Organization.objects.all()
    if q:
        found = found.filter(Q(name__icontains=q) | Q(slug__icontains=q))
    if tier:
        found = found.filter(tier=tier)
    return found.annotate(
        member_count=Count("memberships", distinct=True),
        active_key_count=Count("api_keys", filter=Q(api_keys__is_active=True), distinct=True),
    ).order_by("name")


def memberships_of(*, organization_id: int) -> QuerySet[Membership]:
    """An organisation's members, by username."""
    return Membership.objects.filter(organization_id=organization_id).select_related("user").order_by("user__username")


def membership_of(*, organization_id: int, username: str) -> Membership | None:
    return memberships_of(organization_id=organization_id).filter(user__username=username).first()


def user_named(*, username: str) -> Any:
    """The user with this username, or None."""
    return get_user_model().objects.filter(username=username).first()
