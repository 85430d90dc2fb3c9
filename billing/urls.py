"""Management API routes of the money: /api/prices/, and each organisation's invoices and usage
(its members and keys are accounts')."""

from __future__ import annotations

from typing import Any

from django.urls import path

from billing import api_invoices, api_prices
from billing.api_usage import OrganizationUsageView

app_name = "billing"

_collection: dict[str, Any] = {"get": "list", "post": "create"}

urlpatterns = [
    path("prices/", api_prices.PriceViewSet.as_view(_collection), name="prices"),
    path("orgs/<int:org_pk>/invoices/", api_invoices.InvoiceViewSet.as_view(_collection), name="invoices"),
    path(
        "orgs/<int:org_pk>/invoices/<int:pk>/", api_invoices.InvoiceViewSet.as_view({"get": "retrieve"}), name="invoice"
    ),
    *[
        path(
            f"orgs/<int:org_pk>/invoices/<int:pk>/{name}/",
            api_invoices.InvoiceViewSet.as_view({method: name}),
            name=f"invoice-{name}",
        )
        for method, name in (
            ("get", "pdf"),
            ("get", "csv"),
            ("post", "finalize"),
            ("post", "pay"),
            ("post", "void"),
            ("post", "reissue"),
        )
    ],
    path("orgs/<int:org_pk>/usage/", OrganizationUsageView.as_view(), name="org-usage"),
]
