"""The registry in Django's admin: status fields and the audit log are read-only."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from registry.models import (
    Adapter,
    AuditEntry,
    Deployment,
    HostLease,
    LoadedAdapter,
    Model,
    ModelVersion,
    Replica,
    Upstream,
)


class ModelVersionInline(admin.TabularInline[ModelVersion, Model]):
    model = ModelVersion
    extra = 0
    fields = ("version", "framework", "status", "artifact_uri", "artifact_size", "created_at")
    readonly_fields = fields
    show_change_link = True


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin[Model]):
    list_display = ("name", "task", "owner", "created_at")
    list_filter = ("task",)
    search_fields = ("name", "description", "owner")
    inlines = [ModelVersionInline]


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin[ModelVersion]):
    list_display = ("model", "version", "framework", "status", "artifact_size", "created_at")
    list_filter = ("status", "framework")
    search_fields = ("model__name", "version", "artifact_sha256")
    # Status moves only through registry.services (guarded transitions), never by editing.
    readonly_fields = ("status", "artifact_sha256", "artifact_size", "created_at")


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin[Deployment]):
    list_display = ("version", "replicas", "min_replicas", "max_replicas", "traffic_weight", "is_canary", "status")
    list_filter = ("status", "is_canary")
    readonly_fields = ("status", "created_at")


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin[Replica]):
    list_display = ("deployment", "host", "endpoint", "pid", "state", "last_heartbeat")
    list_filter = ("state", "host")
    readonly_fields = ("state", "pid", "last_heartbeat", "created_at")


@admin.register(Upstream)
class UpstreamAdmin(admin.ModelAdmin[Upstream]):
    """Read-only, and never the key: an upstream is registered through the management API
    (``registry.services.upstream_version_create``), its key rotated by ``upstream_key_set``."""

    list_display = ("version", "url", "served_model", "created_at")
    search_fields = ("version__model__name", "url", "served_model")
    fields = ("version", "url", "served_model", "created_at")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Upstream | None = None) -> bool:
        return False


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin[Adapter]):
    """Read-only: an adapter is registered with its base through the management API
    (``registry.services.adapter_version_create``) or the bundled import, read and checked there."""

    list_display = ("version", "base", "rank", "created_at")
    search_fields = ("version__model__name", "base__model__name")
    fields = ("version", "base", "rank", "created_at")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Adapter | None = None) -> bool:
        return False


@admin.register(LoadedAdapter)
class LoadedAdapterAdmin(admin.ModelAdmin[LoadedAdapter]):
    """Read-only: written by the replica's supervisor once its engine loaded the adapter
    (``serving.supervisor.adapters``); a row by hand would route requests to an engine without it."""

    list_display = ("version", "replica", "pid", "loaded_at")
    search_fields = ("version__model__name",)
    fields = ("version", "replica", "pid", "loaded_at")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: LoadedAdapter | None = None) -> bool:
        return False


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin[AuditEntry]):
    """Read-only: entries are written by registry.services.audit_record alone, never edited."""

    list_display = ("created_at", "actor_name", "action", "target_type", "target")
    list_filter = ("action", "target_type")
    search_fields = ("target", "action", "actor_name")
    readonly_fields = ("actor", "actor_name", "action", "target_type", "target", "before", "after", "created_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: AuditEntry | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: AuditEntry | None = None) -> bool:
        return False


@admin.register(HostLease)
class HostLeaseAdmin(admin.ModelAdmin[HostLease]):
    """Read-only: which supervisor holds each host. Only the supervisors take, renew and release
    leases (``registry.services.host_lease_*``); one deleted by hand would stop its holder, and
    one a holder killed with SIGKILL left expires by itself."""

    list_display = ("host", "holder", "taken_at", "expires_at")
    search_fields = ("host", "holder")
    readonly_fields = ("host", "holder", "taken_at", "expires_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: HostLease | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: HostLease | None = None) -> bool:
        return False
