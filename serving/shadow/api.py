"""Shadow traffic's management API under /api/v1/models/<name>/shadow, for platform admins:
mirror a share of a model's requests to a candidate version, and compare the two.

``PUT`` sets the policy (``serving.shadow.services.shadow_policy_set``: audited, applied by every
gateway at once), ``DELETE`` stops it, ``GET`` shows it with the candidate's figures beside
the primary's on the same requests over a window.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.urls import path
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import api_view, permission_classes
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.permissions import IsPlatformAdmin
from core.errors import InvalidInput
from registry.models import Model, ModelVersion
from serving.gateway.models import ShadowPolicy
from serving.shadow.selectors import shadow_comparison
from serving.shadow.services import shadow_policy_delete, shadow_policy_set

app_name = "shadow"


class ShadowPolicySetSerializer(serializers.Serializer[Any]):
    version = serializers.CharField(max_length=50, help_text="the candidate version that receives the copies")
    percent = serializers.DecimalField(
        max_digits=5, decimal_places=2, min_value=0, max_value=100, help_text="share of the model's requests, 0-100"
    )
    enabled = serializers.BooleanField(required=False, default=True)


class ShadowArmSerializer(serializers.Serializer[Any]):
    requests = serializers.IntegerField()
    failed = serializers.IntegerField(help_text="requests that ended in an error")
    error_rate = serializers.FloatField(allow_null=True)
    latency_p50_ms = serializers.FloatField(allow_null=True)
    latency_p99_ms = serializers.FloatField(allow_null=True)
    ttft_p50_ms = serializers.FloatField(allow_null=True, help_text="streams only")
    ttft_p99_ms = serializers.FloatField(allow_null=True)
    mean_completion_tokens = serializers.FloatField(allow_null=True)
    truncated_share = serializers.FloatField(allow_null=True, help_text="answers cut by max_tokens")


class ShadowAgreementSerializer(serializers.Serializer[Any]):
    items = serializers.IntegerField(help_text="items (rows) of small models' requests answered by both")
    agreed = serializers.IntegerField(help_text="those the candidate labelled as the primary did")
    rate = serializers.FloatField(allow_null=True, help_text="agreed / items; null for token models")


class ShadowComparisonSerializer(serializers.Serializer[Any]):
    since = serializers.DateTimeField()
    candidate_versions = serializers.ListField(child=serializers.CharField())
    candidate = ShadowArmSerializer(help_text="the candidate on the mirrored requests (never billed)")
    primary = ShadowArmSerializer(help_text="the version that answered, on the same requests")
    agreement = ShadowAgreementSerializer(help_text="small models: how often the candidate predicted the same")


class ShadowSerializer(serializers.Serializer[Any]):
    model = serializers.CharField()
    policy = serializers.DictField(allow_null=True, help_text="version, percent, enabled; null when none")
    comparison = ShadowComparisonSerializer()


def _model_named(name: str) -> Model:
    found = Model.objects.filter(name=name).first()
    if found is None:
        raise NotFound(f"No model named {name!r}.")
    return found


def _state(model: Model, hours: float) -> dict[str, Any]:
    policy = ShadowPolicy.objects.select_related("candidate").filter(model=model).first()
    return {
        "model": model.name,
        "policy": None
        if policy is None
        else {"version": policy.candidate.version, "percent": str(policy.percent), "enabled": policy.enabled},
        "comparison": shadow_comparison(model=model.name, since=timezone.now() - timedelta(hours=hours)),
    }


@extend_schema(
    methods=["GET"],
    tags=["registry"],
    description="The model's shadow policy and, over the window, the candidate's figures beside the primary's on "
    "the same mirrored requests (error rate, latency and TTFT percentiles, answer length, truncation).",
    parameters=[
        OpenApiParameter(
            "hours",
            {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 2160},
            description="the window, default 24",
        )
    ],
    responses={200: ShadowSerializer, 400: OpenApiResponse(description="`hours` is not a number from 0 to 2160")},
)
@extend_schema(
    methods=["PUT"],
    tags=["registry"],
    description="Mirror `percent` % of the model's requests to `version`: customers get the primary's answer, the "
    "candidate's is discarded and only its figures are kept; never metered or billed. Copies go to the "
    "candidate's ready replicas: deploy it first (its weight may be 0).",
    request=ShadowPolicySetSerializer,
    responses={200: ShadowSerializer},
)
@extend_schema(
    methods=["DELETE"],
    tags=["registry"],
    description="Stop mirroring the model's requests.",
    responses={204: None, 404: OpenApiResponse(description="no shadow policy")},
)
@api_view(["GET", "PUT", "DELETE"])
@permission_classes([IsPlatformAdmin])
def model_shadow(request: Request, name: str) -> Response:
    model = _model_named(name)
    if request.method == "DELETE":
        if not shadow_policy_delete(model=model, actor=request.user):
            raise NotFound(f"{name} has no shadow policy.")
        return Response(status=status.HTTP_204_NO_CONTENT)
    if request.method == "PUT":
        body = ShadowPolicySetSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        candidate = ModelVersion.objects.filter(model=model, version=data["version"]).first()
        if candidate is None:
            raise ValidationError({"version": [f"{name} has no version {data['version']!r}."]})
        try:
            shadow_policy_set(
                model=model, candidate=candidate, percent=data["percent"], enabled=data["enabled"], actor=request.user
            )
        except InvalidInput as exc:
            raise ValidationError({"version" if exc.field == "candidate" else exc.field: [exc.message]}) from exc
    try:
        hours = float(request.query_params.get("hours", 24))
    except ValueError:
        raise ValidationError({"hours": ["Give a number of hours."]}) from None
    if not 0 < hours <= 24 * 90:
        raise ValidationError({"hours": ["Give a number of hours from 0 to 2160."]})
    return Response(ShadowSerializer(_state(model, hours)).data)


urlpatterns = [path("models/<str:name>/shadow", model_shadow, name="model-shadow")]
