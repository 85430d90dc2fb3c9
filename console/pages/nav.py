"""The side navigation: each area module lists its own entries (``NAV``); this gathers them."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse

# The areas, in the order the navigation shows them; each is a module of this package with
# ``urlpatterns`` (paths from the site root) and ``NAV`` (a list of NavItem).
AREAS = (
    "overview", "registry", "deployments", "customers", "portal", "portal_members", "playground", "batches", "cache",
    "requests",
)  # fmt: skip

CONSOLE = "console"  # pages for platform admins, under /console/
PORTAL = "portal"  # pages of one organisation, under /portal/<org_id>/


@dataclass(frozen=True)
class NavItem:
    label: str
    url_name: str  # in the "console" namespace
    section: str  # CONSOLE or PORTAL
    admin_only: bool = False  # PORTAL: only the organisation's admins see it


def area_modules() -> list[Any]:
    return [importlib.import_module(f"console.pages.{area}") for area in AREAS]


def _link(item: NavItem, org_id: int | None) -> str | None:
    kwargs = {"org_id": org_id} if item.section == PORTAL else {}
    if item.section == PORTAL and org_id is None:
        return None
    try:
        return reverse(f"console:{item.url_name}", kwargs=kwargs)
    except NoReverseMatch:
        return None


def navigation(request: HttpRequest) -> dict[str, Any]:
    """Template context processor: ``nav`` = {"console": [...], "portal": [...]} of the links
    this user may follow, each {"label", "url", "active"}; ``portal_org`` = the organisation
    the portal links point at (the one in the URL, else the user's first)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    from accounts.models import Role
    from accounts.permissions import is_platform_admin
    from accounts.selectors import organizations_visible_to, role_in

    platform_admin = is_platform_admin(user)
    match = getattr(request, "resolver_match", None)
    org_id = match.kwargs.get("org_id") if match is not None else None
    organization = None
    if org_id is not None:
        organization = organizations_visible_to(user).filter(pk=org_id).first()
    if organization is None and not platform_admin:
        organization = organizations_visible_to(user).order_by("name").first()
    role = role_in(user, organization) if organization is not None else None
    org_admin = role in (Role.ORG_ADMIN, Role.PLATFORM_ADMIN)
    current = request.path
    nav: dict[str, list[dict[str, Any]]] = {CONSOLE: [], PORTAL: []}
    for module in area_modules():
        for item in getattr(module, "NAV", []):
            if item.section == CONSOLE and not platform_admin:
                continue
            if item.section == PORTAL and (organization is None or (item.admin_only and not org_admin)):
                continue
            url = _link(item, organization.pk if organization is not None else None)
            if url is not None:
                nav[item.section].append({"label": item.label, "url": url, "active": False})
    # A platform admin on an organisation's pages sees both lists: the console's pages that span
    # every organisation say so, beside the organisation's own of the same name.
    own = {link["label"] for link in nav[PORTAL]}
    for link in nav[CONSOLE]:
        if link["label"] in own:
            link["label"] = f"All {link['label'].lower()}"
    # The current page is the longest link it lies under (/portal/1/ is a prefix of every portal page).
    under = [link for links in nav.values() for link in links if current.startswith(link["url"])]
    if under:
        max(under, key=lambda link: len(link["url"]))["active"] = True
    # Another organisation to switch to: any, for a platform admin; else a second membership.
    can_switch = organization is not None and (platform_admin or organizations_visible_to(user)[:2].count() > 1)
    return {"nav": nav, "portal_org": organization, "platform_admin": platform_admin, "can_switch": can_switch}
