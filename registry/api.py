"""The registry's management API under /api/v1/, for platform admins: register model versions,
deploy them, split a model's traffic between its versions, set a deployment's replicas and its
LoRA adapters per batch, restart a replica, read the audit log. Canaries, hot-swaps and
autoscaling policies are rollout's (``rollout.api``, under the same prefix).

Views parse, call ``registry.services`` (which hold every write and its audit entry) and
render. A service's refusal is a 400 naming the field; registering a version again is 200
when every value is the same (a retried request) and 409 when any differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import generics, serializers, status
from rest_framework.decorators import api_view, permission_classes
from rest_framework.exceptions import APIException, NotFound, ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.permissions import IsPlatformAdmin
from core.errors import InvalidInput
from registry.adapters import ADAPTER_FRAMEWORK, is_adapter_framework, lora_name
from registry.audit_selectors import audit_entries
from registry.models import SMALL_COUNT_MAX, AuditEntry, Deployment, Model, ModelVersion, Replica, Task
from registry.selectors import deployments_with_replicas, models_with_deployments
from registry.services import (
    MAX_ADAPTERS_PER_BATCH,
    VersionConflict,
    adapter_version_create,
    deployment_adapters_set,
    deployment_bounds_set,
    deployment_create,
    deployment_scale,
    model_version_create,
    replica_restart_request,
    traffic_set,
    upstream_version_create,
)
from registry.upstreams import UPSTREAM_FRAMEWORK, is_upstream_framework
from registry.warm_pool import deployment_standby_set


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "This version is registered already with other values."
    default_code = "conflict"


def refused(exc: InvalidInput, api_fields: Mapping[str, str] | None = None) -> ValidationError:
    """A service's refusal as a 400 naming the field as the API calls it."""
    field = (api_fields or {}).get(exc.field, exc.field)
    return ValidationError({field: [exc.message]})


class GpuRequirementsSerializer(serializers.Serializer[Any]):
    type = serializers.CharField(
        source="gpu_type", max_length=50, required=False, allow_blank=True, default="", help_text="e.g. A100"
    )
    count = serializers.IntegerField(
        source="gpu_count", min_value=0, max_value=SMALL_COUNT_MAX, required=False, default=0
    )
    vram_gb = serializers.IntegerField(
        source="gpu_vram_gb", min_value=0, max_value=2**31 - 1, required=False, default=0, help_text="GPU memory, GB"
    )


class DeploymentSummarySerializer(serializers.ModelSerializer[Deployment]):
    traffic_percent = serializers.IntegerField(source="traffic_weight", read_only=True)

    class Meta:
        model = Deployment
        fields = ["id", "status", "traffic_percent", "replicas", "is_canary", "created_at"]
        read_only_fields = fields


class UpstreamSerializer(serializers.Serializer[Any]):
    """An external upstream, as registered (``registry.upstreams``); its key is never shown."""

    url = serializers.CharField(
        max_length=1024, help_text="the OpenAI-compatible server's base URL, e.g. http://h:8000"
    )
    model = serializers.CharField(
        source="served_model", max_length=255, help_text="the name the upstream serves the model under"
    )
    api_key = serializers.CharField(
        max_length=4096, write_only=True, required=False, default="", allow_blank=True, trim_whitespace=False,
        help_text="the upstream's API key, stored encrypted; never returned",
    )  # fmt: skip
    has_api_key = serializers.SerializerMethodField(help_text="whether a key is stored")

    def get_has_api_key(self, upstream: Any) -> bool:
        return bool(getattr(upstream, "api_key_sealed", ""))


class BaseVersionSerializer(serializers.Serializer[Any]):
    """The base version a LoRA adapter applies to."""

    model = serializers.CharField(max_length=255, help_text="the base's model name")
    version = serializers.CharField(max_length=50, help_text="the base's version")


