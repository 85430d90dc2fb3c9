"""Who may open a page: platform admins for the console, an organisation's members for its portal.

Anonymous visitors go to the login page; a signed-in user without the right gets 403, and
an organisation the user does not belong to is a 404 (its existence is not disclosed).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar, cast

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponseBase
from django.shortcuts import get_object_or_404

from accounts.models import Organization, Role
from accounts.permissions import is_platform_admin
from accounts.selectors import role_in

View = TypeVar("View", bound=Callable[..., HttpResponseBase])


class OrgRequest(HttpRequest):
    """The request of a portal page: ``org_member_required`` sets who it is for."""

    organization: Organization
    org_role: str


# Roles allowed to manage an organisation (keys of every member, budgets, invoices).
ORG_ADMIN_ROLES = frozenset({Role.ORG_ADMIN, Role.PLATFORM_ADMIN})


def platform_admin_required(view: View) -> View:
    """The console's pages: platform admins (superusers or the platform-admin role) only."""

    @wraps(view)
    def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not is_platform_admin(request.user):
            raise PermissionDenied("Platform admins only.")
        return view(request, *args, **kwargs)

    return cast(View, guarded)


def org_member_required(*, admin: bool = False) -> Callable[[View], View]:
    """The portal's pages, under ``/portal/<org_id>/``: members of that organisation (platform
    admins act as its admin). ``admin=True``: its org admins only. The view gets an
    ``OrgRequest``: ``request.organization`` and ``request.org_role`` are set."""

    def decorate(view: View) -> View:
        @wraps(view)
        def guarded(request: HttpRequest, org_id: int, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            organization = get_object_or_404(Organization, pk=org_id)
            role = role_in(request.user, organization)
            if role is None:
                raise Http404("No such organisation.")
            if admin and role not in ORG_ADMIN_ROLES:
                raise PermissionDenied("Organisation admins only.")
            scoped = cast(OrgRequest, request)
            scoped.organization, scoped.org_role = organization, role
            return view(scoped, *args, org_id=org_id, **kwargs)

        return cast(View, guarded)

    return decorate
