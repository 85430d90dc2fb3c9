"""The registry's management API under /api/v1/, for platform admins: register model versions,
deploy them, split a model's traffic between its versions, read the audit log.

Views parse, call ``registry.services`` (which hold every write and its audit entry) and
render. A service's refusal is a 400 naming the field; registering a version again is 200
when every value is the same (a retried request) and 409 when any differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics, serializers, status
from rest_framework.decorators import api_view, permission_classes
from rest_framework.exceptions import APIException, NotFound, ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

# Who is a platform admin is billing's (memberships and roles); only this HTTP layer of the
# registry asks, its models and services never import billing.
from billing.selectors import is_platform_admin
from core.errors import InvalidInput
from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica, Task
from registry.selectors import audit_entries, deployments_with_replicas, models_with_deployments
from registry.services import VersionConflict, deployment_create, model_version_create, traffic_set


class IsPlatformAdmin(BasePermission):
    message = "Only platform admins manage the model registry."

    def has_permission(self, request: Request, view: APIView) -> bool:
        return is_platform_admin(request.user)


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "This version is registered already with other values."
    default_code = "conflict"


def _refused(exc: InvalidInput, api_fields: Mapping[str, str] | None = None) -> ValidationError:
    """A service's refusal as a 400 naming the field as the API calls it."""
    field = (api_fields or {}).get(exc.field, exc.field)
    return ValidationError({field: [exc.message]})


class GpuRequirementsSerializer(serializers.Serializer[Any]):
    type = serializers.CharField(
        source="gpu_type", max_length=50, required=False, allow_blank=True, default="", help_text="e.g. A100"
    )
    count = serializers.IntegerField(source="gpu_count", min_value=0, max_value=32767, required=False, default=0)
    vram_gb = serializers.IntegerField(
        source="gpu_vram_gb", min_value=0, max_value=2**31 - 1, required=False, default=0, help_text="GPU memory, GB"
    )


class DeploymentSummarySerializer(serializers.ModelSerializer[Deployment]):
    traffic_percent = serializers.IntegerField(source="traffic_weight", read_only=True)

    class Meta:
        model = Deployment
        fields = ["id", "status", "traffic_percent", "replicas", "is_canary", "created_at"]
        read_only_fields = fields


class ModelVersionSerializer(serializers.ModelSerializer[ModelVersion]):
    name = serializers.CharField(source="model.name", read_only=True, help_text="the public model name")
    gpu_requirements = GpuRequirementsSerializer(source="*", read_only=True)
    deployments = DeploymentSummarySerializer(many=True, read_only=True)

    class Meta:
        model = ModelVersion
        fields = [
            "id", "name", "version", "framework", "artifact_uri", "artifact_sha256", "artifact_size",
            "gpu_requirements", "config", "status", "created_at", "deployments",
        ]  # fmt: skip
        read_only_fields = fields


class RegistryModelSerializer(serializers.ModelSerializer[Model]):
    versions = ModelVersionSerializer(many=True, read_only=True)

    class Meta:
        model = Model
        fields = ["name", "task", "description", "owner", "created_at", "versions"]
        read_only_fields = fields


class ModelVersionRegisterSerializer(serializers.Serializer[Any]):
    name = serializers.SlugField(max_length=255, help_text="the public model name (created if new)")
    version = serializers.CharField(max_length=50)
    framework = serializers.CharField(max_length=50, help_text="e.g. transformers, pytorch")
    artifact_uri = serializers.CharField(max_length=1024, help_text="an artifact already in the store")
    gpu_requirements = GpuRequirementsSerializer(required=False)
    config = serializers.DictField(required=False, default=dict, help_text="e.g. max_seq_len, vocab_size")
    task = serializers.ChoiceField(
        choices=Task.choices, required=False, help_text="a new model's task (default chat); must match an existing one"
    )


class ReplicaSerializer(serializers.ModelSerializer[Replica]):
    class Meta:
        model = Replica
        fields = ["id", "host", "endpoint", "state", "last_heartbeat"]
        read_only_fields = fields


