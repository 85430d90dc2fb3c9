"""Nothing the platform serves loads from the internet: every page works on an offline network."""

from __future__ import annotations

import re
from html import unescape
from urllib.parse import urlsplit

import pytest
from django.contrib.auth import get_user_model
from django.contrib.staticfiles import finders
from django.test import Client

pytestmark = pytest.mark.django_db

# Every attribute that makes a browser fetch or navigate, and CSS url(...) / @import.
REFERENCE = re.compile(
    r"""(?:\b(?:src|href|action|srcset|poster|data|formaction|content)\s*=\s*["']([^"']*)["'])"""
    r"""|(?:url\(\s*["']?([^"')]+)["']?\s*\))|(?:@import\s+["']([^"']+)["'])""",
    re.IGNORECASE,
)
LOCAL_HOSTS = {"testserver", "localhost", "127.0.0.1"}
# Pages as the anonymous visitor sees them, then as a logged-in platform admin.
ANONYMOUS_PAGES = ["/accounts/login/", "/accounts/password_reset/", "/admin/login/"]
ADMIN_PAGES = [
    "/console/", "/console/models/", "/console/models/register/", "/console/audit/", "/console/deployments/",
    "/console/deployments/scaling/", "/console/canaries/", "/console/batches/", "/accounts/password_change/",
    "/portal/", "/admin/", "/admin/accounts/apikey/", "/api/docs/",
]  # fmt: skip
# The portal of an organisation (a platform admin acts as its admin): {org} is its id.
PORTAL_PAGES = ["/portal/{org}/", "/portal/{org}/keys/", "/portal/{org}/invoices/", "/portal/{org}/playground/",
                "/portal/{org}/quickstart/", "/portal/{org}/members/", "/portal/{org}/batches/",
                "/portal/{org}/webhooks/"]  # fmt: skip


def references(html: str) -> list[str]:
    found = []
    for match in REFERENCE.finditer(html):
        value = unescape(next(group for group in match.groups() if group is not None)).strip()
        # srcset lists "url size, url size"
        found.extend(part.strip().split(" ")[0] for part in value.split(",") if part.strip())
    return found


def leaves_the_server(reference: str) -> bool:
    if reference.startswith("//"):
        return urlsplit("http:" + reference).hostname not in LOCAL_HOSTS
    parts = urlsplit(reference)
    if parts.scheme in {"http", "https", "ws", "wss", "ftp"}:
        return parts.hostname not in LOCAL_HOSTS
    return False


def fetch_pages() -> dict[str, str]:
    pages = {}
    anonymous = Client()
    for path in ANONYMOUS_PAGES:
        response = anonymous.get(path)
        assert response.status_code == 200, path
        pages[path] = response.content.decode()
    admin = get_user_model().objects.create_superuser(username="offline-admin", password="pw-1234567890")
    client = Client()
    client.force_login(admin)
    from accounts.services import organization_create

    org = organization_create(name="Offline Org")
    for path in [*ADMIN_PAGES, *(page.format(org=org.pk) for page in PORTAL_PAGES)]:
        response = client.get(path)
        assert response.status_code == 200, path
        assert response["Content-Type"].startswith("text/html"), path
        pages[path] = response.content.decode()
    return pages


def test_the_checker_sees_external_references():
    html = (
        '<script src="https://cdn.jsdelivr.net/x.js"></script><link href="//fonts.example/a.css">'
        '<img srcset="/static/a.png 1x, http://img.example/b.png 2x"><style>b{background:url(https://x.example/i)}</style>'
        '<a href="/static/ok.css"></a><a href="http://testserver/api/">'
    )
    assert [r for r in references(html) if leaves_the_server(r)] == [
        "https://cdn.jsdelivr.net/x.js",
        "//fonts.example/a.css",
        "http://img.example/b.png",
        "https://x.example/i",
    ]


def test_no_page_loads_anything_from_another_host():
    pages = fetch_pages()
    outside = {path: [r for r in references(html) if leaves_the_server(r)] for path, html in pages.items()}
    assert outside == {path: [] for path in pages}


def test_the_api_docs_assets_are_our_own_static_files():
    pages = fetch_pages()
    assets = [r for r in references(pages["/api/docs/"]) if r.startswith("/static/")]
    assert any("swagger-ui-bundle" in a for a in assets), assets
    assert any(a.endswith(".css") for a in assets), assets
    for asset in assets:
        assert finders.find(urlsplit(asset).path.removeprefix("/static/")), asset
