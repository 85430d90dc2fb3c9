"""The portal's members in real Chromium: an org admin invites a user from the Members page, that
user signs in, accepts the invitation on the portal's home with the keyboard, and lands on the
organisation's usage page; the admin then sees them among the members. Screenshots of each step
go under tests/screenshots/."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.browser import PASSWORD, log_in, outside_the_event_loop, screenshot
from tests.support.processes import Gateway, start_gateway

pytestmark = pytest.mark.browser


@pytest.mark.django_db
def test_the_members_pages_are_routed():
    """Also makes pytest-django create the test database when this module runs alone: the
    browser test below reaches the database through committed fixtures only."""
    from django.urls import reverse

    assert reverse("console:portal-members", kwargs={"org_id": 3}) == "/portal/3/members/"
    assert reverse("console:portal-invitation-accept", kwargs={"invitation_id": 5}) == "/portal/invitations/5/accept/"


@pytest.fixture(scope="module")
def console_gateway(django_db_setup, tmp_path_factory) -> Iterator[Gateway]:
    """The console's daphne process; these pages need no model, so none is imported."""
    gw = start_gateway(tmp_path_factory.mktemp("members-gateway"))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def invitee(committed_users, django_db_blocker) -> Iterator[Any]:
    """A committed user who belongs to no organisation yet; removed (with their invitations) after."""
    from django.contrib.auth import get_user_model

    from accounts.models import Invitation

    username = f"invitee-{uuid.uuid4().hex[:6]}"
    with django_db_blocker.unblock():
        user = outside_the_event_loop(lambda: get_user_model().objects.create_user(username, password=PASSWORD))
    yield user

    def remove() -> None:
        Invitation.objects.filter(username=username).delete()
        user.delete()

    with django_db_blocker.unblock():
        outside_the_event_loop(remove)


def no_horizontal_scroll(page: Any) -> bool:
    return bool(page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"))


def test_an_org_admin_invites_a_user_who_accepts_and_sees_the_usage(
    committed_users, invitee, console_gateway, chromium
):
    base = console_gateway.base_url
    org = committed_users["org"]
    admin_context = chromium.new_context(viewport={"width": 1280, "height": 900})
    invitee_context = chromium.new_context(viewport={"width": 1280, "height": 900})
    page = admin_context.new_page()
    try:
        # The org admin invites the user by username, as an org member, from the keyboard.
        log_in(page, base, committed_users["org_admin"].username)
        page.get_by_role("link", name="Members", exact=True).click()
        page.wait_for_selector("h1:has-text('Members')")
        page.fill("#id_q", committed_users["org_member"].username)  # lists are shared: filter
        page.press("#id_q", "Enter")
        page.wait_for_selector(f"#member-list th:has-text('{committed_users['org_member'].username}')")
        screenshot(page, "portal-members-01-list")
        page.fill("#id_username", invitee.username)
        page.select_option("#id_role", "org_member")
        page.press("#id_username", "Enter")
        page.wait_for_selector(".message-success")
        assert f"{invitee.username} is invited as Org member" in page.inner_text(".messages")
        page.fill("#id_q", invitee.username)
        page.press("#id_q", "Enter")
        page.wait_for_selector(f"#invitation-list th:has-text('{invitee.username}')")
        screenshot(page, "portal-members-02-invited")

        # At phone width nothing scrolls sideways (tables scroll inside their wrappers).
        page.set_viewport_size({"width": 390, "height": 844})
        page.wait_for_timeout(200)
        assert no_horizontal_scroll(page)
        screenshot(page, "portal-members-03-phone")

        # The invited user signs in, sees the invitation on the portal's home and accepts it.
        other = invitee_context.new_page()
        log_in(other, base, invitee.username)
        other.wait_for_selector("h1:has-text('Your invitations')")
        row = other.locator("#invitation-list tr", has_text=org.name)
        assert "Org member" in row.inner_text()
        screenshot(other, "portal-members-04-invitation")
        row.get_by_role("button", name="Accept").focus()
        other.keyboard.press("Enter")
        other.wait_for_selector("h1:has-text('Usage and cost')")
        assert other.url.rstrip("/").endswith(f"/portal/{org.pk}"), other.url
        assert f"Welcome to {org.name}" in other.inner_text(".messages")
        assert org.name in (other.locator("nav[aria-label=Portal] h2").text_content() or "")
        screenshot(other, "portal-members-05-usage")

        # The admin sees them among the members now, no longer invited.
        page.set_viewport_size({"width": 1280, "height": 900})
        page.reload()
        page.wait_for_selector(f"#member-list th:has-text('{invitee.username}')")
        assert page.locator("#invitation-list").count() == 0
        screenshot(page, "portal-members-06-joined")
    except Exception:
        screenshot(page, "portal-members-failure")
        raise
    finally:
        admin_context.close()
        invitee_context.close()
