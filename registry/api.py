"""The registry's management API under /api/v1/, for platform admins: register model versions,
deploy them, split a model's traffic between its versions, run canaries, hot-swap a deployment's
version, set its replicas and autoscaling, restart a replica, read the audit log.

Views parse, call ``registry.services`` (which hold every write and its audit entry) and
render. A service's refusal is a 400 naming the field; registering a version again is 200
when every value is the same (a retried request) and 409 when any differs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from django.db import transaction
from django.db.models import Q, QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics, serializers, status
from rest_framework.decorators import api_view, permission_classes
from rest_framework.exceptions import APIException, NotFound, ValidationError
from rest_framework.pagination import PageNumberPagination
from rest_framework.request import Request
from rest_framework.response import Response

# Who is a platform admin is billing's (memberships and roles); only this HTTP layer of the
# registry asks, its models and services never import billing.
from accounts.permissions import IsPlatformAdmin
from core.errors import InvalidInput
from registry.autoscaler import AutoscalePolicy
from registry.canary import (
    CanaryConflict,
    active_canary,
    canary_create,
    canary_pause,
    canary_promote,
    canary_resume,
    canary_rollback,
)
from registry.canary_stats import CRITERIA
from registry.hotswap import Swap, swap_get
from registry.models import AuditEntry, Canary, CanaryDecision, Deployment, Model, ModelVersion, Replica, Task
from registry.selectors import (
    audit_entries,
    canary_latest,
    deployments_with_replicas,
    model_traffic_split,
    models_with_deployments,
)
from registry.services import (
    SWAP,
    IllegalTransition,
    VersionConflict,
    deployment_autoscale_set,
    deployment_bounds_set,
    deployment_create,
    deployment_scale,
    deployment_swap_cancel,
    deployment_swap_version,
    model_version_create,
    replica_restart_request,
    traffic_set,
)


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
    restart_requested_at = serializers.DateTimeField(
        read_only=True, allow_null=True, help_text="a restart asked for and not yet begun by its supervisor"
    )

    class Meta:
        model = Replica
        fields = ["id", "deployment", "host", "endpoint", "state", "last_heartbeat", "restart_requested_at"]
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


# --- Canaries -------------------------------------------------------------------------


class CanaryCreateSerializer(serializers.Serializer[Any]):
    base_version = serializers.CharField(max_length=50, help_text="the version serving now")
    canary_version = serializers.CharField(max_length=50, help_text="the candidate")
    canary_percentage = serializers.IntegerField(
        required=False, help_text="the first step (1 to 99) when steps are omitted; default 5"
    )
    steps = serializers.ListField(
        child=serializers.IntegerField(),
        required=False,
        help_text="the canary's percentage at each step, increasing, e.g. [5, 25, 50, 100] (the default)",
    )
    interval_seconds = serializers.IntegerField(help_text="how long each step's window lasts before a decision")
    min_samples = serializers.IntegerField(
        required=False, default=50, help_text="requests each arm needs before any verdict"
    )
    success_criteria = serializers.DictField(
        child=serializers.FloatField(),
        required=False,
        default=dict,
        help_text="absolute bounds on the canary: " + "; ".join(f"{k}: {v}" for k, v in CRITERIA.items()),
    )
    auto_promote = serializers.BooleanField(
        required=False, default=False, help_text="promote at the last step; else hold there for a person"
    )


class CanaryDecisionSerializer(serializers.ModelSerializer[CanaryDecision]):
    actor = serializers.CharField(
        source="actor.username", default=None, read_only=True, allow_null=True, help_text="null: automatic"
    )

    class Meta:
        model = CanaryDecision
        fields = ["id", "at", "step", "canary_percent", "verdict", "reasons", "figures", "actor"]
        read_only_fields = fields


class CanarySerializer(serializers.ModelSerializer[Canary]):
    model = serializers.CharField(source="model.name", read_only=True)
    base_version = serializers.CharField(source="base_version.version", read_only=True)
    canary_version = serializers.CharField(source="canary_version.version", read_only=True)
    canary_percent = serializers.IntegerField(read_only=True, help_text="the current step's percentage")
    weights = serializers.SerializerMethodField(help_text="the model's split in force now: version to percentage")
    created_by = serializers.CharField(
        source="created_by.username",
        default=None,
        read_only=True,
        allow_null=True,
        help_text="null: the operator (a command), or a deleted user",
    )
    decisions = CanaryDecisionSerializer(many=True, read_only=True)

    class Meta:
        model = Canary
        fields = [
            "id", "model", "base_version", "canary_version", "status", "steps", "current_step", "canary_percent",
            "weights", "interval_seconds", "min_samples", "success_criteria", "auto_promote", "step_started_at",
            "next_decision_at", "created_by", "created_at", "updated_at", "decisions",
        ]  # fmt: skip
        read_only_fields = fields

    def get_weights(self, canary: Canary) -> dict[str, int]:
        return model_traffic_split(model=canary.model)


def _model_named(name: str) -> Model:
    found = Model.objects.filter(name=name).first()
    if found is None:
        raise NotFound(f"No model named {name!r}.")
    return found


def _canary_response(model: Model, status_code: int = status.HTTP_200_OK) -> Response:
    canary = canary_latest(model=model)
    return Response(CanarySerializer(canary).data, status=status_code)


@extend_schema(
    methods=["GET"],
    tags=["registry"],
    description="The model's active canary (else its latest): state, current step, the split in force and every "
    "decision with the figures and test statistics that drove it.",
    responses={200: CanarySerializer, 404: OpenApiResponse(description="the model never had a canary")},
)
@extend_schema(
    methods=["POST"],
    tags=["registry"],
    description="Start a canary: the canary version takes the first step's share of the traffic from the base at "
    "once, and the controller judges it at every interval (error rate, latency, TTFT, time per output token, empty "
    "and truncated answers, and the absolute criteria): next step, hold, or roll back. Both versions need a pending "
    "or running deployment.",
    request=CanaryCreateSerializer,
    responses={
        201: CanarySerializer,
        409: OpenApiResponse(description="the model has an active canary already"),
    },
)
@api_view(["GET", "POST"])
@permission_classes([IsPlatformAdmin])
def canary_collection(request: Request, name: str) -> Response:
    """GET: the model's canary and its decisions. POST: start one."""
    model = _model_named(name)
    if request.method == "GET":
        if canary_latest(model=model) is None:
            raise NotFound(f"{name} has no canary.")
        return _canary_response(model)
    body = CanaryCreateSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    data = body.validated_data
    try:
        canary_create(
            actor=request.user,
            model=model,
            base_version=data["base_version"],
            canary_version=data["canary_version"],
            canary_percentage=data.get("canary_percentage"),
            steps=data.get("steps"),
            interval_seconds=data["interval_seconds"],
            min_samples=data["min_samples"],
            success_criteria=data["success_criteria"],
            auto_promote=data["auto_promote"],
        )
    except InvalidInput as exc:
        parent, _, key = exc.field.partition(".")
        if key:  # success_criteria.<key>: nested as DRF nests a dict field's errors
            raise ValidationError({parent: {key: [exc.message]}}) from exc
        raise _refused(exc) from exc
    except CanaryConflict as exc:
        raise Conflict(str(exc)) from exc
    return _canary_response(model, status.HTTP_201_CREATED)