class AdapterSerializer(serializers.Serializer[Any]):
    """A LoRA adapter version's base (``registry.adapters``)."""

    base = serializers.SerializerMethodField(help_text="the version it applies to")
    rank = serializers.IntegerField(read_only=True, help_text="the LoRA rank r")
    lora_name = serializers.SerializerMethodField(help_text="the name engines serving the base will know it by")

    @extend_schema_field(BaseVersionSerializer)
    def get_base(self, adapter: Any) -> dict[str, str]:
        return {"model": adapter.base.model.name, "version": adapter.base.version}

    def get_lora_name(self, adapter: Any) -> str:
        return lora_name(adapter.version)


class ModelVersionSerializer(serializers.ModelSerializer[ModelVersion]):
    name = serializers.CharField(source="model.name", read_only=True, help_text="the public model name")
    gpu_requirements = GpuRequirementsSerializer(source="*", read_only=True)
    deployments = DeploymentSummarySerializer(many=True, read_only=True)
    upstream = serializers.SerializerMethodField(help_text="where an external version is served; null otherwise")
    adapter = serializers.SerializerMethodField(help_text="a LoRA adapter's base and rank; null otherwise")

    class Meta:
        model = ModelVersion
        fields = [
            "id", "name", "version", "framework", "artifact_uri", "artifact_sha256", "artifact_size",
            "gpu_requirements", "config", "status", "created_at", "deployments", "upstream", "adapter",
        ]  # fmt: skip
        read_only_fields = fields

    @extend_schema_field(UpstreamSerializer(allow_null=True))
    def get_upstream(self, version: ModelVersion) -> dict[str, Any] | None:
        upstream = getattr(version, "upstream", None)
        return UpstreamSerializer(upstream).data if upstream is not None else None

    @extend_schema_field(AdapterSerializer(allow_null=True))
    def get_adapter(self, version: ModelVersion) -> dict[str, Any] | None:
        if not is_adapter_framework(version.framework):
            return None  # no query for the versions that cannot have one
        adapter = getattr(version, "adapter", None)
        return AdapterSerializer(adapter).data if adapter is not None else None


class RegistryModelSerializer(serializers.ModelSerializer[Model]):
    versions = ModelVersionSerializer(many=True, read_only=True)

    class Meta:
        model = Model
        fields = ["name", "task", "description", "owner", "created_at", "versions"]
        read_only_fields = fields


class ModelVersionRegisterSerializer(serializers.Serializer[Any]):
    name = serializers.SlugField(max_length=255, help_text="the public model name (created if new)")
    version = serializers.CharField(max_length=50)
    framework = serializers.CharField(
        max_length=50, help_text="e.g. transformers, pytorch; openai-upstream for a server the platform does not run"
    )
    artifact_uri = serializers.CharField(
        max_length=1024, required=False, help_text="an artifact already in the store (not for openai-upstream)"
    )
    upstream = UpstreamSerializer(required=False, help_text="for openai-upstream only: where it is served")
    base = BaseVersionSerializer(
        required=False,
        help_text="for lora only: the registered version the adapter applies to (a chat or completion LLM)",
    )
    gpu_requirements = GpuRequirementsSerializer(required=False)
    config = serializers.DictField(required=False, default=dict, help_text="e.g. max_seq_len, vocab_size")
    task = serializers.ChoiceField(
        choices=Task.choices, required=False, help_text="a new model's task (default chat); must match an existing one"
    )

    def to_internal_value(self, data: Any) -> Any:
        """The fields' own checks, and which of artifact_uri and upstream the framework takes,
        all named in one 400."""
        errors: dict[str, Any] = {}
        value = None
        try:
            value = super().to_internal_value(data)
        except ValidationError as exc:
            errors = dict(exc.detail) if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
        if isinstance(data, Mapping):
            framework = data.get("framework")
            external = isinstance(framework, str) and is_upstream_framework(framework)
            if external and data.get("upstream") is None:
                errors.setdefault("upstream", [f"An {UPSTREAM_FRAMEWORK} version says where it is served."])
            if external and "artifact_uri" in data:
                errors.setdefault("artifact_uri", [f"An {UPSTREAM_FRAMEWORK} version has no artifact."])
            if not external and "upstream" in data:
                errors.setdefault("upstream", [f"Only an {UPSTREAM_FRAMEWORK} version has an upstream."])
            if not external and "artifact_uri" not in data:
                errors.setdefault("artifact_uri", ["This field is required."])
            adapter = isinstance(framework, str) and is_adapter_framework(framework)
            if adapter and data.get("base") is None:
                errors.setdefault("base", [f"A {ADAPTER_FRAMEWORK} version names its base: {{model, version}}."])
            if not adapter and "base" in data:
                errors.setdefault("base", [f"Only a {ADAPTER_FRAMEWORK} (adapter) version has a base."])
            if adapter and "gpu_requirements" in data:
                errors.setdefault("gpu_requirements", ["An adapter runs on its base's replicas, with their GPUs."])
        if errors:
            raise ValidationError(errors)
        return value