class DeploymentResourcesSerializer(serializers.Serializer[Any]):
    gpu = serializers.CharField(
        source="gpu_type",
        max_length=50,
        required=False,
        allow_blank=True,
        help_text="e.g. A100 (default: the version's)",
    )
    replicas = serializers.IntegerField(min_value=1, max_value=32767, required=False, default=1)
    min_replicas = serializers.IntegerField(min_value=0, max_value=32767, required=False, help_text="default 1")
    max_replicas = serializers.IntegerField(min_value=1, max_value=32767, required=False, help_text="default: replicas")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        replicas = attrs["replicas"]
        attrs.setdefault("min_replicas", 1)
        attrs.setdefault("max_replicas", max(replicas, attrs["min_replicas"]))
        low, high = attrs["min_replicas"], attrs["max_replicas"]
        if not low <= replicas <= high:
            raise ValidationError({"replicas": f"Must lie between min_replicas ({low}) and max_replicas ({high})."})
        return attrs


class DeploymentCreateSerializer(serializers.Serializer[Any]):
    model_name = serializers.CharField()
    version = serializers.CharField()
    traffic_percent = serializers.IntegerField(min_value=0, max_value=100, help_text="this deployment's weight")
    resources = DeploymentResourcesSerializer(required=False)


class DeploymentSerializer(serializers.ModelSerializer[Deployment]):
    model_name = serializers.CharField(source="version.model.name", read_only=True)
    version = serializers.CharField(source="version.version", read_only=True)
    traffic_percent = serializers.IntegerField(source="traffic_weight", read_only=True)
    resources = DeploymentResourcesSerializer(source="*", read_only=True)
    replicas = ReplicaSerializer(source="replica_set", many=True, read_only=True, help_text="and their states")

    class Meta:
        model = Deployment
        fields = [
            "id", "model_name", "version", "status", "traffic_percent", "is_canary", "resources", "replicas",
            "created_at",
        ]  # fmt: skip
        read_only_fields = fields


class AuditEntrySerializer(serializers.ModelSerializer[AuditEntry]):
    class Meta:
        model = AuditEntry
        fields = ["id", "actor", "actor_name", "action", "target_type", "target", "before", "after", "created_at"]
        read_only_fields = fields


# {"v1": 50, "v2": 50}: a version string to an integer percentage.
_TRAFFIC_SPLIT: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 100},
    "example": {"v1": 90, "v2": 10},
}


@extend_schema(
    methods=["GET"],
    tags=["registry"],
    description="Every model with its versions, newest first, and their deployments.",
    responses={200: RegistryModelSerializer(many=True)},
)
@extend_schema(
    methods=["POST"],
    tags=["registry"],
    description="Register a version from an artifact already in the artifact store, which is checked and hashed "
    "(a 400 naming artifact_uri when it is missing or unreadable). A new model name creates the model.",
    request=ModelVersionRegisterSerializer,
    responses={
        201: ModelVersionSerializer,
        200: OpenApiResponse(ModelVersionSerializer, description="registered already with the same values"),
        409: OpenApiResponse(description="registered already with other values"),
    },
)
@api_view(["GET", "POST"])
@permission_classes([IsPlatformAdmin])
def model_collection(request: Request) -> Response:
    """GET: every model with its versions and their deployments. POST: register a version."""
    if request.method == "GET":
        return Response(RegistryModelSerializer(models_with_deployments(), many=True).data)
    body = ModelVersionRegisterSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    data = body.validated_data
    try:
        version, created = model_version_create(
            actor=request.user,
            name=data["name"],
            version=data["version"],
            framework=data["framework"],
            artifact_uri=data["artifact_uri"],
            config=data["config"],
            task=data.get("task"),
            **data.get("gpu_requirements", {}),
        )
    except InvalidInput as exc:
        raise _refused(exc) from exc
    except VersionConflict as exc:
        raise Conflict(str(exc)) from exc
    return Response(
        ModelVersionSerializer(version).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK
    )


