"""The console's customer pages in real Chromium: a platform admin creates an organisation, adds a
member, creates a key with limits and sees its secret once, then drafts and finalizes an invoice
and downloads its PDF. Every step saves a screenshot under tests/screenshots/."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import log_in, outside_the_event_loop, screenshot

pytestmark = pytest.mark.browser


@pytest.mark.django_db
def test_the_customer_pages_are_routed():
    """Also makes pytest-django create the test database when this module runs alone: the
    browser test below reaches the database through committed fixtures only."""
    from django.urls import reverse

    assert reverse("console:customers") == "/console/customers/"
    assert reverse("console:invoice-pdf", kwargs={"invoice_id": 7}) == "/console/invoices/7/pdf/"


@pytest.fixture(scope="module")
def organization_name(committed_users, django_db_blocker) -> Iterator[str]:
    """The name the test gives its organisation; what the browser made is removed after."""
    name = f"Browser Customer {uuid.uuid4().hex[:6]}"
    yield name

    def remove() -> None:
        from accounts.models import ApiKey, Organization
        from billing.models import Invoice, InvoiceLine

        organization = Organization.objects.filter(name=name).first()
        if organization is None:
            return
        InvoiceLine.objects.filter(invoice__organization=organization).delete()
        Invoice.objects.filter(organization=organization, reissue_of__isnull=False).delete()
        Invoice.objects.filter(organization=organization).delete()
        ApiKey.objects.filter(organization=organization).delete()
        organization.delete()

    with django_db_blocker.unblock():
        outside_the_event_loop(remove)


def no_horizontal_scroll(page: Any) -> bool:
    return bool(page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"))


def test_a_platform_admin_sets_up_a_customer_with_a_key_and_an_invoice(
    committed_users, organization_name, console_gateway, chromium, tmp_path: Path
):
    base = console_gateway.base_url
    member = committed_users["org_member"].username
    page = chromium.new_page(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    log_in(page, base, committed_users["platform_admin"].username)

    # The organisations, then a new one.
    page.goto(f"{base}/console/")
    page.click("nav[aria-label=Console] a:has-text('Customers')")
    page.wait_for_selector("h1:has-text('Customers')")
    screenshot(page, "customers-list")
    page.fill("#id_new-name", organization_name)
    page.select_option("#id_new-tier", "paid")
    page.fill("#id_new-billing_email", "invoices@customer.example")
    page.fill("#id_new-tax_percent", "10")
    page.fill("#id_new-monthly_spend_cap", "500")
    page.click("#create button[type=submit]")
    page.wait_for_selector(f"h1:has-text('{organization_name}')")
    assert "created." in page.locator(".messages").inner_text()
    screenshot(page, "customers-created")

    # A member, by username.
    page.fill("#id_member-username", member)
    page.select_option("#id_member-role", "org_member")
    page.click("#members form:not(.cust-inline) button[type=submit]")
    page.wait_for_selector(f"#member-list th:has-text('{member}')")
    assert f"{member} is added as Org member" in page.locator(".messages").inner_text()
    screenshot(page, "customers-member-added")

    # A key with limits: its secret once.
    page.click("a:has-text('Create a key')")
    page.wait_for_selector("h1:has-text('Create an API key')")
    page.fill("#id_name", "browser key")
    page.fill("#id_rate_limit_rpm", "30")
    page.fill("#id_rate_limit_tpm", "20000")
    page.fill("#id_max_concurrent", "2")
    page.fill("#id_monthly_spend_cap", "25")
    screenshot(page, "customers-key-form")
    page.click("button:has-text('Create key')")
    page.wait_for_selector("#api-key-secret")
    secret = page.input_value("#api-key-secret")
    assert secret.startswith("sk-")
    assert "30 requests/min · 20k tokens/min · 2 at once" in page.locator(".cust-secret").inner_text()
    screenshot(page, "customers-key-secret")
    page.click("a:has-text('Done: back to')")
    page.wait_for_selector("#key-list")
    assert secret not in page.content()
    assert "browser key" in page.locator("#key-list").inner_text()
    page.reload()
    assert secret not in page.content()
    screenshot(page, "customers-key-listed")

    # At phone width: nothing scrolls sideways.
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(200)
    screenshot(page, "customers-detail-phone")
    assert no_horizontal_scroll(page)
    page.set_viewport_size({"width": 1280, "height": 900})

    # Last month's invoice: drafted, finalized, downloaded.
    page.click("nav[aria-label='This organisation'] a:has-text('Invoices')")
    page.wait_for_selector("h2:has-text('Draft an invoice')")
    screenshot(page, "customers-invoices")
    page.click("#draft button[type=submit]")
    page.wait_for_selector("#invoice-state:has-text('Draft')")
    assert "drafted" in page.locator(".messages").inner_text()
    screenshot(page, "customers-invoice-draft")
    page.click("button:has-text('Finalize')")
    page.wait_for_selector("#invoice-state:has-text('Finalized')")
    assert "finalized" in page.locator(".messages").inner_text()
    screenshot(page, "customers-invoice-finalized")
    with page.expect_download() as download_info:
        page.click("#download-pdf")
    download = download_info.value
    target = tmp_path / download.suggested_filename
    download.save_as(str(target))
    assert target.name.endswith(".pdf")
    assert target.read_bytes().startswith(b"%PDF")
    screenshot(page, "customers-invoice-downloaded")
    page.close()