class ReplicaSerializer(serializers.ModelSerializer[Replica]):
    restart_requested_at = serializers.DateTimeField(
        read_only=True, allow_null=True, help_text="a restart asked for and not yet begun by its supervisor"
    )

    class Meta:
        model = Replica
        fields = ["id", "deployment", "host", "endpoint", "state", "standby", "last_heartbeat", "restart_requested_at"]
        read_only_fields = fields


class DeploymentResourcesSerializer(serializers.Serializer[Any]):
    gpu = serializers.CharField(
        source="gpu_type",
        max_length=50,
        required=False,
        allow_blank=True,
        help_text="e.g. A100 (default: the version's)",
    )
    replicas = serializers.IntegerField(
        min_value=0, max_value=SMALL_COUNT_MAX, required=False, default=1, help_text="serving; 0 only with standby ≥ 1"
    )
    min_replicas = serializers.IntegerField(
        min_value=0, max_value=SMALL_COUNT_MAX, required=False, help_text="default 1 (0 with replicas 0)"
    )
    max_replicas = serializers.IntegerField(
        min_value=1, max_value=SMALL_COUNT_MAX, required=False, help_text="default: replicas"
    )
    standby = serializers.IntegerField(
        min_value=0, max_value=SMALL_COUNT_MAX, required=False, default=0,
        help_text="warm standby replicas kept loaded beside the serving ones, never routed; promoted first on "
        "scale-up, a failed replica or a hot-swap",
    )  # fmt: skip
    max_adapters = serializers.IntegerField(
        min_value=0, max_value=MAX_ADAPTERS_PER_BATCH, required=False, default=0,
        help_text="LoRA adapters each engine runs in one batch (vLLM --max-loras); 0: its engines take none. Only "
        "a chat or completion model on the platform's vLLM engines; the adapters of its version are loaded into "
        "its replicas while they run",
    )  # fmt: skip

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        replicas = attrs["replicas"]
        if replicas == 0 and attrs.get("standby", 0) < 1:
            raise ValidationError({"replicas": "Must be at least 1, or 0 with at least one standby replica."})
        attrs.setdefault("min_replicas", min(1, replicas))
        attrs.setdefault("max_replicas", max(1, replicas, attrs["min_replicas"]))
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
            "id", "model_name", "version", "status", "traffic_percent", "is_canary", "resources", "autoscale",
            "replicas", "created_at",
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
    "(a 400 naming artifact_uri when it is missing or unreadable). A new model name creates the model. "
    "A LoRA adapter (framework lora) names its base version; its artifact is a PEFT adapter folder.",
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
        if is_adapter_framework(data["framework"]):
            version, created = adapter_version_create(
                actor=request.user, name=data["name"], version=data["version"], artifact_uri=data["artifact_uri"],
                base=_base_version(data["base"]), config=data["config"], task=data.get("task"),
            )  # fmt: skip
        elif is_upstream_framework(data["framework"]):
            upstream = data["upstream"]
            version, created = upstream_version_create(
                actor=request.user, name=data["name"], version=data["version"], url=upstream["url"],
                served_model=upstream["served_model"], api_key=upstream["api_key"], config=data["config"],
                task=data.get("task"),
            )  # fmt: skip
        else:
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
        raise refused(exc) from exc
    except VersionConflict as exc:
        raise Conflict(str(exc)) from exc
    return Response(
        ModelVersionSerializer(version).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK
    )