_CANARY_ACTIONS: dict[str, tuple[Callable[..., Canary], str]] = {
    "pause": (canary_pause, "Stop judging; the split stays as it is."),
    "resume": (canary_resume, "Judge again, from a fresh window of the current step."),
    "promote": (canary_promote, "The canary takes all the traffic; the canary is promoted."),
    "rollback": (canary_rollback, "The canary's weight is 0 at once; the base takes all the traffic."),
}


@extend_schema(
    tags=["registry"],
    operation_id="v1_models_canary_action",
    request=None,
    parameters=[OpenApiParameter("action", str, OpenApiParameter.PATH, enum=list(_CANARY_ACTIONS))],
    description="pause, resume, promote or roll back the model's active canary. "
    + " ".join(f"{action}: {text}" for action, (_, text) in _CANARY_ACTIONS.items()),
    responses={
        200: CanarySerializer,
        400: OpenApiResponse(description="the split could not be set (a version's deployment has stopped)"),
        404: OpenApiResponse(description="no active canary"),
        409: OpenApiResponse(description="not from its current state (e.g. resume when running)"),
    },
)
@api_view(["POST"])
@permission_classes([IsPlatformAdmin])
def canary_action(request: Request, name: str, action: str) -> Response:
    """Pause, resume, promote or roll back the model's active canary."""
    model = _model_named(name)
    if action not in _CANARY_ACTIONS:
        raise NotFound(f"No canary action {action!r}.")
    canary = active_canary(model=model)
    if canary is None:
        raise NotFound(f"{name} has no active canary.")
    act, _ = _CANARY_ACTIONS[action]
    try:
        act(actor=request.user, canary=canary)
    except IllegalTransition as exc:
        raise Conflict(f"The canary is {exc.current}: it cannot {action}.") from exc
    except InvalidInput as exc:  # the split could not be set (a version's deployment has stopped)
        raise _refused(exc) from exc
    return _canary_response(model)


