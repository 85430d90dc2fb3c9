"""Canaries in Django's admin: read-only, they move through the API and the controller."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from rollout.models import Canary, CanaryDecision


class CanaryDecisionInline(admin.TabularInline[CanaryDecision, Canary]):
    model = CanaryDecision
    extra = 0
    fields = ("at", "step", "canary_percent", "verdict", "reasons", "actor")
    readonly_fields = fields
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Canary | None = None) -> bool:
        return False


@admin.register(Canary)
class CanaryAdmin(admin.ModelAdmin[Canary]):
    """Read-only: canaries start and move through the API (rollout.canary), never by editing."""

    list_display = ("model", "base_version", "canary_version", "status", "current_step", "steps", "updated_at")
    list_filter = ("status",)
    search_fields = ("model__name",)
    inlines = [CanaryDecisionInline]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Canary | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Canary | None = None) -> bool:
        return False


@admin.register(CanaryDecision)
class CanaryDecisionAdmin(admin.ModelAdmin[CanaryDecision]):
    """Read-only: every decision with the figures and statistics behind it (rollout.canary)."""

    list_display = ("at", "canary", "step", "canary_percent", "verdict", "actor")
    list_filter = ("verdict",)
    search_fields = ("canary__model__name",)
    list_select_related = ("canary__model", "actor")
    readonly_fields = ("canary", "at", "step", "canary_percent", "verdict", "reasons", "figures", "actor")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: CanaryDecision | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: CanaryDecision | None = None) -> bool:
        return False
