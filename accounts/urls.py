"""Management API routes of accounts: /api/orgs/ with their members and keys, /api/invitations/."""

from __future__ import annotations

from typing import Any

from django.urls import path

from accounts import api

app_name = "accounts"

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
    path("invitations/", api.InvitationViewSet.as_view({"get": "list"}), name="invitations"),
    path(
        "invitations/<int:pk>/accept/",
        api.InvitationViewSet.as_view({"post": "accept"}),
        name="invitation-accept",
    ),
]
