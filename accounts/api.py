"""The management REST API for organisations, their members and their API keys.

Every object is reached through an organisation the user may see; anyone else's objects
answer 404, so tenants cannot even learn what exists. Who may do what (the rules live in
accounts/services.py; views pass who is acting):

- platform admins (the ML team): everything, including creating organisations, setting
  organisation limits, budgets and tiers, and adding existing users directly;
- org admins: their organisation's name, its keys within the organisation's plan, and its
  members: they invite usernames (answered alike whether or not the user exists) and
  change roles, never to or from platform admin;
- org members: read their organisation, its members and its keys (never a secret);
- any user: list and accept the invitations addressed to them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypeVar

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.models import LIMIT_FIELDS, ApiKey, Invitation, Membership, Organization, Role
from accounts.permissions import is_platform_admin
from accounts.selectors import invitations_pending_for, organizations_visible_to, role_in
from accounts.services import (
    api_key_create,
    api_key_revoke,
    api_key_rotate,
    api_key_update,
    invitation_accept,
    invitation_create,
    membership_remove,
    membership_set,
    organization_create,
    organization_update,
)
from core.errors import InvalidInput

ADMIN_ROLES = {Role.PLATFORM_ADMIN, Role.ORG_ADMIN}


def _bad_input(exc: ValueError) -> ValidationError:
    """A service's refusal as a 400 naming the field where the service named one."""
    if isinstance(exc, InvalidInput):
        return ValidationError({exc.field: [exc.message]})
    return ValidationError(str(exc))


class OrganizationSerializer(serializers.ModelSerializer[Organization]):
    class Meta:
        model = Organization
        fields = ["id", "name", "slug", "tier", *LIMIT_FIELDS, "batch_weight", "created_at"]
        read_only_fields = ["id", "slug", "created_at"]


class MembershipSerializer(serializers.ModelSerializer[Membership]):
    username = serializers.CharField(source="user.username", max_length=150)

    class Meta:
        model = Membership
        fields = ["id", "username", "role", "created_at"]
        read_only_fields = ["id", "created_at"]


class InvitationSerializer(serializers.ModelSerializer[Invitation]):
    """An invitation as its inviter sees it: the same whether or not the username exists."""

    class Meta:
        model = Invitation
        fields = ["id", "username", "role", "created_at"]
        read_only_fields = fields


class ReceivedInvitationSerializer(serializers.ModelSerializer[Invitation]):
    """An invitation as the invited user sees it."""

    organization_name = serializers.CharField(source="organization.name", read_only=True)
    invited_by = serializers.SerializerMethodField()

    class Meta:
        model = Invitation
        fields = ["id", "organization", "organization_name", "role", "invited_by", "created_at"]
        read_only_fields = fields

    def get_invited_by(self, invitation: Invitation) -> str | None:
        return invitation.invited_by.get_username() if invitation.invited_by else None


class ApiKeySerializer(serializers.ModelSerializer[ApiKey]):
    rotated_to: serializers.PrimaryKeyRelatedField[ApiKey] = serializers.PrimaryKeyRelatedField(
        read_only=True, allow_null=True, help_text="the key it was rotated to; null: never rotated"
    )

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
        try:
            serializer.instance = organization_create(actor=self.request.user, **serializer.validated_data)
        except ValueError as exc:
            raise _bad_input(exc) from exc

    def perform_update(self, serializer: serializers.BaseSerializer[Organization]) -> None:
        organization = serializer.instance
        assert organization is not None
        try:
            organization_update(organization=organization, actor=self.request.user, **serializer.validated_data)
        except ValueError as exc:
            raise _bad_input(exc) from exc


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

    @extend_schema(
        request=MembershipSerializer,
        responses={201: MembershipSerializer, 202: InvitationSerializer},
        description=(
            "Platform admins add an existing user at once (201). Org admins invite the username "
            "(202, the same answer whether or not it exists); the user accepts at "
            "/api/invitations/{id}/accept/."
        ),
    )
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        organization = self.require_admin()
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        username, role = data["user"]["username"], data.get("role", Role.ORG_MEMBER)
        try:
            if not is_platform_admin(request.user):
                invitation = invitation_create(
                    organization=organization, username=username, role=role, actor=request.user
                )
                return Response(InvitationSerializer(invitation).data, status=status.HTTP_202_ACCEPTED)
            user = get_user_model().objects.filter(username=username).first()
            if user is None:  # platform admins see every user anyway
                raise ValidationError({"username": ["No such user."]})
            membership = membership_set(user=user, organization=organization, role=role, actor=request.user)
        except ValueError as exc:
            raise _bad_input(exc) from exc
        return Response(MembershipSerializer(membership).data, status=status.HTTP_201_CREATED)

    def perform_update(self, serializer: serializers.BaseSerializer[Membership]) -> None:
        organization = self.require_admin()
        membership = serializer.instance
        assert membership is not None
        role = serializer.validated_data.get("role", membership.role)
        try:
            serializer.instance = membership_set(
                user=membership.user, organization=organization, role=role, actor=self.request.user
            )
        except ValueError as exc:
            raise _bad_input(exc) from exc

    def perform_destroy(self, instance: Membership) -> None:
        self.require_admin()
        membership_remove(membership=instance, actor=self.request.user)


class InvitationViewSet(mixins.ListModelMixin, viewsets.GenericViewSet[Invitation]):
    """The logged-in user's pending invitations, and accepting one."""

    serializer_class = ReceivedInvitationSerializer

    def get_queryset(self) -> QuerySet[Invitation]:
        return invitations_pending_for(self.request.user)

    @extend_schema(
        request=None,
        responses={201: MembershipSerializer, 400: OpenApiResponse(description="the invitation is not open to you")},
    )
    @action(detail=True, methods=["post"])
    def accept(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        invitation = self.get_object()  # 404 unless it is addressed to this user and pending
        assert isinstance(request.user, AbstractBaseUser)
        try:
            membership = invitation_accept(invitation=invitation, user=request.user)
        except ValueError as exc:
            raise _bad_input(exc) from exc
        return Response(MembershipSerializer(membership).data, status=status.HTTP_201_CREATED)


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
            issued = api_key_create(organization=organization, actor=request.user, **data)
        except ValueError as exc:
            raise _bad_input(exc) from exc
        return Response(_issued(issued), status=status.HTTP_201_CREATED)

    def perform_update(self, serializer: serializers.BaseSerializer[ApiKey]) -> None:
        self.require_admin()
        assert serializer.instance is not None
        try:
            api_key_update(api_key=serializer.instance, actor=self.request.user, **serializer.validated_data)
        except ValueError as exc:
            raise _bad_input(exc) from exc

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        self.require_admin()
        api_key = api_key_revoke(api_key=self.get_object(), actor=request.user)
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
            issued = api_key_rotate(
                api_key=old, grace=timedelta(seconds=body.validated_data["grace_seconds"]), actor=request.user
            )
        except ValueError as exc:
            raise _bad_input(exc) from exc
        return Response({"new": _issued(issued), "old": ApiKeySerializer(old).data}, status=status.HTTP_201_CREATED)
