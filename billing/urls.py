"""Management API routes: /api/orgs/, members, keys and invoices under each organisation,
/api/invitations/."""

from __future__ import annotations

from typing import Any

from django.urls import path

from billing import api, api_invoices, api_prices
from billing.api_usage import OrganizationUsageView

app_name = "billing"

_collection: dict[str, Any] = {"get": "list", "post": "create"}
_item: dict[str, Any] = {"get": "retrieve", "patch": "partial_update", "put": "update"}

urlpatterns = [
    path("orgs/", api.OrganizationViewSet.as_view(_collection), name="orgs"),
    path("orgs/<int:pk>/", api.OrganizationViewSet.as_view(_item), name="org"),
    path("orgs/<int:org_pk>/members/", api.MembershipViewSet.as_view(_collection), name="members"),
    path(
        "orgs/<int:org_pk>/members/<int:pk>/",
        api.MembershipViewSet.as_view({**_item, "delete": "destroy"}),
        name="member",
    ),
    path("orgs/<int:org_pk>/keys/", api.ApiKeyViewSet.as_view(_collection), name="keys"),
    path("orgs/<int:org_pk>/keys/<int:pk>/", api.ApiKeyViewSet.as_view(_item), name="key"),
    path("orgs/<int:org_pk>/keys/<int:pk>/revoke/", api.ApiKeyViewSet.as_view({"post": "revoke"}), name="key-revoke"),
    path("orgs/<int:org_pk>/keys/<int:pk>/rotate/", api.ApiKeyViewSet.as_view({"post": "rotate"}), name="key-rotate"),
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
    path("invitations/", api.InvitationViewSet.as_view({"get": "list"}), name="invitations"),
    path(
        "invitations/<int:pk>/accept/",
        api.InvitationViewSet.as_view({"post": "accept"}),
        name="invitation-accept",
    ),
]
