"""Reads for accounts, always scoped to what the asking user may see."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from billing.models import ApiKey, Membership, Organization, Role


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
