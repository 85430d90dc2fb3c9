"""The data plane's tables in Django's admin: shadow policies (set through the service); shadow records
and files, read-only."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest

from serving.batches.models import StoredFile
from serving.gateway.models import ShadowPolicy
from serving.shadow.models import ShadowRecord
from serving.shadow.services import shadow_policy_delete, shadow_policy_set


@admin.register(ShadowPolicy)
class ShadowPolicyAdmin(admin.ModelAdmin[ShadowPolicy]):
    list_display = ("model", "candidate", "percent", "enabled", "updated_at")
    list_filter = ("enabled",)
    search_fields = ("model__name", "candidate__version")
    readonly_fields = ("updated_at",)

    def get_readonly_fields(self, request: HttpRequest, obj: ShadowPolicy | None = None) -> Any:
        # One policy per model: to move a policy, delete it and add one for the other model.
        return ("model", "updated_at") if obj is not None else ("updated_at",)

    def save_model(self, request: HttpRequest, obj: ShadowPolicy, form: ModelForm[ShadowPolicy], change: bool) -> None:
        # Through the service: validated, audited, and announced to every gateway.
        saved = shadow_policy_set(
            model=obj.model, candidate=obj.candidate, percent=obj.percent, enabled=obj.enabled, actor=request.user
        )
        obj.pk = saved.pk

    def delete_model(self, request: HttpRequest, obj: ShadowPolicy) -> None:
        shadow_policy_delete(model=obj.model, actor=request.user)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ShadowPolicy]) -> None:
        for policy in queryset.select_related("model"):
            shadow_policy_delete(model=policy.model, actor=request.user)


@admin.register(ShadowRecord)
class ShadowRecordAdmin(admin.ModelAdmin[ShadowRecord]):
    """Read-only: written by gateways (serving.shadow.traffic) alone."""

    list_display = ("created_at", "model", "candidate_version", "primary_version", "status_code", "latency_ms",
                    "ttft_ms", "completion_tokens", "finish_reason")  # fmt: skip
    list_filter = ("model", "candidate_version", "status_code", "finish_reason")
    search_fields = ("request_id", "model")
    date_hierarchy = "created_at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: ShadowRecord | None = None) -> bool:
        return False


@admin.register(StoredFile)
class StoredFileAdmin(admin.ModelAdmin[StoredFile]):
    """Files of the Files API, read-only (customers upload and delete them through /v1/files)."""

    list_display = ("public_id", "organization", "purpose", "filename", "bytes", "lines", "created_at")
    list_filter = ("purpose",)
    search_fields = ("public_id", "filename", "organization__name")
    list_select_related = ("organization",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: StoredFile | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: StoredFile | None = None) -> bool:
        return False  # the row indexes bytes in the artifact store: serving.batches.files.file_delete removes both
