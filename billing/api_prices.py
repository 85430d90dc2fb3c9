"""The management API for prices: anyone signed in reads them; platform admins set them.

``POST /api/prices/`` never edits a price in place: it starts a new one (now, or at
``effective_from``) and ends the one in effect then, so every usage record keeps the
price it was charged at.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.permissions import is_platform_admin
from billing.models import PRICE_DECIMAL_PLACES, PRICE_MAX_DIGITS, Price
from billing.services import price_set
from core.errors import InvalidInput
from registry.models import Model, ModelVersion


def _amount(help_text: str, *, required: bool = True) -> serializers.DecimalField:
    return serializers.DecimalField(
        max_digits=PRICE_MAX_DIGITS,
        decimal_places=PRICE_DECIMAL_PLACES,
        min_value=0,
        required=required,
        help_text=help_text,
    )


class PriceSerializer(serializers.ModelSerializer[Price]):
    model: serializers.SlugRelatedField[Model] = serializers.SlugRelatedField(slug_field="name", read_only=True)
    version: serializers.SlugRelatedField[ModelVersion] = serializers.SlugRelatedField(
        slug_field="version", read_only=True, allow_null=True
    )

    class Meta:
        model = Price
        fields = [
            "id", "model", "version", "input_per_million", "output_per_million", "cached_input_per_million",
            "per_thousand_inferences", "cached_per_thousand_inferences", "batch_percent", "currency", "effective_from",
            "effective_to", "created_at",
        ]  # fmt: skip
        read_only_fields = fields


class PriceSetSerializer(serializers.Serializer[Any]):
    model = serializers.CharField(help_text="the public model name")
    version = serializers.CharField(required=False, allow_null=True, help_text="one version only (default: all)")
    input_per_million = _amount("price of a million input tokens")
    output_per_million = _amount("price of a million output tokens")
    cached_input_per_million = _amount("price of a million cached input tokens (default: the input price)",
                                       required=False)  # fmt: skip
    per_thousand_inferences = _amount("price of a thousand inferences (small models; default 0)", required=False)
    cached_per_thousand_inferences = _amount(
        "price of a thousand inferences answered from the result cache (default: the inference price)",
        required=False,
    )
    batch_percent = serializers.DecimalField(
        max_digits=5, decimal_places=2, min_value=Decimal(0), max_value=Decimal(100), required=False,
        help_text="what batch jobs' requests pay, in percent of each price (default 50)",
    )  # fmt: skip
    effective_from = serializers.DateTimeField(required=False, help_text="default: now")
    currency = serializers.CharField(required=False, max_length=3)


class PriceViewSet(mixins.ListModelMixin, mixins.CreateModelMixin, viewsets.GenericViewSet[Price]):
    serializer_class = PriceSerializer

    def get_queryset(self) -> QuerySet[Price]:
        prices = Price.objects.select_related("model", "version").order_by("model__name", "-effective_from")
        ended_too = self.request.query_params.get("all", "false")
        if ended_too not in ("true", "false"):
            raise ValidationError({"all": ["Give true or false."]})
        if ended_too == "false":
            prices = prices.exclude(effective_to__lte=timezone.now())  # current and scheduled
        model = self.request.query_params.get("model")
        return prices.filter(model__name=model) if model else prices

    @extend_schema(
        parameters=[
            OpenApiParameter("model", str, description="only this model"),
            OpenApiParameter("all", bool, description="include prices that have ended"),
        ],
        responses={200: PriceSerializer(many=True), 400: OpenApiResponse(description="`all` is not true or false")},
    )
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)

    @extend_schema(request=PriceSetSerializer, responses={201: PriceSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        if not is_platform_admin(request.user):
            raise PermissionDenied("Only platform admins set prices.")
        body = PriceSetSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)
        model = Model.objects.filter(name=data.pop("model")).first()
        if model is None:
            raise ValidationError({"model": "No such model."})
        version_name = data.pop("version", None)
        version = None
        if version_name:
            version = ModelVersion.objects.filter(model=model, version=version_name).first()
            if version is None:
                raise ValidationError({"version": f"{model.name} has no version {version_name!r}."})
        try:
            price = price_set(model=model, version=version, actor=request.user, **data)
        except InvalidInput as exc:
            raise ValidationError({exc.field: exc.message}) from exc
        return Response(PriceSerializer(price).data, status=status.HTTP_201_CREATED)