@extend_schema(tags=["registry"], responses={200: RegistryModelSerializer})
@api_view(["GET"])
@permission_classes([IsPlatformAdmin])
def model_detail(request: Request, name: str) -> Response:
    """One model with its versions and their deployments."""
    model = models_with_deployments(name=name).first()
    if model is None:
        raise NotFound(f"No model named {name!r}.")
    return Response(RegistryModelSerializer(model).data)


@extend_schema(
    methods=["GET"],
    tags=["registry"],
    description="Deployments, newest first, with their replicas and the replicas' states.",
    parameters=[OpenApiParameter("model", str, description="only this model's")],
    responses={200: DeploymentSerializer(many=True)},
)
@extend_schema(
    methods=["POST"],
    tags=["registry"],
    description="Deploy a version: its replicas start, and it takes traffic_percent as its weight.",
    request=DeploymentCreateSerializer,
    responses={201: DeploymentSerializer},
)
@api_view(["GET", "POST"])
@permission_classes([IsPlatformAdmin])
def deployment_collection(request: Request) -> Response:
    """GET: deployments, newest first, with their replicas' states. POST: deploy a version."""
    if request.method == "GET":
        found = deployments_with_replicas(model=request.query_params.get("model") or None)
        return Response(DeploymentSerializer(found, many=True).data)
    body = DeploymentCreateSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    data = body.validated_data
    version = (
        ModelVersion.objects.select_related("model")
        .filter(model__name=data["model_name"], version=data["version"])
        .first()
    )
    if version is None:
        if not Model.objects.filter(name=data["model_name"]).exists():
            raise ValidationError({"model_name": [f"No model named {data['model_name']!r}."]})
        raise ValidationError({"version": [f"{data['model_name']} has no version {data['version']!r}."]})
    resources = data.get("resources") or {"replicas": 1, "min_replicas": 1, "max_replicas": 1}
    try:
        deployment = deployment_create(
            actor=request.user,
            version=version,
            traffic_weight=data["traffic_percent"],
            replicas=resources["replicas"],
            min_replicas=resources["min_replicas"],
            max_replicas=resources["max_replicas"],
            gpu_type=resources.get("gpu_type", version.gpu_type),
        )
    except InvalidInput as exc:
        raise _refused(exc, {"traffic_weight": "traffic_percent", "replicas": "resources"}) from exc
    created = deployments_with_replicas().get(pk=deployment.pk)
    return Response(DeploymentSerializer(created).data, status=status.HTTP_201_CREATED)


@extend_schema(
    tags=["registry"],
    request={"application/json": _TRAFFIC_SPLIT},
    responses={200: OpenApiResponse(_TRAFFIC_SPLIT, description="the split now in force, 0 for versions not named")},
)
@api_view(["PUT"])
@permission_classes([IsPlatformAdmin])
def traffic_split(request: Request, model: str) -> Response:
    """Split a model's traffic between its versions: integer percentages summing to 100. Each
    version named needs a pending or running deployment; every other version gets 0."""
    found = Model.objects.filter(name=model).first()
    if found is None:
        raise NotFound(f"No model named {model!r}.")
    if not isinstance(request.data, Mapping):
        raise ValidationError({"traffic": ["Send an object of version: percentage."]})
    try:
        split = traffic_set(actor=request.user, model=found, weights=request.data)
    except InvalidInput as exc:
        raise _refused(exc) from exc
    return Response(split)


class AuditPagination(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500


@extend_schema(
    tags=["registry"],
    parameters=[
        OpenApiParameter("action", str, description="e.g. model_version.register, deployment.create, traffic.set"),
        OpenApiParameter("actor", str, description="the acting user's username"),
        OpenApiParameter("target", str, description="the target's id or name, exactly"),
        OpenApiParameter("q", OpenApiTypes.STR, description="text in the target, action or username"),
    ],
)
class AuditEntryList(generics.ListAPIView[AuditEntry]):
    """The audit log of management writes, newest first."""

    serializer_class = AuditEntrySerializer
    permission_classes = [IsPlatformAdmin]
    pagination_class = AuditPagination

    def get_queryset(self) -> QuerySet[AuditEntry]:
        params = self.request.query_params
        return audit_entries(
            action=params.get("action"), actor=params.get("actor"), target=params.get("target"), q=params.get("q")
        )
