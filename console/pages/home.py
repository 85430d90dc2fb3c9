"""Where a signed-in user lands: platform admins in the console, everyone else in their portal."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import NoReverseMatch, reverse

from accounts.permissions import is_platform_admin
from accounts.selectors import invitations_pending_for, organizations_visible_to
from console.pages.lists import page_of, query_without_page

INVITATIONS_PER_PAGE = 25
ORGANIZATIONS_PER_PAGE = 25


@login_required
def home(request: HttpRequest) -> HttpResponse:
    if is_platform_admin(request.user):
        return redirect("console:overview")
    return redirect("console:portal-home")


@login_required
def portal_home(request: HttpRequest) -> HttpResponse:
    """One organisation: straight to its portal; several: pick one; none: say how to get in.
    Invitations waiting for this user are shown first, to accept or decline (no redirect then)."""
    visible = organizations_visible_to(request.user).order_by("name")
    invitations = page_of(request, invitations_pending_for(request.user), INVITATIONS_PER_PAGE, "invitations_page")
    if not invitations.object_list and not is_platform_admin(request.user):
        only = list(visible[:2])
        if len(only) == 1:
            try:
                return redirect(reverse("console:portal-usage", kwargs={"org_id": only[0].pk}))
            except NoReverseMatch:  # the portal's pages are not installed
                pass
    q = request.GET.get("q", "").strip()
    organizations = page_of(request, visible.filter(name__icontains=q) if q else visible, ORGANIZATIONS_PER_PAGE)
    context = {"organizations": organizations, "invitations": invitations, "q": q, "query": query_without_page(request)}
    return render(request, "console/portal_home.html", context)
