"""The Django admin for usage and money: platform admins look; prices and invoices are
read-only here (they change only through billing.services)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from billing.models import (
    BudgetAlert,
    FailedAttempt,
    Invoice,
    InvoiceLine,
    InvoiceSequence,
    Price,
    Reconciliation,
    RollupProgress,
    UsageRecord,
    UsageRollup,
)


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
                    "cancelled", "input_tokens", "output_tokens", "cached_tokens", "cost",
                    "latency_p99_ms")  # fmt: skip
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
