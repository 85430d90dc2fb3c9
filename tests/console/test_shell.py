"""The console's frame: where each user lands, the navigation each may follow, sign-in with
its rate limit, password change and reset, and plotly.js served from our own static files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.staticfiles import finders
from django.core import mail
from django.test import Client

from accounts.models import Membership, Organization, Role
from accounts.services import organization_create
from core import keys
from core.redis import sync_redis

pytestmark = pytest.mark.django_db
PASSWORD = "pw-correct-horse-42"


@pytest.fixture(autouse=True)
def no_failed_logins_counted():
    """Failed-login counts live in Redis and would outlive a test's transaction."""
    client = sync_redis()
    for key in client.scan_iter(match=keys.namespaced("login", "failures", "*")):
        client.delete(key)
    yield
    for key in client.scan_iter(match=keys.namespaced("login", "failures", "*")):
        client.delete(key)


def user(name: str, *, org: Organization | None = None, role: str = Role.ORG_MEMBER, email: str = ""):
    made = get_user_model().objects.create_user(username=name, password=PASSWORD, email=email)
    if org is not None:
        Membership.objects.create(user=made, organization=org, role=role)
    return made


def signed_in(who) -> Client:
    client = Client()
    client.force_login(who)
    return client


class TestLanding:
    def test_anonymous_visitors_are_sent_to_log_in(self):
        response = Client().get("/")
        assert response.status_code == 302
        assert response["Location"].startswith("/accounts/login/")

    def test_a_customer_lands_in_the_portal(self, alice_org):
        response = signed_in(user("ann", org=alice_org)).get("/")
        assert (response.status_code, response["Location"]) == (302, "/portal/")

    def test_a_member_of_one_organisation_goes_straight_to_it(self, alice_org):
        response = signed_in(user("ann", org=alice_org)).get("/portal/")
        assert response.status_code == 302
        assert response["Location"] == f"/portal/{alice_org.pk}/"

    def test_a_member_of_several_picks_one(self, alice_org, bob_org):
        ann = user("ann", org=alice_org)
        Membership.objects.create(user=ann, organization=bob_org, role=Role.ORG_ADMIN)
        html = signed_in(ann).get("/portal/").content.decode()
        assert f'href="/portal/{alice_org.pk}/"' in html
        assert f'href="/portal/{bob_org.pk}/"' in html

    def test_a_platform_admin_pages_through_every_organisation_and_finds_one_by_name(self):
        for n in range(30):
            organization_create(name=f"Paged org {n:02d}")
        root = get_user_model().objects.create_superuser(username="pager-root", password=PASSWORD)
        client = signed_in(root)
        first = client.get("/portal/", {"q": "Paged org"}).content.decode()
        assert first.count('<tr><td><a href="/portal/') == 25
        assert "Page 1 of 2 · 30 in all" in first
        assert "q=Paged+org&amp;page=2" in first  # the pager keeps the search
        found = client.get("/portal/", {"q": "org 07"}).content.decode()
        assert found.count('<tr><td><a href="/portal/') == 1
        assert ">Paged org 07</a>" in found
        assert (
            "No organisation name contains “nothing like it”"
            in client.get("/portal/", {"q": "nothing like it"}).content.decode()
        )

    def test_someone_in_no_organisation_is_told_how_to_get_in(self):
        html = signed_in(user("lone")).get("/portal/").content.decode()
        assert "Ask an organisation admin to invite you" in html


