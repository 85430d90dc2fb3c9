"""The semantic cache's management API, for platform admins: purge entries, see what it holds.

``POST /api/cache/purge/`` deletes the entries of a model, a version or an organisation
(``serving.semcache.services.cache_purge``); ``GET /api/cache/stats/`` counts entries and hits per
model and version and says how large the table and its indexes are.
"""

from __future__ import annotations

from typing import Any

from django.urls import path
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.decorators import api_view
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.models import Organization
from accounts.permissions import is_platform_admin
from core.errors import InvalidInput
from serving.semcache.services import cache_purge
from serving.semcache.store import cache_stats

app_name = "cache"


class CachePurgeSerializer(serializers.Serializer[Any]):
    model = serializers.CharField(required=False, help_text="the public model name")
    version = serializers.CharField(
        required=False, help_text="one version (of the model given, or of every model when alone)"
    )
    organization = serializers.IntegerField(required=False, help_text="the id of the organisation that stored them")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if not attrs:
            raise ValidationError("Give at least one of model, version or organization.")
        return attrs


class CachePurgedSerializer(serializers.Serializer[Any]):
    purged = serializers.IntegerField(help_text="how many entries were deleted")


class CacheModelStatsSerializer(serializers.Serializer[Any]):
    model = serializers.CharField()
    version = serializers.CharField()
    entries = serializers.IntegerField(help_text="unexpired entries")
    expired = serializers.IntegerField(help_text="expired entries the next purge deletes")
    hits = serializers.IntegerField()


class CacheStatsSerializer(serializers.Serializer[Any]):
    models = CacheModelStatsSerializer(many=True)
    entries = serializers.IntegerField(help_text="unexpired entries, all models")
    table_bytes = serializers.IntegerField()
    index_bytes = serializers.IntegerField(help_text="all indexes of the table")
    hnsw_index_bytes = serializers.IntegerField(help_text="the HNSW index alone")


def _require_platform_admin(request: Request) -> None:
    if not is_platform_admin(request.user):
        raise PermissionDenied("Only platform admins manage the semantic cache.")


@extend_schema(request=CachePurgeSerializer, responses={200: CachePurgedSerializer})
@api_view(["POST"])
def purge(request: Request) -> Response:
    """Delete the cache entries that match every filter given."""
    _require_platform_admin(request)
    body = CachePurgeSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    data = body.validated_data
    organization = None
    if "organization" in data:
        organization = Organization.objects.filter(pk=data["organization"]).first()
        if organization is None:
            raise ValidationError({"organization": "No such organisation."})
    try:
        purged = cache_purge(model=data.get("model"), version=data.get("version"), organization=organization)
    except InvalidInput as exc:
        raise ValidationError({exc.field: exc.message}) from exc
    return Response({"purged": purged})


@extend_schema(responses={200: CacheStatsSerializer})
@api_view(["GET"])
def stats(request: Request) -> Response:
    """Entries and hits per model and version; the table's size on disk."""
    _require_platform_admin(request)
    return Response(CacheStatsSerializer(cache_stats()).data)


urlpatterns = [
    path("purge/", purge, name="purge"),
    path("stats/", stats, name="stats"),
]
