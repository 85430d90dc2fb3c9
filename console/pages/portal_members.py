"""The customer portal's members: who belongs to an organisation, its invitations, and answering one's own.

Who may do what follows the management API (accounts/api.py): every member sees the
organisation's members; its admins invite usernames (answered alike whether or not the
username exists, so the portal never tells a tenant which usernames are taken), cancel
pending invitations, change roles and remove members, never the last org admin
(accounts.services.LastOrgAdmin). Anyone signed in accepts or declines the
invitations addressed to them, from the portal's home page.
"""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import URLPattern, URLResolver, path
from django.views.decorators.http import require_http_methods, require_POST

from accounts.models import INVITABLE_ROLES, Invitation, Membership, Role
from accounts.selectors import invitations_pending_for, invitations_pending_of, memberships_of
from accounts.services import (
    USERNAME_MAX_LENGTH,
    invitation_accept,
    invitation_cancel,
    invitation_create,
    invitation_decline,
    membership_remove,
    membership_set,
)
from console.pages.access import ORG_ADMIN_ROLES, OrgRequest, org_member_required
from console.pages.lists import page_of, query_without_page, refuse
from console.pages.nav import PORTAL, NavItem
from core.errors import InvalidInput

MEMBERS_PER_PAGE = 25
INVITATIONS_PER_PAGE = 25


class MemberFilterForm(forms.Form):
    q = forms.CharField(label="Username", required=False, max_length=USERNAME_MAX_LENGTH)


class InviteForm(forms.Form):
    username = forms.CharField(
        label="Username",
        max_length=USERNAME_MAX_LENGTH,
        help_text="They see the invitation when they sign in, and accept or decline it.",
    )
    role = forms.ChoiceField(label="Role", choices=INVITABLE_ROLES, initial=Role.ORG_MEMBER)


class RoleForm(forms.Form):
    role = forms.ChoiceField(label="Role", choices=INVITABLE_ROLES)


def _is_admin(request: OrgRequest) -> bool:
    return request.org_role in ORG_ADMIN_ROLES


def _back_to_members(org_id: int) -> HttpResponse:
    return redirect("console:portal-members", org_id=org_id)


# --- The members page ------------------------------------------------------------------


def _members_page(request: OrgRequest, invite_form: InviteForm | None = None) -> HttpResponse:
    organization = request.organization
    can_manage = _is_admin(request)
    members = memberships_of(organization_id=organization.pk)
    invitations = invitations_pending_of(organization_id=organization.pk)
    form = MemberFilterForm(request.GET or None)
    if form.is_valid() and (text := form.cleaned_data["q"].strip()):
        members = members.filter(user__username__icontains=text)
        invitations = invitations.filter(username__icontains=text)
    member_page = page_of(request, members, MEMBERS_PER_PAGE)
    context = {
        "organization": organization,
        "form": form,
        "page": member_page,
        "query": query_without_page(request),
        "can_manage": can_manage,
        "roles": INVITABLE_ROLES,
    }
    if can_manage:  # members do not see who is invited (nor does the API show them)
        context |= {
            "invite_form": invite_form or InviteForm(),
            "invitations": page_of(request, invitations, INVITATIONS_PER_PAGE, "invitations_page"),
            "invitations_query": query_without_page(request, "invitations_page"),
        }
    return render(request, "console/portal/members.html", context)


@org_member_required()
def members(request: OrgRequest, org_id: int) -> HttpResponse:
    """The organisation's members with their roles; for its admins, invitations and changes."""
    return _members_page(request)


@org_member_required(admin=True)
@require_POST
def member_invite(request: OrgRequest, org_id: int) -> HttpResponse:
    """Invite a username with a role: the same answer whether or not the username exists."""
    form = InviteForm(request.POST)
    if form.is_valid():
        username, role = form.cleaned_data["username"].strip(), form.cleaned_data["role"]
        try:
            invitation = invitation_create(
                organization=request.organization,
                username=username,
                role=role,
                actor=request.user,
            )
        except InvalidInput as exc:
            refuse(form, exc)
        except PermissionDenied as exc:  # a platform admin's membership: only they change it
            form.add_error("username", str(exc))
        else:
            messages.success(
                request,
                f"{invitation.username} is invited as {invitation.get_role_display()}; "
                "they join when they accept the invitation after signing in.",
            )
            return _back_to_members(org_id)
    messages.error(request, "Nobody was invited: see the errors below.")
    return _members_page(request, invite_form=form)


def _membership_of(request: OrgRequest, membership_id: int) -> Membership:
    organization = request.organization
    return get_object_or_404(memberships_of(organization_id=organization.pk), pk=membership_id)