class TestNavigation:
    def test_a_customer_sees_the_portal_of_their_organisation_and_no_console(self, alice_org):
        response = signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/")
        nav = response.context["nav"]
        assert nav["console"] == []
        assert nav["portal"], "the portal's pages are listed"
        assert all(link["url"].startswith(f"/portal/{alice_org.pk}/") for link in nav["portal"])
        assert [link["url"] for link in nav["portal"] if link["active"]] == [f"/portal/{alice_org.pk}/"]

    def test_a_platform_admin_sees_the_console(self, alice_org):
        root = get_user_model().objects.create_superuser(username="root", password=PASSWORD)
        response = signed_in(root).get("/portal/")
        assert [link for link in response.context["nav"]["console"] if link["url"].startswith("/console/")]

    def test_the_navigation_points_at_the_organisation_in_the_url(self, alice_org, bob_org):
        ann = user("ann", org=alice_org)
        Membership.objects.create(user=ann, organization=bob_org, role=Role.ORG_MEMBER)
        response = signed_in(ann).get(f"/portal/{bob_org.pk}/")
        assert response.context["portal_org"] == bob_org

    def test_a_platform_admin_in_a_portal_reads_each_label_once(self, alice_org):
        """Issue 40: on an organisation's pages a platform admin's sidebar listed Invoices, Batches
        and Requests twice (the console's, over every organisation, and the organisation's)."""
        root = get_user_model().objects.create_superuser(username="root", password=PASSWORD)
        nav = signed_in(root).get(f"/portal/{alice_org.pk}/").context["nav"]
        console = [link["label"] for link in nav["console"]]
        portal = [link["label"] for link in nav["portal"]]
        assert {"All invoices", "All batches", "All requests"} <= set(console)
        assert {"Invoices", "Batches", "Requests"} <= set(portal)
        assert not set(console) & set(portal)
        # On the console's own pages there is no organisation's list to tell them from.
        console_only = signed_in(root).get("/console/").context["nav"]["console"]
        assert {"Invoices", "Batches", "Requests"} <= {link["label"] for link in console_only}

    def test_switching_organisation_is_a_link_for_those_with_another(self, alice_org, bob_org):
        ann = user("ann", org=alice_org)
        html = signed_in(ann).get(f"/portal/{alice_org.pk}/").content.decode()
        assert "Switch organisation" not in html  # one organisation: nowhere to switch to
        Membership.objects.create(user=ann, organization=bob_org, role=Role.ORG_MEMBER)
        html = signed_in(ann).get(f"/portal/{alice_org.pk}/").content.decode()
        assert '<a class="nav-switch" href="/portal/">Switch organisation</a>' in html

    def test_the_admin_is_named_for_the_product(self, alice_org):
        root = get_user_model().objects.create_superuser(username="root", password=PASSWORD)
        client = signed_in(root)
        assert '<a href="/admin/">Admin</a>' in client.get("/console/").content.decode()
        admin = client.get("/admin/").content.decode()
        assert "<title>Records | Inference platform admin</title>" in admin
        assert ">Inference platform admin</a>" in admin
        assert "Django administration" not in admin