def _base_version(base: Mapping[str, str]) -> ModelVersion:
    """The registered version an adapter names as its base, or a 400 naming ``base``."""
    found = (
        ModelVersion.objects.select_related("model").filter(model__name=base["model"], version=base["version"]).first()
    )
    if found is None:
        raise InvalidInput("base", f"There is no registered version {base['model']}:{base['version']}.")
    return found


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
    resources = data.get("resources") or {
        "replicas": 1, "min_replicas": 1, "max_replicas": 1, "standby": 0, "max_adapters": 0,
    }  # fmt: skip
    try:
        deployment = deployment_create(
            actor=request.user,
            version=version,
            traffic_weight=data["traffic_percent"],
            replicas=resources["replicas"],
            min_replicas=resources["min_replicas"],
            max_replicas=resources["max_replicas"],
            gpu_type=resources.get("gpu_type", version.gpu_type),
            standby=resources.get("standby", 0),
            max_adapters=resources.get("max_adapters", 0),
        )
    except InvalidInput as exc:
        refused_fields = {
            "traffic_weight": "traffic_percent", "replicas": "resources", "standby": "resources",
            "max_adapters": "resources",
        }  # fmt: skip
        raise refused(exc, refused_fields) from exc
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
        raise refused(exc) from exc
    return Response(split)


