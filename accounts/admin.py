"""Django's admin for organisations, members, keys, invitations and plans."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from accounts.models import ApiKey, Invitation, Membership, Organization, Plan


class MembershipInline(admin.TabularInline[Membership, Organization]):
    model = Membership
    extra = 0


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin[Organization]):
    list_display = ("name", "slug", "tier", "created_at")
    search_fields = ("name", "slug")
    prepopulated_fields = {"slug": ("name",)}
    inlines = [MembershipInline]

    def has_delete_permission(self, request: HttpRequest, obj: Organization | None = None) -> bool:
        # An organisation with keys or usage is protected by the database (PROTECT); one
        # that never had any may go. Either way its keys are never deleted with it.
        if obj is not None and (obj.api_keys.exists() or obj.usage_records.exists()):
            return False
        return super().has_delete_permission(request, obj)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin[Membership]):
    list_display = ("user", "organization", "role", "created_at")
    list_filter = ("role",)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin[ApiKey]):
    list_display = (
        "prefix",
        "name",
        "organization",
        "tier",
        "rate_limit_rpm",
        "rate_limit_tpm",
        "is_active",
        "expires_at",
        "last_used_at",
    )
    list_filter = ("is_active", "organization")
    search_fields = ("name", "prefix")
    # Keys are created with `manage.py create_api_key` or the management API (the secret is
    # shown once); revoking and rotating go through accounts.services so gateways hear of it.
    readonly_fields = ("key_hash", "prefix", "is_active", "revoked_at", "rotated_to", "last_used_at", "created_at")

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: ApiKey | None = None) -> bool:
        # Keys are revoked, never deleted: usage records, budget alerts and usage events
        # still in the stream refer to them (a deleted key's usage would be dead letters).
        return False


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin[Invitation]):
    list_display = ("username", "organization", "role", "invited_by", "created_at", "accepted_at")
    list_filter = ("role",)
    search_fields = ("username",)
    readonly_fields = ("created_at", "accepted_at")


@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin[Plan]):
    list_display = ("tier", "name", "included_credit", "rate_limit_rpm", "rate_limit_tpm", "max_concurrent")
