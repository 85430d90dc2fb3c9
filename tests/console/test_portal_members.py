"""The portal's members page with Django's test client: who may see and change what, invitations
(answered alike for unknown usernames), roles, removal (never the last org admin), and answering
one's own invitations on the portal's home."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from accounts.models import Invitation, Membership, Organization, Role
from accounts.services import (
    LastOrgAdmin,
    invitation_cancel,
    invitation_create,
    invitation_decline,
    membership_remove,
    membership_set,
    organization_create,
)
from console.pages import portal_members

pytestmark = pytest.mark.django_db

PASSWORD = "pw-members-123456"


@dataclass
class World:
    org: Organization
    other_org: Organization
    admin: Any
    member: Any
    outsider: Any
    newcomer: Any
    platform_admin: Any

    def client(self, who: str) -> Client:
        client = Client()
        client.force_login(getattr(self, who))
        return client

    def membership(self, who: str) -> Membership:
        return Membership.objects.get(user=getattr(self, who), organization=self.org)


@pytest.fixture
def world() -> World:
    users = get_user_model().objects
    org, other_org = organization_create(name="Members Corp"), organization_create(name="Others Corp")
    made = {
        "admin": users.create_user(username="mem-admin", password=PASSWORD),
        "member": users.create_user(username="mem-member", password=PASSWORD),
        "outsider": users.create_user(username="mem-outsider", password=PASSWORD),
        "newcomer": users.create_user(username="mem-newcomer", password=PASSWORD),
        "platform_admin": users.create_superuser(username="mem-root", password=PASSWORD),
    }
    Membership.objects.create(user=made["admin"], organization=org, role=Role.ORG_ADMIN)
    Membership.objects.create(user=made["member"], organization=org, role=Role.ORG_MEMBER)
    Membership.objects.create(user=made["outsider"], organization=other_org, role=Role.ORG_ADMIN)
    return World(org=org, other_org=other_org, **made)


def url(name: str, org: Organization, **kwargs: int) -> str:
    return reverse(f"console:{name}", kwargs={"org_id": org.pk, **kwargs})


def text(response: Any) -> str:
    return html.unescape(response.content.decode())


class TestTheMembersPage:
    def test_an_admin_sees_members_roles_and_when_they_joined_with_the_controls(self, world):
        invitation_create(organization=world.org, username="someone-invited", actor=world.admin)
        response = world.client("admin").get(url("portal-members", world.org))
        assert response.status_code == 200
        page = text(response)
        for username in ("mem-admin", "mem-member", "someone-invited"):
            assert username in page
        assert "mem-outsider" not in page
        assert world.membership("member").created_at.strftime("%Y-%m-%d") in page
        assert "Send invitation" in page
        assert "Change role" in page
        assert "Pending invitations" in page
        assert 'name="csrfmiddlewaretoken"' in page
        assert url("portal-member-remove", world.org, membership_id=world.membership("member").pk) in page

    def test_a_member_sees_the_list_read_only_and_no_invitations(self, world):
        invitation_create(organization=world.org, username="someone-invited", actor=world.admin)
        response = world.client("member").get(url("portal-members", world.org))
        assert response.status_code == 200
        page = text(response)
        assert "mem-admin" in page
        assert "Org admin" in page
        assert "someone-invited" not in page
        assert "Send invitation" not in page
        assert "Change role" not in page
        assert "Remove" not in page

    def test_it_is_in_the_portals_navigation_for_members(self, world):
        response = world.client("member").get(url("portal-usage", world.org))
        assert url("portal-members", world.org) in text(response)

    def test_another_organisations_members_are_a_404(self, world):
        assert world.client("outsider").get(url("portal-members", world.org)).status_code == 404

    def test_the_list_is_filtered_and_paged(self, world, monkeypatch):
        monkeypatch.setattr(portal_members, "MEMBERS_PER_PAGE", 2)
        users = get_user_model().objects
        for n in range(3):
            Membership.objects.create(
                user=users.create_user(username=f"mem-paged-{n}"), organization=world.org, role=Role.ORG_MEMBER
            )
        client = world.client("admin")
        response = client.get(url("portal-members", world.org), {"q": "paged"})
        assert [m.user.username for m in response.context["page"].object_list] == ["mem-paged-0", "mem-paged-1"]
        assert "q=paged&amp;page=2" in response.content.decode()
        second = client.get(url("portal-members", world.org), {"q": "paged", "page": "2"})
        assert [m.user.username for m in second.context["page"].object_list] == ["mem-paged-2"]


class TestInviting:
    def test_an_admin_invites_a_username_with_a_role(self, world):
        response = world.client("admin").post(
            url("portal-member-invite", world.org), {"username": "mem-newcomer", "role": "org_admin"}, follow=True
        )
        assert response.redirect_chain[-1][0] == url("portal-members", world.org)
        assert "mem-newcomer is invited as Org admin" in text(response)
        invitation = Invitation.objects.get(organization=world.org, username="mem-newcomer")
        assert (invitation.role, invitation.invited_by, invitation.accepted_at) == (Role.ORG_ADMIN, world.admin, None)
        assert not Membership.objects.filter(user=world.newcomer, organization=world.org).exists()

    def test_the_answer_is_the_same_for_an_unknown_username(self, world):
        client = world.client("admin")
        answers = []
        for username in ("mem-newcomer", "nobody-has-this-name"):
            response = client.post(url("portal-member-invite", world.org), {"username": username, "role": "org_member"})
            followed = client.get(response["Location"])
            shown = [str(m) for m in followed.context["messages"]]
            answers.append((response.status_code, response["Location"], [m.replace(username, "U") for m in shown]))
            assert Invitation.objects.filter(organization=world.org, username=username, accepted_at=None).exists()
        assert answers[0] == answers[1]

    def test_bad_input_is_shown_beside_the_fields(self, world):
        response = world.client("admin").post(
            url("portal-member-invite", world.org), {"username": "  ", "role": "platform_admin"}
        )
        assert response.status_code == 200
        errors = response.context["invite_form"].errors
        assert "username" in errors
        assert "role" in errors
        assert "Nobody was invited" in text(response)
        assert not Invitation.objects.filter(organization=world.org).exists()

    def test_a_member_may_not_invite(self, world):
        response = world.client("member").post(
            url("portal-member-invite", world.org), {"username": "mem-newcomer", "role": "org_admin"}
        )
        assert response.status_code == 403
        assert not Invitation.objects.exists()

    def test_another_organisations_admin_gets_a_404(self, world):
        response = world.client("outsider").post(
            url("portal-member-invite", world.org), {"username": "mem-newcomer", "role": "org_admin"}
        )
        assert response.status_code == 404
        assert not Invitation.objects.exists()

    def test_a_get_invites_nobody(self, world):
        assert world.client("admin").get(url("portal-member-invite", world.org)).status_code == 405

    def test_posts_need_the_csrf_token(self, world):
        client = Client(enforce_csrf_checks=True)
        client.force_login(world.admin)
        response = client.post(
            url("portal-member-invite", world.org), {"username": "mem-newcomer", "role": "org_admin"}
        )
        assert response.status_code == 403
        assert not Invitation.objects.exists()


class TestCancellingAnInvitation:
    def test_an_admin_cancels_a_pending_invitation(self, world):
        invitation = invitation_create(organization=world.org, username="mem-newcomer", actor=world.admin)
        response = world.client("admin").post(
            url("portal-invitation-cancel", world.org, invitation_id=invitation.pk), follow=True
        )
        assert "The invitation of mem-newcomer is cancelled." in text(response)
        assert not Invitation.objects.filter(pk=invitation.pk).exists()

    def test_a_member_may_not_and_another_organisation_sees_a_404(self, world):
        invitation = invitation_create(organization=world.org, username="mem-newcomer", actor=world.admin)
        path = url("portal-invitation-cancel", world.org, invitation_id=invitation.pk)
        assert world.client("member").post(path).status_code == 403
        assert world.client("outsider").post(path).status_code == 404
        # Through the outsider's own organisation: not one of its invitations.
        other_path = url("portal-invitation-cancel", world.other_org, invitation_id=invitation.pk)
        assert world.client("outsider").post(other_path).status_code == 404
        assert Invitation.objects.filter(pk=invitation.pk).exists()

    def test_an_accepted_invitation_cannot_be_cancelled(self, world):
        invitation = invitation_create(organization=world.org, username="mem-newcomer", actor=world.admin)
        world.client("newcomer").post(
            reverse("console:portal-invitation-accept", kwargs={"invitation_id": invitation.pk})
        )
        path = url("portal-invitation-cancel", world.org, invitation_id=invitation.pk)
        assert world.client("admin").post(path).status_code == 404
        assert Membership.objects.filter(user=world.newcomer, organization=world.org).exists()


class TestRoles:
    def test_an_admin_promotes_and_demotes_a_member(self, world):
        client, membership = world.client("admin"), world.membership("member")
        path = url("portal-member-role", world.org, membership_id=membership.pk)
        response = client.post(path, {"role": "org_admin"}, follow=True)
        assert "mem-member is now Org admin." in text(response)
        assert world.membership("member").role == Role.ORG_ADMIN
        client.post(path, {"role": "org_member"})
        assert world.membership("member").role == Role.ORG_MEMBER

    def test_the_last_org_admin_is_not_demoted(self, world):
        path = url("portal-member-role", world.org, membership_id=world.membership("admin").pk)
        response = world.client("admin").post(path, {"role": "org_member"}, follow=True)
        assert "The role of mem-admin was not changed. An organisation keeps at least one org admin" in text(response)
        assert world.membership("admin").role == Role.ORG_ADMIN

    def test_an_admin_may_step_down_when_another_admin_remains(self, world):
        membership_set(user=world.member, organization=world.org, role=Role.ORG_ADMIN, actor=world.admin)
        path = url("portal-member-role", world.org, membership_id=world.membership("admin").pk)
        world.client("admin").post(path, {"role": "org_member"})
        assert world.membership("admin").role == Role.ORG_MEMBER

    def test_no_platform_admin_role_from_the_portal(self, world):
        path = url("portal-member-role", world.org, membership_id=world.membership("member").pk)
        response = world.client("admin").post(path, {"role": "platform_admin"}, follow=True)
        assert "The role of mem-member was not changed" in text(response)
        assert world.membership("member").role == Role.ORG_MEMBER

    def test_a_platform_admins_membership_is_out_of_reach(self, world):
        staff = Membership.objects.create(user=world.platform_admin, organization=world.org, role=Role.ORG_MEMBER)
        path = url("portal-member-role", world.org, membership_id=staff.pk)
        response = world.client("admin").post(path, {"role": "org_admin"}, follow=True)
        assert "Only platform admins change a platform admin's membership." in text(response)
        staff.refresh_from_db()
        assert staff.role == Role.ORG_MEMBER

    def test_a_member_may_not_and_another_organisation_sees_a_404(self, world):
        path = url("portal-member-role", world.org, membership_id=world.membership("admin").pk)
        assert world.client("member").post(path, {"role": "org_member"}).status_code == 403
        assert world.client("outsider").post(path, {"role": "org_member"}).status_code == 404
        outsider_membership = Membership.objects.get(user=world.outsider)
        foreign = url("portal-member-role", world.org, membership_id=outsider_membership.pk)
        assert world.client("admin").post(foreign, {"role": "org_member"}).status_code == 404
        assert world.membership("admin").role == Role.ORG_ADMIN
        assert Membership.objects.get(user=world.outsider).role == Role.ORG_ADMIN


class TestRemoving:
    def test_an_admin_removes_a_member_after_a_confirm_step(self, world):
        client, membership = world.client("admin"), world.membership("member")
        path = url("portal-member-remove", world.org, membership_id=membership.pk)
        confirm = client.get(path)
        assert confirm.status_code == 200
        assert "Remove mem-member from Members Corp?" in text(confirm)
        assert Membership.objects.filter(pk=membership.pk).exists()  # a GET removes nothing
        response = client.post(path, follow=True)
        assert "mem-member removed from Members Corp." in text(response)
        assert not Membership.objects.filter(pk=membership.pk).exists()

    def test_the_last_org_admin_is_not_removed(self, world):
        path = url("portal-member-remove", world.org, membership_id=world.membership("admin").pk)
        assert "Leave Members Corp?" in text(world.client("admin").get(path))
        response = world.client("admin").post(path, follow=True)
        assert response.redirect_chain[-1][0] == url("portal-members", world.org)
        assert "mem-admin was not removed. An organisation keeps at least one org admin" in text(response)
        assert world.membership("admin").role == Role.ORG_ADMIN

    def test_an_admin_may_leave_when_another_admin_remains(self, world):
        membership_set(user=world.member, organization=world.org, role=Role.ORG_ADMIN, actor=world.admin)
        path = url("portal-member-remove", world.org, membership_id=world.membership("admin").pk)
        response = world.client("admin").post(path, follow=True)
        assert "You left Members Corp." in text(response)
        assert not Membership.objects.filter(user=world.admin, organization=world.org).exists()

    def test_a_member_may_not_and_another_organisation_sees_a_404(self, world):
        path = url("portal-member-remove", world.org, membership_id=world.membership("member").pk)
        assert world.client("member").get(path).status_code == 403
        assert world.client("member").post(path).status_code == 403
        assert world.client("outsider").post(path).status_code == 404
        foreign = url("portal-member-remove", world.org, membership_id=Membership.objects.get(user=world.outsider).pk)
        assert world.client("admin").post(foreign).status_code == 404
        assert Membership.objects.filter(user=world.member).exists()
        assert Membership.objects.filter(user=world.outsider).exists()


class TestAnsweringAnInvitation:
    def test_pending_invitations_are_on_the_portal_home_with_accept_and_decline(self, world):
        invitation = invitation_create(organization=world.org, username="mem-newcomer", actor=world.admin)
        response = world.client("newcomer").get(reverse("console:portal-home"))
        assert response.status_code == 200
        page = text(response)
        assert "Members Corp" in page
        assert "mem-admin" in page
        assert reverse("console:portal-invitation-accept", kwargs={"invitation_id": invitation.pk}) in page
        assert reverse("console:portal-invitation-decline", kwargs={"invitation_id": invitation.pk}) in page

    def test_a_member_of_one_organisation_with_an_invitation_is_not_sent_straight_on(self, world):
        invitation_create(organization=world.other_org, username="mem-member", actor=world.outsider)
        response = world.client("member").get(reverse("console:portal-home"))
        assert response.status_code == 200
        assert "Others Corp" in text(response)
        Invitation.objects.all().delete()
        assert world.client("member").get(reverse("console:portal-home")).status_code == 302

    def test_accepting_makes_a_member_and_lands_on_the_organisations_portal(self, world):
        invitation = invitation_create(
            organization=world.org, username="mem-newcomer", role=Role.ORG_ADMIN, actor=world.admin
        )
        client = world.client("newcomer")
        response = client.post(reverse("console:portal-invitation-accept", kwargs={"invitation_id": invitation.pk}))
        assert response.status_code == 302
        assert response["Location"] == url("portal-usage", world.org)
        assert world.membership("newcomer").role == Role.ORG_ADMIN
        assert "Welcome to Members Corp" in text(client.get(response["Location"]))
        invitation.refresh_from_db()
        assert invitation.accepted_at is not None

    def test_declining_drops_the_invitation(self, world):
        invitation = invitation_create(organization=world.org, username="mem-newcomer", actor=world.admin)
        client = world.client("newcomer")
        response = client.post(
            reverse("console:portal-invitation-decline", kwargs={"invitation_id": invitation.pk}), follow=True
        )
        assert "You declined the invitation to Members Corp." in text(response)
        assert not Invitation.objects.filter(pk=invitation.pk).exists()
        assert not Membership.objects.filter(user=world.newcomer).exists()

    def test_someone_elses_invitation_is_a_404(self, world):
        invitation = invitation_create(organization=world.org, username="mem-newcomer", actor=world.admin)
        for action in ("portal-invitation-accept", "portal-invitation-decline"):
            path = reverse(f"console:{action}", kwargs={"invitation_id": invitation.pk})
            assert world.client("outsider").post(path).status_code == 404
            assert world.client("admin").post(path).status_code == 404
        assert Invitation.objects.filter(pk=invitation.pk, accepted_at=None).exists()
        assert not Membership.objects.filter(user=world.outsider, organization=world.org).exists()

    def test_answering_needs_a_post_and_a_sign_in(self, world):
        invitation = invitation_create(organization=world.org, username="mem-newcomer", actor=world.admin)
        path = reverse("console:portal-invitation-accept", kwargs={"invitation_id": invitation.pk})
        assert world.client("newcomer").get(path).status_code == 405
        anonymous = Client().post(path)
        assert anonymous.status_code == 302
        assert anonymous["Location"].startswith("/accounts/login/")
        assert not Membership.objects.filter(user=world.newcomer).exists()


class TestTheServices:
    """The rules live in accounts.services, so the API and every other caller get them."""

    def test_the_last_org_admin_is_neither_removed_nor_demoted(self, world):
        admin = world.membership("admin")
        with pytest.raises(LastOrgAdmin):
            membership_remove(membership=admin, actor=world.admin)
        with pytest.raises(LastOrgAdmin):
            membership_set(user=world.admin, organization=world.org, role=Role.ORG_MEMBER, actor=world.admin)
        assert world.membership("admin").role == Role.ORG_ADMIN

    def test_a_platform_admin_may_still_wind_an_organisation_down(self, world):
        membership_remove(membership=world.membership("admin"), actor=world.platform_admin)
        assert not Membership.objects.filter(organization=world.org, role=Role.ORG_ADMIN).exists()

    def test_the_rule_reads_the_stored_role_not_a_stale_copy(self, world):
        stale = world.membership("member")  # read as a member, then promoted
        membership_set(user=world.member, organization=world.org, role=Role.ORG_ADMIN, actor=world.admin)
        membership_remove(membership=world.membership("admin"), actor=world.member)
        with pytest.raises(LastOrgAdmin):
            membership_remove(membership=stale, actor=world.member)

    def test_the_api_refuses_it_too(self, world):
        from rest_framework.test import APIClient

        api = APIClient()
        api.force_authenticate(world.admin)
        path = f"/api/orgs/{world.org.pk}/members/{world.membership('admin').pk}/"
        assert api.delete(path).status_code == 403
        assert api.patch(path, {"role": "org_member"}, format="json").status_code == 403
        assert world.membership("admin").role == Role.ORG_ADMIN

    def test_cancel_and_decline_only_touch_pending_invitations(self, world):
        invitation = invitation_create(organization=world.org, username="mem-newcomer", actor=world.admin)
        with pytest.raises(Exception, match="Only organisation admins"):
            invitation_cancel(invitation=invitation, actor=world.member)
        with pytest.raises(ValueError, match="not open to you"):
            invitation_decline(invitation=invitation, user=world.member)
        invitation_decline(invitation=invitation, user=world.newcomer)
        with pytest.raises(ValueError, match="accepted or cancelled already"):
            invitation_cancel(invitation=invitation, actor=world.admin)
