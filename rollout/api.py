"""Rollout's management API under /api/v1/, for platform admins: run a model's canary, hot-swap a
deployment's version, roll a model back to its previous serving version, set a deployment's
autoscaling policy.

Views parse, call rollout's services (``rollout.canary``, ``rollout.hotswap``, ``rollout.rollback``,
``rollout.autoscaler``, which hold every write and its audit entry) and render; a refusal is
a 400 naming the field, a move its state does not allow a 409.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import api_view, permission_classes
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.permissions import IsPlatformAdmin
from core.errors import InvalidInput
from core.transitions import IllegalTransition
from registry.api import Conflict, DeploymentSerializer, deployment_numbered, refused
from registry.models import Deployment, Model, ModelVersion
from registry.selectors import deployments_with_replicas, model_named, model_traffic_split
from rollout.autoscaler import AutoscalePolicy, deployment_autoscale_set
from rollout.canary import (
    CanaryConflict,
    active_canary,
    canary_create,
    canary_pause,
    canary_promote,
    canary_resume,
    canary_rollback,
)
from rollout.canary_stats import CRITERIA
from rollout.hotswap import Swap, deployment_swap_cancel, deployment_swap_version, swap_get
from rollout.models import Canary, CanaryDecision
from rollout.rollback import VIA_HOT_SWAP, model_rollback, rollback_plan
from rollout.selectors import canary_latest, swap_latest_id

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
    found = model_named(name=name)
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
        raise refused(exc) from exc
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
        raise refused(exc) from exc
    return _canary_response(model)


# --- Deployment operations: hot-swap and autoscaling ---------------------------------


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


def _latest_swap(deployment: Deployment) -> Swap | None:
    swap_id = swap_latest_id(deployment_id=deployment.pk)
    return swap_get(swap_id=swap_id) if swap_id is not None else None


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
    deployment = deployment_numbered(pk)
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
            raise refused(exc) from exc
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


# --- Rollback ----------------------------------------------------------------------------


class RollbackRequestSerializer(serializers.Serializer[Any]):
    version = serializers.CharField(
        max_length=50,
        help_text="the version to roll back to, as GET names it (`previous_version`): a change made since is "
        "refused rather than undone in its place",
    )


class RollbackSerializer(serializers.Serializer[Any]):
    model = serializers.CharField(source="model.name")
    serving_version = serializers.CharField(
        source="from_version", help_text="the version that took over at the last change"
    )
    previous_version = serializers.CharField(source="to_version", help_text="the version a rollback returns to")
    change = serializers.CharField(source="change.kind", help_text="hot-swap, canary promotion or rollback")
    changed_at = serializers.DateTimeField(source="change.at")
    via = serializers.CharField(
        help_text="traffic: the previous version's deployments are ready, and take all the traffic at once; "
        "hot-swap: the deployment named is swapped back (the previous version's replicas start, the traffic moves "
        "once every one is ready)"
    )
    deployment = serializers.IntegerField(
        source="deployment.pk", allow_null=True, default=None, help_text="the deployment swapped back (hot-swap)"
    )
    available = serializers.BooleanField(help_text="whether POST would roll back now")
    reason = serializers.CharField(source="refusal", help_text="why not, when not available")


class RollbackDoneSerializer(serializers.Serializer[Any]):
    rollback = RollbackSerializer(help_text="the plan carried out")
    weights = serializers.DictField(
        child=serializers.IntegerField(), allow_null=True, help_text="the split set (via traffic)"
    )
    swap = SwapSerializer(allow_null=True, help_text="the hot-swap started (via hot-swap): follow it with its GET")


@extend_schema(
    methods=["GET"],
    tags=["registry"],
    description="What a rollback of the model would do: the version it served before its last hot-swap, canary "
    "promotion or rollback, how it would go back, and whether it can now (`available`, else `reason`).",
    responses={200: RollbackSerializer, 404: OpenApiResponse(description="its serving version never changed")},
)
@extend_schema(
    methods=["POST"],
    tags=["registry"],
    description="Roll the model back to its previous serving version (`version` confirms which): at once by "
    "traffic when that version's deployments are ready (200), else by a hot-swap of the deployment now serving "
    "back to it (202), which moves no traffic before every replica is ready. Audited `model.rollback`.",
    request=RollbackRequestSerializer,
    responses={
        200: RollbackDoneSerializer,
        202: RollbackDoneSerializer,
        400: OpenApiResponse(description="`version` is not the version to roll back to"),
        409: OpenApiResponse(description="nothing to roll back to, or not now (the reason)"),
    },
)
@api_view(["GET", "POST"])
@permission_classes([IsPlatformAdmin])
def model_rollback_view(request: Request, name: str) -> Response:
    """GET: what a rollback would do. POST: roll back."""
    model = _model_named(name)
    if request.method == "GET":
        plan = rollback_plan(model=model)
        if plan is None:
            raise NotFound(f"{name}'s serving version never changed: there is nothing to roll back to.")
        return Response(RollbackSerializer(plan).data)
    body = RollbackRequestSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    try:
        done = model_rollback(actor=request.user, model=model, version=body.validated_data["version"])
    except InvalidInput as exc:
        if exc.field == "version":
            raise refused(exc) from exc
        raise Conflict(exc.message) from exc
    swap = _latest_swap(done.plan.deployment) if done.swap_to is not None and done.plan.deployment else None
    data = {"rollback": done.plan, "weights": done.weights, "swap": swap}
    started = done.plan.via == VIA_HOT_SWAP
    return Response(
        RollbackDoneSerializer(data).data, status=status.HTTP_202_ACCEPTED if started else status.HTTP_200_OK
    )


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
    deployment = deployment_numbered(pk)
    if not isinstance(request.data, Mapping):
        raise ValidationError({"autoscale": ["Send an object."]})
    try:
        deployment_autoscale_set(actor=request.user, deployment=deployment, autoscale=dict(request.data))
    except InvalidInput as exc:
        parent, _, key = exc.field.partition(".")
        raise ValidationError({key or parent: [exc.message]}) from exc
    return Response(DeploymentSerializer(deployments_with_replicas().get(pk=pk)).data)
