"""The console in real Chromium, served by a real daphne process."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.support.browser import screenshot
from tests.support.processes import Gateway, start_gateway

# No `db` fixture: playwright's sync API runs an event loop in this thread, where Django
# refuses ORM calls, so committed data is set up in module fixtures before the browser.
pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def gateway(bundled_models, tmp_path_factory) -> Iterator[Gateway]:
    gw = start_gateway(tmp_path_factory.mktemp("gateway"))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def browser(console_admin):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield instance
        instance.close()


@pytest.fixture(scope="module")
def console_admin(django_db_setup, django_db_blocker):
    """A committed staff user the daphne process can see."""
    from django.contrib.auth import get_user_model

    with django_db_blocker.unblock():
        user = get_user_model().objects.create_superuser(username="browser-admin", password="s3cret-pass-42")
    yield user
    with django_db_blocker.unblock():
        user.delete()


class TestConsoleInChromium:
    def test_admin_logs_in_and_sees_both_models(self, gateway, browser, console_admin):
        page = browser.new_page()
        page.goto(f"{gateway.base_url}/")
        assert "/accounts/login/" in page.url
        page.fill("#id_username", "browser-admin")
        page.fill("#id_password", "s3cret-pass-42")
        page.click("button[type=submit]")
        # The root sends a platform admin to the console's overview; the models moved to their own page.
        page.wait_for_selector("h1:has-text('Overview')")
        assert page.url.endswith("/console/")
        page.click("nav[aria-label=Console] a:has-text('Models')")
        page.wait_for_selector("h1:has-text('Models')")
        # Other tests commit models of their own, so find each through the filter, as a person would.
        for name in ("smollm2-135m-instruct", "all-minilm-l6-v2"):
            page.fill("#id_q", name)
            page.click("form.filters button[type=submit]")
            page.wait_for_selector(f"tr[data-model='{name}']")
            assert page.locator(f"tr[data-model='{name}'] .status").count() >= 1  # other tests add versions
        # The stylesheet is served (ASGI static handler) and applied.
        assert page.evaluate("getComputedStyle(document.querySelector('.topbar')).display") == "flex"
        screenshot(page, "home-admin-models")
        page.close()

    def test_wrong_password_shows_an_error(self, gateway, browser, console_admin):
        page = browser.new_page()
        page.goto(f"{gateway.base_url}/accounts/login/")
        page.fill("#id_username", "browser-admin")
        page.fill("#id_password", "wrong")
        page.click("button[type=submit]")
        assert page.locator("[role=alert]").inner_text().startswith("Your username and password didn't match")
        page.close()

    def test_django_admin_login_works(self, gateway, browser, console_admin):
        page = browser.new_page()
        page.goto(f"{gateway.base_url}/admin/")
        page.fill("#id_username", "browser-admin")
        page.fill("#id_password", "s3cret-pass-42")
        page.click("input[type=submit]")
        page.wait_for_selector("#site-name")
        assert page.locator("a:has-text('Model versions')").count() == 1
        assert page.locator("a:has-text('Api keys')").count() == 1
        page.close()

    def test_api_docs_render_with_no_internet(self, gateway, browser, console_admin):
        """Swagger UI comes from our static files: with every other host cut off, it still renders."""
        page = browser.new_page()
        blocked: list[str] = []

        def only_this_server(route):
            host = urlsplit(route.request.url).hostname
            if host in {"127.0.0.1", "localhost"}:
                route.continue_()
            else:
                blocked.append(route.request.url)
                route.abort()

        page.route("**/*", only_this_server)
        page.goto(f"{gateway.base_url}/accounts/login/")
        page.fill("#id_username", "browser-admin")
        page.fill("#id_password", "s3cret-pass-42")
        page.click("button[type=submit]")
        page.wait_for_selector("h1:has-text('Overview')")
        page.goto(f"{gateway.base_url}/api/docs/")
        page.wait_for_selector(".opblock", timeout=30_000)
        paths = page.locator(".opblock .opblock-summary-path").all_inner_texts()
        assert any(p.replace("\u200b", "").startswith("/api/orgs/") for p in paths), paths
        assert page.locator(".opblock:has-text('/api/orgs/')").count() > 0
        assert blocked == []
        page.close()
