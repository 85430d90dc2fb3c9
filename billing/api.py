"""The management REST API for organisations, their members and their API keys.

Every object is reached through an organisation the user may see; anyone else's objects
answer 404, so tenants cannot even learn what exists. Who may do what:

- platform admins (the ML team): everything, including creating organisations and
  setting organisation limits, budgets and tiers;
- org admins: their organisation's members (not platform admins) and keys, its name;
- org members: read their organisation, its members and its keys (never a secret).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypeVar

from django.contrib.auth import get_user_model
from django.db import IntegrityError
from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from billing.models import ApiKey, Membership, Organization, Role
from billing.selectors import is_platform_admin, organizations_visible_to, role_in
from billing.services import (
    LIMIT_FIELDS,
    api_key_create,
    api_key_revoke,
    api_key_rotate,
    api_key_update,
    membership_remove,
    membership_set,
    organization_create,
    organization_update,
)

ADMIN_ROLES = {Role.PLATFORM_ADMIN, Role.ORG_ADMIN}


class OrganizationSerializer(serializers.ModelSerializer[Organization]):
    class Meta:
        model = Organization
        fields = ["id", "name", "slug", "tier", *LIMIT_FIELDS, "created_at"]
        read_only_fields = ["id", "slug", "created_at"]


class MembershipSerializer(serializers.ModelSerializer[Membership]):
    username = serializers.CharField(source="user.username")

    class Meta:
        model = Membership
        fields = ["id", "username", "role", "created_at"]
        read_only_fields = ["id", "created_at"]


class ApiKeySerializer(serializers.ModelSerializer[ApiKey]):
    rotated_to: serializers.PrimaryKeyRelatedField[ApiKey] = serializers.PrimaryKeyRelatedField(read_only=True)

    class Meta:
        model = ApiKey
        fields = [
            "id", "name", "prefix", "tier", "allowed_models", *LIMIT_FIELDS, "is_active", "expires_at",
            "revoked_at", "rotated_to", "last_used_at", "created_at",
        ]  # fmt: skip
        read_only_fields = ["id", "prefix", "is_active", "revoked_at", "rotated_to", "last_used_at", "created_at"]


class IssuedApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="the secret: shown this once, never again")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


def _issued(issued: Any) -> dict[str, Any]:
    data = dict(ApiKeySerializer(issued.api_key).data)
    data["key"] = issued.secret
    return data


class OrganizationViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    viewsets.GenericViewSet[Organization],
):
    serializer_class = OrganizationSerializer

    def get_queryset(self) -> QuerySet[Organization]:
        return organizations_visible_to(self.request.user).order_by("name")

    def perform_create(self, serializer: serializers.BaseSerializer[Organization]) -> None:
        if not is_platform_admin(self.request.user):
            raise PermissionDenied("Only platform admins create organisations.")
        try:
            serializer.instance = organization_create(**serializer.validated_data)
        except (ValueError, IntegrityError) as exc:
            raise ValidationError(str(exc)) from exc

    def perform_update(self, serializer: serializers.BaseSerializer[Organization]) -> None:
        organization = serializer.instance
        assert organization is not None
        changes = dict(serializer.validated_data)
        role = role_in(self.request.user, organization)
        if role not in ADMIN_ROLES:
            raise PermissionDenied("Only organisation admins change an organisation.")
        if set(changes) - {"name"} and role != Role.PLATFORM_ADMIN:
            raise PermissionDenied("Only platform admins change tiers, limits and budgets.")
        try:
            organization_update(organization=organization, **changes)
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc


_M = TypeVar("_M", Membership, ApiKey)


class OrganizationScopedViewSet(viewsets.GenericViewSet[_M]):
    """Views under /api/orgs/{org_pk}/: the organisation must be visible to the user."""

    def organization(self) -> Organization:
        return get_object_or_404(organizations_visible_to(self.request.user), pk=self.kwargs["org_pk"])

    def require_admin(self) -> Organization:
        organization = self.organization()
        if role_in(self.request.user, organization) not in ADMIN_ROLES:
            raise PermissionDenied("Only organisation admins may do this.")
        return organization


class MembershipViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    OrganizationScopedViewSet[Membership],
):
    serializer_class = MembershipSerializer

    def get_queryset(self) -> QuerySet[Membership]:
        return Membership.objects.filter(organization=self.organization()).select_related("user").order_by("id")

    def _check_role(self, role: str) -> None:
        if role == Role.PLATFORM_ADMIN and not is_platform_admin(self.request.user):
            raise PermissionDenied("Only platform admins grant the platform-admin role.")

    def perform_create(self, serializer: serializers.BaseSerializer[Membership]) -> None:
        organization = self.require_admin()
        data = serializer.validated_data
        role = data.get("role", Role.ORG_MEMBER)
        self._check_role(role)
        user = get_user_model().objects.filter(username=data["user"]["username"]).first()
        if user is None:
            raise ValidationError({"username": "No such user."})
        serializer.instance = membership_set(user=user, organization=organization, role=role)

    def perform_update(self, serializer: serializers.BaseSerializer[Membership]) -> None:
        organization = self.require_admin()
        membership = serializer.instance
        assert membership is not None
        role = serializer.validated_data.get("role", membership.role)
        self._check_role(role)
        if membership.role == Role.PLATFORM_ADMIN:
            self._check_role(membership.role)
        serializer.instance = membership_set(user=membership.user, organization=organization, role=role)

    def perform_destroy(self, instance: Membership) -> None:
        self.require_admin()
        if instance.role == Role.PLATFORM_ADMIN:
            self._check_role(instance.role)
        membership_remove(membership=instance)


class RotateSerializer(serializers.Serializer[Any]):
    grace_seconds = serializers.IntegerField(
        min_value=0, max_value=30 * 86400, default=86400, help_text="how long the old key keeps working"
    )


class ApiKeyViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    OrganizationScopedViewSet[ApiKey],
):
    serializer_class = ApiKeySerializer

    def get_queryset(self) -> QuerySet[ApiKey]:
        return ApiKey.objects.filter(organization=self.organization()).order_by("-created_at")

    @extend_schema(responses={201: IssuedApiKeySerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        organization = self.require_admin()
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        try:
            issued = api_key_create(organization=organization, **data)
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc
        return Response(_issued(issued), status=status.HTTP_201_CREATED)

    def perform_update(self, serializer: serializers.BaseSerializer[ApiKey]) -> None:
        self.require_admin()
        assert serializer.instance is not None
        try:
            api_key_update(api_key=serializer.instance, **serializer.validated_data)
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        self.require_admin()
        api_key = api_key_revoke(api_key=self.get_object())
        return Response(ApiKeySerializer(api_key).data)

    @extend_schema(
        request=RotateSerializer,
        responses={201: inline_serializer("RotatedKey", {"new": IssuedApiKeySerializer(), "old": ApiKeySerializer()})},
    )
    @action(detail=True, methods=["post"])
    def rotate(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        self.require_admin()
        body = RotateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        old = self.get_object()
        try:
            issued = api_key_rotate(api_key=old, grace=timedelta(seconds=body.validated_data["grace_seconds"]))
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc
        return Response({"new": _issued(issued), "old": ApiKeySerializer(old).data}, status=status.HTTP_201_CREATED)