class AuditPagination(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500

    def get_page_size(self, request: Request) -> int:
        """A page_size that is not a positive integer is a 400 (DRF would serve the default)."""
        value = request.query_params.get("page_size")
        if value is None:
            return self.page_size
        if not (value.isascii() and value.isdigit() and int(value) > 0):
            served = self.max_page_size
            raise ValidationError({"page_size": [f"Give a whole number from 1 (at most {served} are served)."]})
        return min(int(value), self.max_page_size)


@extend_schema(
    tags=["registry"],
    parameters=[
        OpenApiParameter("action", str, description="e.g. model_version.register, deployment.create, traffic.set"),
        OpenApiParameter("actor", str, description="the acting user's username, or the part of the platform"),
        OpenApiParameter(
            "target",
            str,
            description="type:id for a target with everything under it (deployment:12 and its replicas, "
            "model:NAME, model_version:NAME:VERSION, replica:7, canary:NAME), else a target's id or name exactly",
        ),
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


# --- Deployment operations: replicas and restarts ---------------------------


class ReplicaBoundsSerializer(serializers.Serializer[Any]):
    replicas = serializers.IntegerField(min_value=1, max_value=SMALL_COUNT_MAX, required=False, help_text="wanted now")
    min_replicas = serializers.IntegerField(min_value=1, max_value=SMALL_COUNT_MAX, required=False)
    max_replicas = serializers.IntegerField(min_value=1, max_value=SMALL_COUNT_MAX, required=False)
    standby = serializers.IntegerField(
        min_value=0, max_value=SMALL_COUNT_MAX, required=False, help_text="warm standbys kept"
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if not attrs:
            raise ValidationError("Give replicas, min_replicas, max_replicas or standby.")
        return attrs


def deployment_numbered(pk: int) -> Deployment:
    found = Deployment.objects.select_related("version__model").filter(pk=pk).first()
    if found is None:
        raise NotFound(f"No deployment {pk}.")
    return found


@extend_schema(
    tags=["registry"],
    description="Set how many replicas the deployment wants now, and the range the autoscaler keeps it in "
    "(1 ≤ min_replicas ≤ replicas ≤ max_replicas), and how many warm standby replicas it keeps (`standby`: "
    "loaded and ready, never routed, promoted first when it scales up or a serving replica fails). "
    "Supervisors with free slots start or stop replicas to follow.",
    request=ReplicaBoundsSerializer,
    responses={200: DeploymentSerializer},
)
@api_view(["PUT"])
@permission_classes([IsPlatformAdmin])
def deployment_replicas(request: Request, pk: int) -> Response:
    deployment = deployment_numbered(pk)
    body = ReplicaBoundsSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    data = body.validated_data
    try:
        with transaction.atomic():
            if "min_replicas" in data or "max_replicas" in data:
                deployment_bounds_set(
                    actor=request.user,
                    deployment=deployment,
                    min_replicas=data.get("min_replicas"),
                    max_replicas=data.get("max_replicas"),
                )
            if "replicas" in data:
                deployment_scale(
                    actor=request.user,
                    deployment=deployment,
                    replicas=data["replicas"],
                    reasons=["set by a platform admin"],
                    action="deployment.scale",
                )
            if "standby" in data:
                deployment_standby_set(actor=request.user, deployment=deployment, standby=data["standby"])
    except InvalidInput as exc:
        raise refused(exc) from exc
    return Response(DeploymentSerializer(deployments_with_replicas().get(pk=pk)).data)


class AdaptersSerializer(serializers.Serializer[Any]):
    max_adapters = serializers.IntegerField(
        min_value=0, max_value=MAX_ADAPTERS_PER_BATCH,
        help_text="LoRA adapters each engine runs in one batch (vLLM --max-loras); 0: LoRA off",
    )  # fmt: skip


@extend_schema(
    tags=["registry"],
    description="Set how many LoRA adapters each engine of the deployment runs in one batch (`max_adapters`, "
    "vLLM's `--max-loras`; 0 turns LoRA off). LoRA is built when an engine starts, so the supervisors then "
    "restart the deployment's engines one replica at a time, each drained first (those in flight finish) and "
    "started again with the new value: a deployment with two replicas or more, or a warm standby, keeps "
    "serving throughout; one with a single replica and no standby pauses while it restarts. Only a pending or "
    "running deployment of a chat or completion model on the platform's vLLM engines; 0 is refused while "
    "adapters deployed on its version have no other deployment to run on.",
    request=AdaptersSerializer,
    responses={200: DeploymentSerializer, 400: OpenApiResponse(description="`max_adapters` refused, and why")},
)
@api_view(["PUT"])
@permission_classes([IsPlatformAdmin])
def deployment_adapters(request: Request, pk: int) -> Response:
    deployment = deployment_numbered(pk)
    body = AdaptersSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    try:
        deployment_adapters_set(
            actor=request.user, deployment=deployment, max_adapters=body.validated_data["max_adapters"]
        )
    except InvalidInput as exc:
        raise refused(exc) from exc
    return Response(DeploymentSerializer(deployments_with_replicas().get(pk=pk)).data)


@extend_schema(
    tags=["registry"],
    request=None,
    description="Restart a ready replica's engine: on its next pass the replica's supervisor drains it (no new "
    "requests are routed to it; those in flight finish), stops the process and starts it again, so the replica "
    "goes draining → starting → ready. `restart_requested_at` shows the request until the new process starts. "
    "A replica that is not ready (a failed one is restarted by its supervisor already), of a deployment that is "
    "not serving, or with a restart requested already is a 400.",
    responses={
        202: ReplicaSerializer,
        400: OpenApiResponse(description="the replica cannot be restarted now"),
        404: OpenApiResponse(description="no such replica"),
    },
)
@api_view(["POST"])
@permission_classes([IsPlatformAdmin])
def replica_restart(request: Request, pk: int) -> Response:
    """Ask for a graceful restart of one replica; its supervisor carries it out."""
    replica = Replica.objects.filter(pk=pk).first()
    if replica is None:
        raise NotFound(f"No replica {pk}.")
    try:
        replica_restart_request(actor=request.user, replica=replica)
    except InvalidInput as exc:
        raise refused(exc) from exc
    replica.refresh_from_db()
    return Response(ReplicaSerializer(replica).data, status=status.HTTP_202_ACCEPTED)
