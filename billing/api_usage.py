"""``GET /api/orgs/{org_pk}/usage/``: an organisation's usage by UTC day, model and key, from the
daily rollups, for its members (platform admins: any organisation; anyone else: 404)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.selectors import organizations_visible_to
from billing.models import EXACT_DECIMAL_PLACES, EXACT_MAX_DIGITS
from billing.usage_selectors import (
    USAGE_DEFAULT_DAYS,
    USAGE_PAGE_DEFAULT,
    USAGE_PAGE_MAX,
    DailyUsage,
    InvalidCursor,
    UsageCursor,
    UsagePage,
    usage_daily_for_organization,
    usage_window,
)


class UsageQuerySerializer(serializers.Serializer[Any]):
    start_date = serializers.DateField(
        required=False, help_text=f"first UTC day, inclusive (default: {USAGE_DEFAULT_DAYS} days up to end_date)"
    )
    end_date = serializers.DateField(required=False, help_text="last UTC day, inclusive (default: today)")
    api_key = serializers.IntegerField(required=False, min_value=1, help_text="only this key's usage")
    limit = serializers.IntegerField(
        required=False, min_value=1, max_value=USAGE_PAGE_MAX, default=USAGE_PAGE_DEFAULT, help_text="rows per page"
    )
    after = serializers.CharField(required=False, help_text="the previous page's next_page")

    def validate_after(self, value: str) -> UsageCursor:
        try:
            return UsageCursor.decode(value)
        except InvalidCursor:
            raise serializers.ValidationError("Not a cursor from this endpoint's next_page.") from None

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        try:
            attrs["start_date"], attrs["end_date"] = usage_window(
                start=attrs.get("start_date"), end=attrs.get("end_date"), today=timezone.now().date()
            )
        except ValueError:
            raise serializers.ValidationError({"start_date": ["It is after end_date (default: today, UTC)."]}) from None
        return attrs


class DailyUsageSerializer(serializers.Serializer[DailyUsage]):
    object = serializers.SerializerMethodField()
    date = serializers.DateField(help_text="UTC day")
    model = serializers.CharField()
    api_key = serializers.IntegerField(source="api_key_id")
    api_key_name = serializers.CharField()
    api_key_prefix = serializers.CharField()
    requests = serializers.IntegerField()
    # DRF's metaclass takes declared fields off the class, so this does not hide
    # Serializer.errors at run time; mypy sees only the class body.
    errors = serializers.IntegerField(  # type: ignore[assignment]
        help_text="requests whose status was not 2xx, but for those their clients cancelled"
    )
    cancelled = serializers.IntegerField(
        help_text="requests their clients cancelled before they finished (status 499): not errors"
    )
    input_tokens = serializers.IntegerField(help_text="prompt tokens not served from a cache")
    output_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(
        max_digits=EXACT_MAX_DIGITS, decimal_places=EXACT_DECIMAL_PLACES, help_text="exact, not rounded"
    )
    batch_requests = serializers.IntegerField(help_text="of `requests`: batch jobs' lines")
    batch_cost = serializers.DecimalField(
        max_digits=EXACT_MAX_DIGITS, decimal_places=EXACT_DECIMAL_PLACES, help_text="of `cost`: batch jobs' lines'"
    )
    currency = serializers.SerializerMethodField()

    def get_object(self, row: DailyUsage) -> str:
        return "usage.daily"

    def get_currency(self, row: DailyUsage) -> str:
        return str(settings.BILLING_CURRENCY)


class UsagePageSerializer(serializers.Serializer[UsagePage]):
    object = serializers.SerializerMethodField()
    data = DailyUsageSerializer(many=True, source="rows")  # type: ignore[assignment]  # as `errors` above
    has_more = serializers.BooleanField()
    next_page = serializers.SerializerMethodField(help_text="pass as `after` for the next page; null on the last")

    def get_object(self, page: UsagePage) -> str:
        return "list"

    def get_next_page(self, page: UsagePage) -> str | None:
        cursor = page.next_page
        return cursor.encode() if cursor else None


class OrganizationUsageView(APIView):
    @extend_schema(
        parameters=[UsageQuerySerializer],
        responses={200: UsagePageSerializer, 400: OpenApiResponse(description="a query parameter is invalid")},
        description=(
            "The organisation's usage and cost by UTC day, model and key, oldest first, from the daily "
            "rollups (today's trail the requests by about a minute)."
        ),
    )
    def get(self, request: Request, org_pk: int) -> Response:
        organization = get_object_or_404(organizations_visible_to(request.user), pk=org_pk)
        # A plain dict, not the QueryDict: DRF reads an empty value in a QueryDict as an
        # absent one, and `?start_date=` is not a date.
        query = UsageQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        params = query.validated_data
        page = usage_daily_for_organization(
            organization_id=organization.pk,
            start=params["start_date"],
            end=params["end_date"],
            api_key_id=params.get("api_key"),
            limit=params["limit"],
            after=params.get("after"),
        )
        return Response(UsagePageSerializer(page).data)
