"""The Django admin for accounts and money: platform admins look and adjust; keys are never
deleted; prices and invoices are read-only here (they change only through billing.services)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from billing.models import (
    ApiKey,
    BudgetAlert,
    FailedAttempt,
    Invitation,
    Invoice,
    InvoiceLine,
    InvoiceSequence,
    Membership,
    Organization,
    Plan,
    Price,
    Reconciliation,
    RollupProgress,
    UsageRecord,
    UsageRollup,
)


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
    # shown once); revoking and rotating go through billing.services so gateways hear of it.
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


@admin.register(UsageRecord)
class UsageRecordAdmin(admin.ModelAdmin[UsageRecord]):
    list_display = (
        "request_id",
        "organization",
        "model",
        "model_version",
        "total_tokens",
        "latency_ms",
        "status_code",
        "created_at",
    )
    list_filter = ("model", "status_code")
    date_hierarchy = "created_at"

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(FailedAttempt)
class FailedAttemptAdmin(admin.ModelAdmin[FailedAttempt]):
    """Engine attempts retried elsewhere (never billed): read-only, for the canaries' record."""

    list_display = ("request_id", "model", "model_version", "status_code", "error_code", "latency_ms", "created_at")
    list_filter = ("model", "model_version", "status_code")
    date_hierarchy = "created_at"

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(BudgetAlert)
class BudgetAlertAdmin(admin.ModelAdmin[BudgetAlert]):
    list_display = ("organization", "api_key", "budget", "month", "threshold_percent", "limit", "used", "created_at")
    list_filter = ("budget", "month")

    def has_add_permission(self, request: object) -> bool:
        return False


@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin[Plan]):
    list_display = ("tier", "name", "included_credit", "rate_limit_rpm", "rate_limit_tpm", "max_concurrent")


class _ReadOnlyAdmin(admin.ModelAdmin[Any]):
    """Shown, never written: the row changes only through billing.services (locks, checks,
    gateways told)."""

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Price)
class PriceAdmin(_ReadOnlyAdmin):
    list_display = ("model", "version", "input_per_million", "output_per_million", "cached_input_per_million",
                    "currency", "effective_from", "effective_to")  # fmt: skip
    list_filter = ("model",)


class InvoiceLineInline(admin.TabularInline[InvoiceLine, Invoice]):
    model = InvoiceLine
    extra = 0
    fields = ("kind", "description", "usage_period", "quantity", "unit_price", "amount")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Invoice)
class InvoiceAdmin(_ReadOnlyAdmin):
    list_display = ("number", "organization", "period", "status", "subtotal", "credit", "tax", "total",
                    "finalized_at", "paid_at")  # fmt: skip
    list_filter = ("status", "period")
    search_fields = ("organization__name",)
    inlines = [InvoiceLineInline]


@admin.register(InvoiceLine)
class InvoiceLineAdmin(_ReadOnlyAdmin):
    list_display = ("invoice", "kind", "description", "quantity", "unit_price", "amount")
    list_filter = ("kind",)


@admin.register(UsageRollup)
class UsageRollupAdmin(_ReadOnlyAdmin):
    list_display = ("period", "start", "organization", "api_key", "model", "model_version", "requests", "errors",
                    "input_tokens", "output_tokens", "cached_tokens", "cost", "latency_p99_ms")  # fmt: skip
    list_filter = ("period", "model")
    date_hierarchy = "start"


@admin.register(RollupProgress)
class RollupProgressAdmin(_ReadOnlyAdmin):
    list_display = ("name", "last_record_id", "updated_at")


@admin.register(InvoiceSequence)
class InvoiceSequenceAdmin(_ReadOnlyAdmin):
    list_display = ("name", "next_number")


@admin.register(Reconciliation)
class ReconciliationAdmin(_ReadOnlyAdmin):
    list_display = ("period_start", "period_end", "ok", "stream_events", "records", "rollup_requests",
                    "records_cost", "rollup_cost", "invoiced", "priced", "created_at")  # fmt: skip
    list_filter = ("ok",)
