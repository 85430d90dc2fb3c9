"""Who is the platform's staff: the one check every API and page asks (``is_platform_admin``),
and the DRF permission that asks it (``IsPlatformAdmin``)."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.views import APIView

from accounts.models import Membership, Role


def is_platform_admin(user: Any) -> bool:
    """The ML team: superusers and anyone holding the platform-admin role."""
    if not getattr(user, "is_authenticated", False):
        return False
    return bool(user.is_superuser) or Membership.objects.filter(user=user, role=Role.PLATFORM_ADMIN).exists()


class IsPlatformAdmin(BasePermission):
    """Platform admins only (the ML team): the model registry, deployments, caches, shadows."""

    message = "Only platform admins may do this."

    def has_permission(self, request: Request, view: APIView) -> bool:
        return is_platform_admin(request.user)