# --- Deployment operations: hot-swap, replicas, autoscaling ---------------------------


class SwapRequestSerializer(serializers.Serializer[Any]):
    version = serializers.CharField(max_length=50, help_text="the registered version to serve instead")


class SwapSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField(source="entry.pk", help_text="the swap's audit entry")
    model = serializers.CharField()
    from_version = serializers.CharField()
    to_version = serializers.CharField()
    old_deployment = serializers.IntegerField(source="old_id")
    new_deployment = serializers.IntegerField(source="new_id")
    phase = serializers.CharField(help_text="starting, shifted, draining, completed, aborted or cancelled")
    started_at = serializers.DateTimeField()
    shifted_at = serializers.DateTimeField(allow_null=True, help_text="when the traffic moved to the new replicas")
    drain_at = serializers.DateTimeField(allow_null=True, help_text="when the old replicas began to drain")
    outcome = serializers.CharField(allow_null=True)


class ReplicaBoundsSerializer(serializers.Serializer[Any]):
    replicas = serializers.IntegerField(min_value=1, max_value=32767, required=False, help_text="wanted now")
    min_replicas = serializers.IntegerField(min_value=1, max_value=32767, required=False)
    max_replicas = serializers.IntegerField(min_value=1, max_value=32767, required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if not attrs:
            raise ValidationError("Give replicas, min_replicas or max_replicas.")
        return attrs


def _deployment_numbered(pk: int) -> Deployment:
    found = Deployment.objects.select_related("version__model").filter(pk=pk).first()
    if found is None:
        raise NotFound(f"No deployment {pk}.")
    return found


def _latest_swap(deployment: Deployment) -> Swap | None:
    entry = (
        AuditEntry.objects.filter(action=SWAP)
        .filter(Q(target=str(deployment.pk)) | Q(after__swap_to=deployment.pk))
        .order_by("-id")
        .first()
    )
    return swap_get(swap_id=entry.pk) if entry is not None else None


@extend_schema(
    methods=["GET"],
    tags=["registry"],
    description="The latest hot-swap this deployment took part in (as the old or the new one), with its phase.",
    responses={200: SwapSerializer, 404: OpenApiResponse(description="never swapped")},
)
@extend_schema(
    methods=["POST"],
    tags=["registry"],
    description="Hot-swap: a new deployment of `version` starts (same replicas and bounds, no traffic), the "
    "traffic moves to it once every replica is ready, then this one drains (in-flight requests finish) and "
    "stops. Supervisors carry it out; follow it with GET.",
    request=SwapRequestSerializer,
    responses={202: SwapSerializer, 409: OpenApiResponse(description="a swap of it is under way already")},
)
@extend_schema(
    methods=["DELETE"],
    tags=["registry"],
    description="Cancel the deployment's swap before the traffic moves: the new replicas stop, this one serves on.",
    responses={200: SwapSerializer, 409: OpenApiResponse(description="over, or the traffic has moved already")},
)
@api_view(["GET", "POST", "DELETE"])
@permission_classes([IsPlatformAdmin])
def deployment_swap(request: Request, pk: int) -> Response:
    """GET: the deployment's latest swap. POST: swap it to another version. DELETE: cancel."""
    deployment = _deployment_numbered(pk)
    if request.method == "POST":
        body = SwapRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        version = ModelVersion.objects.filter(
            model_id=deployment.version.model_id, version=body.validated_data["version"]
        ).first()
        if version is None:
            raise ValidationError(
                {"version": [f"{deployment.version.model.name} has no version {body.validated_data['version']!r}."]}
            )
        try:
            deployment_swap_version(actor=request.user, deployment=deployment, version=version)
        except InvalidInput as exc:
            if exc.field == "deployment" and "under way" in exc.message:
                raise Conflict(exc.message) from exc
            raise _refused(exc) from exc
        started = _latest_swap(deployment)
        return Response(SwapSerializer(started).data, status=status.HTTP_202_ACCEPTED)
    swap = _latest_swap(deployment)
    if swap is None:
        raise NotFound(f"Deployment {pk} was never swapped.")
    if request.method == "DELETE":
        try:
            deployment_swap_cancel(actor=request.user, swap=swap.entry)
        except InvalidInput as exc:
            raise Conflict(exc.message) from exc
        swap = swap_get(swap_id=swap.entry.pk)
    return Response(SwapSerializer(swap).data)


@extend_schema(
    tags=["registry"],
    description="Set how many replicas the deployment wants now, and the range the autoscaler keeps it in "
    "(1 ≤ min_replicas ≤ replicas ≤ max_replicas). Supervisors with free slots start or stop replicas to follow.",
    request=ReplicaBoundsSerializer,
    responses={200: DeploymentSerializer},
)
@api_view(["PUT"])
@permission_classes([IsPlatformAdmin])
def deployment_replicas(request: Request, pk: int) -> Response:
    deployment = _deployment_numbered(pk)
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
    except InvalidInput as exc:
        raise _refused(exc) from exc
    return Response(DeploymentSerializer(deployments_with_replicas().get(pk=pk)).data)


@extend_schema(
    tags=["registry"],
    description="Set the deployment's autoscaling policy (every key optional; unknown keys are refused). The "
    "autoscaler scales out on queue depth, in-flight requests per replica and p99 latency or TTFT above target, "
    "and in after a quiet period, within min/max replicas and with cooldowns.",
    request={"application/json": {"type": "object", "example": AutoscalePolicy(enabled=True).as_json()}},
    responses={200: DeploymentSerializer},
)
@api_view(["PUT"])
@permission_classes([IsPlatformAdmin])
def deployment_autoscale(request: Request, pk: int) -> Response:
    deployment = _deployment_numbered(pk)
    if not isinstance(request.data, Mapping):
        raise ValidationError({"autoscale": ["Send an object."]})
    try:
        deployment_autoscale_set(actor=request.user, deployment=deployment, autoscale=dict(request.data))
    except InvalidInput as exc:
        parent, _, key = exc.field.partition(".")
        raise ValidationError({key or parent: [exc.message]}) from exc
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
        raise _refused(exc) from exc
    replica.refresh_from_db()
    return Response(ReplicaSerializer(replica).data, status=status.HTTP_202_ACCEPTED)