@org_member_required(admin=True)
@require_POST
def member_role(request: OrgRequest, org_id: int, membership_id: int) -> HttpResponse:
    """Make a member an org admin or a plain member (never the last org admin a member)."""
    membership = _membership_of(request, membership_id)
    username = membership.user.get_username()
    form = RoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"The role of {username} was not changed: choose Org admin or Org member.")
        return _back_to_members(org_id)
    try:
        changed = membership_set(
            user=membership.user,
            organization=request.organization,
            role=form.cleaned_data["role"],
            actor=request.user,
        )
    except (InvalidInput, PermissionDenied) as exc:  # the last org admin, or a platform admin's membership
        messages.error(request, f"The role of {username} was not changed. {_reason(exc)}")
    else:
        messages.success(request, f"{username} is now {changed.get_role_display()}.")
    return _back_to_members(org_id)


@org_member_required(admin=True)
@require_http_methods(["GET", "POST"])
def member_remove(request: OrgRequest, org_id: int, membership_id: int) -> HttpResponse:
    """GET: are you sure? POST: remove the member (never the last org admin)."""
    membership = _membership_of(request, membership_id)
    organization = request.organization
    username = membership.user.get_username()
    leaving = membership.user_id == request.user.pk
    if request.method == "POST":
        try:
            membership_remove(membership=membership, actor=request.user)
        except PermissionDenied as exc:
            messages.error(request, f"{username} was not removed. {_reason(exc)}")
            return _back_to_members(org_id)
        if leaving:
            messages.success(request, f"You left {organization.name}.")
            return redirect("console:portal-home")
        messages.success(request, f"{username} removed from {organization.name}.")
        return _back_to_members(org_id)
    context = {"organization": organization, "membership": membership, "leaving": leaving}
    return render(request, "console/portal/member_remove.html", context)


@org_member_required(admin=True)
@require_POST
def invitation_withdraw(request: OrgRequest, org_id: int, invitation_id: int) -> HttpResponse:
    """Cancel a pending invitation of this organisation."""
    organization = request.organization
    invitation = get_object_or_404(invitations_pending_of(organization_id=organization.pk), pk=invitation_id)
    try:
        invitation_cancel(invitation=invitation, actor=request.user)
    except InvalidInput as exc:  # accepted or cancelled meanwhile
        messages.info(request, f"The invitation of {invitation.username} is no longer pending: {exc.message}.")
    else:
        messages.success(request, f"The invitation of {invitation.username} is cancelled.")
    return _back_to_members(org_id)


def _reason(exc: Exception) -> str:
    text = exc.message if isinstance(exc, InvalidInput) else str(exc)
    return text if text.endswith(".") else f"{text}."


# --- The invitations addressed to the signed-in user (shown on the portal's home) ------


def _invitation_for(request: HttpRequest, invitation_id: int) -> Invitation:
    """A pending invitation addressed to this user; anyone else's is a 404."""
    return get_object_or_404(invitations_pending_for(request.user), pk=invitation_id)


@login_required
@require_POST
def invitation_answer_accept(request: HttpRequest, invitation_id: int) -> HttpResponse:
    """Join the organisation with the invited role, and land on its portal."""
    invitation = _invitation_for(request, invitation_id)
    assert isinstance(request.user, AbstractBaseUser)
    try:
        membership = invitation_accept(invitation=invitation, user=request.user)
    except InvalidInput as exc:
        messages.error(request, f"The invitation could not be accepted: {exc.message}.")
        return redirect("console:portal-home")
    organization = invitation.organization
    messages.success(request, f"Welcome to {organization.name}: you are {membership.get_role_display()}.")
    return redirect("console:portal-usage", org_id=organization.pk)


@login_required
@require_POST
def invitation_answer_decline(request: HttpRequest, invitation_id: int) -> HttpResponse:
    invitation = _invitation_for(request, invitation_id)
    assert isinstance(request.user, AbstractBaseUser)
    try:
        invitation_decline(invitation=invitation, user=request.user)
    except InvalidInput as exc:
        messages.error(request, f"The invitation could not be declined: {exc.message}.")
    else:
        messages.success(request, f"You declined the invitation to {invitation.organization.name}.")
    return redirect("console:portal-home")


P = "portal/<int:org_id>/"
urlpatterns: list[URLPattern | URLResolver] = [
    path(f"{P}members/", members, name="portal-members"),
    path(f"{P}members/invite/", member_invite, name="portal-member-invite"),
    path(f"{P}members/<int:membership_id>/role/", member_role, name="portal-member-role"),
    path(f"{P}members/<int:membership_id>/remove/", member_remove, name="portal-member-remove"),
    path(f"{P}invitations/<int:invitation_id>/cancel/", invitation_withdraw, name="portal-invitation-cancel"),
    path("portal/invitations/<int:invitation_id>/accept/", invitation_answer_accept, name="portal-invitation-accept"),
    path(
        "portal/invitations/<int:invitation_id>/decline/", invitation_answer_decline, name="portal-invitation-decline"
    ),
]
NAV: list[NavItem] = [
    NavItem("Members", "portal-members", PORTAL),
]