class TestLogin:
    def login(self, client: Client, username: str, password: str):
        return client.post("/accounts/login/", {"username": username, "password": password})

    def test_a_good_login_goes_home(self, alice_org):
        user("ann", org=alice_org)
        response = self.login(Client(), "ann", PASSWORD)
        assert (response.status_code, response["Location"]) == (302, "/")

    def test_after_five_failures_the_account_is_refused_for_a_while_even_with_the_right_password(self, alice_org):
        user("ann", org=alice_org)
        client = Client()
        for _ in range(5):
            assert self.login(client, "ann", "wrong").status_code == 200
        refused = self.login(client, "ann", PASSWORD)
        assert refused.status_code == 429
        assert int(refused["Retry-After"]) > 0
        assert "Too many failed logins" in refused.content.decode()
        assert "_auth_user_id" not in client.session

    def test_another_account_is_not_locked_out(self, alice_org):
        user("ann", org=alice_org)
        user("bob", org=alice_org)
        for _ in range(5):
            self.login(Client(), "ann", "wrong")
        assert self.login(Client(), "bob", PASSWORD).status_code == 302

    def test_a_good_login_clears_the_accounts_failures(self, alice_org):
        user("ann", org=alice_org)
        for _ in range(4):
            self.login(Client(), "ann", "wrong")
        assert self.login(Client(), "ann", PASSWORD).status_code == 302
        for _ in range(4):
            self.login(Client(), "ann", "wrong")
        assert self.login(Client(), "ann", PASSWORD).status_code == 302

    def test_basic_auth_on_the_management_api_shares_the_lockout(self, alice_org):
        """Defect 5 of issue 18: HTTP Basic was unlimited password guessing, beside the login page."""
        import base64

        user("ann", org=alice_org)

        def basic(password: str) -> dict[str, str]:
            return {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(f"ann:{password}".encode()).decode()}

        assert Client().get("/api/orgs/", **basic(PASSWORD)).status_code == 200
        for _ in range(5):
            assert Client().get("/api/orgs/", **basic("wrong")).status_code in (401, 403)
        refused = Client().get("/api/orgs/", **basic(PASSWORD))  # the right password, now too late
        assert refused.status_code == 429
        assert int(refused["Retry-After"]) > 0
        assert self.login(Client(), "ann", PASSWORD).status_code == 429  # one lockout for every way in

    def test_one_address_trying_many_accounts_is_refused_too(self, settings, alice_org):
        settings.LOGIN_MAX_FAILURES = 2  # so the address's budget is 10
        for i in range(10):
            self.login(Client(), f"nobody-{i}", "wrong")
        user("ann", org=alice_org)
        assert self.login(Client(), "ann", PASSWORD).status_code == 429

    def test_the_form_carries_a_csrf_token(self):
        client = Client(enforce_csrf_checks=True)
        assert client.post("/accounts/login/", {"username": "x", "password": "y"}).status_code == 403
        assert 'name="csrfmiddlewaretoken"' in client.get("/accounts/login/").content.decode()


class TestPasswords:
    def test_a_signed_in_user_changes_their_password(self, alice_org):
        ann = user("ann", org=alice_org)
        client = signed_in(ann)
        assert client.get("/accounts/password_change/").status_code == 200
        bad = client.post("/accounts/password_change/", {"old_password": "nope", "new_password1": "x",
                                                          "new_password2": "y"})  # fmt: skip
        assert bad.status_code == 200
        assert 'role="alert"' in bad.content.decode()
        new = "a-new-and-long-pass-77"
        done = client.post("/accounts/password_change/", {"old_password": PASSWORD, "new_password1": new,
                                                           "new_password2": new})  # fmt: skip
        assert (done.status_code, done["Location"]) == (302, "/accounts/password_change/done/")
        ann.refresh_from_db()
        assert ann.check_password(new)

    def test_a_reset_link_by_email_sets_a_new_password(self, settings, alice_org):
        settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
        ann = user("ann", org=alice_org, email="ann@example.com")
        client = Client()
        assert client.post("/accounts/password_reset/", {"email": "ann@example.com"}).status_code == 302
        assert len(mail.outbox) == 1
        link = re.search(r"https?://[^/]+(/accounts/reset/\S+/)", mail.outbox[0].body)
        assert link is not None, mail.outbox[0].body
        form = client.get(link.group(1), follow=True)
        assert "Set a new password" in form.content.decode()
        new = "another-long-pass-88"
        done = client.post(form.redirect_chain[-1][0], {"new_password1": new, "new_password2": new})
        assert (done.status_code, done["Location"]) == (302, "/accounts/reset/done/")
        ann.refresh_from_db()
        assert ann.check_password(new)

    def test_an_unknown_address_gets_the_same_answer_and_no_mail(self, settings):
        settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
        response = Client().post("/accounts/password_reset/", {"email": "nobody@example.com"})
        assert (response.status_code, response["Location"]) == (302, "/accounts/password_reset/done/")
        assert mail.outbox == []


def test_plotly_js_is_one_of_our_static_files():
    found = finders.find("plotly/plotly.min.js")
    assert found is not None
    assert Path(found).stat().st_size > 1_000_000
    assert finders.find("plotly/datasets/iris.csv") is None  # nothing else of the package
