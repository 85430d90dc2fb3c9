"""The management REST API for invoices: /api/orgs/{org_pk}/invoices/….

Members of an organisation (and platform admins) read its invoices and download them as
PDF or CSV; anyone else gets 404, as everywhere under /api/orgs/. Only platform admins
draft on demand and move invoices (finalize, pay, void, reissue); a move the invoice's
state does not allow is a 409 naming both states. The rules live in
``billing.services.invoices``; views parse, call and render.
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.http import HttpResponse
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, PermissionDenied, ValidationError
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from accounts.models import Organization
from accounts.permissions import is_platform_admin
from accounts.selectors import organizations_visible_to
from billing import invoicing
from billing.invoice_documents import invoice_csv, invoice_filename, invoice_pdf
from billing.models import Invoice, InvoiceLine
from billing.services import (
    InvoiceFrozen,
    invoice_draft,
    invoice_finalize,
    invoice_mark_paid,
    invoice_reissue,
    invoice_void,
)
from core.errors import InvalidInput
from core.transitions import IllegalTransition


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The invoice's state does not allow this."
    default_code = "conflict"


def _refused(exc: Exception) -> APIException:
    """A service's refusal: 409 for a state that does not allow the move, 400 for bad input."""
    if isinstance(exc, IllegalTransition):
        return Conflict(f"This invoice is {exc.current}: it cannot become {exc.target}.")
    if isinstance(exc, InvoiceFrozen):
        return Conflict(str(exc))
    if isinstance(exc, InvalidInput):
        return ValidationError({exc.field: [exc.message]})
    return ValidationError(str(exc))


class InvoiceLineSerializer(serializers.ModelSerializer[InvoiceLine]):
    usage_period = serializers.SerializerMethodField()

    class Meta:
        model = InvoiceLine
        fields = [
            "id", "kind", "model", "token_kind", "usage_period", "price", "quantity", "unit_price", "amount",
            "description",
        ]  # fmt: skip
        read_only_fields = fields

    def get_usage_period(self, line: InvoiceLine) -> str | None:
        return invoicing.period_label(line.usage_period) if line.usage_period else None


class InvoiceSerializer(serializers.ModelSerializer[Invoice]):
    period = serializers.SerializerMethodField(help_text="the billed UTC month, YYYY-MM")
    display_number = serializers.SerializerMethodField()
    reissued_as = serializers.SerializerMethodField()
    lines = InvoiceLineSerializer(many=True, read_only=True)

    class Meta:
        model = Invoice
        fields = [
            "id", "number", "display_number", "organization", "period", "status", "currency", "subtotal", "credit",
            "tax_rate", "tax", "total", "reissue_of", "reissued_as", "created_at", "updated_at", "finalized_at",
            "paid_at", "voided_at", "void_reason", "lines",
        ]  # fmt: skip
        read_only_fields = fields

    def get_period(self, invoice: Invoice) -> str:
        return invoicing.period_label(invoice.period)

    def get_display_number(self, invoice: Invoice) -> str:
        return invoicing.display_number(invoice)

    def get_reissued_as(self, invoice: Invoice) -> int | None:
        try:
            return invoice.reissued_as.pk
        except Invoice.DoesNotExist:
            return None


class InvoiceListSerializer(InvoiceSerializer):
    class Meta(InvoiceSerializer.Meta):
        fields = [name for name in InvoiceSerializer.Meta.fields if name != "lines"]
        read_only_fields = fields


class DraftSerializer(serializers.Serializer[Any]):
    period = serializers.RegexField(r"^\d{4}-\d{2}$", help_text="the UTC month to invoice, YYYY-MM")


class VoidSerializer(serializers.Serializer[Any]):
    reason = serializers.CharField(max_length=500, help_text="why the invoice is void (kept on it)")


class ReissueSerializer(serializers.Serializer[Any]):
    reason = serializers.CharField(max_length=500, required=False, default="reissued")


class _DownloadRenderer(BaseRenderer):
    """Lets a client ask for the document's type (``Accept: application/pdf``); an error is
    still a JSON body."""

    charset = None
    render_style = "binary"

    def render(self, data: Any, accepted_media_type: str | None = None, renderer_context: Any = None) -> bytes:
        if isinstance(data, str):
            return data.encode()
        if isinstance(data, bytes):
            return data
        rendered: bytes = JSONRenderer().render(data)
        return rendered


class PDFRenderer(_DownloadRenderer):
    media_type = "application/pdf"
    format = "pdf"


class CSVRenderer(_DownloadRenderer):
    media_type = "text/csv"
    format = "csv"


PDF_RESPONSE = {(200, "application/pdf"): OpenApiResponse(OpenApiTypes.BINARY, description="the invoice as a PDF")}
CSV_RESPONSE = {(200, "text/csv"): OpenApiResponse(OpenApiTypes.STR, description="one row per line, then totals")}


class InvoiceViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet[Invoice]):
    """An organisation's invoices: members read and download; platform admins draft and move them."""

    serializer_class = InvoiceSerializer

    def organization(self) -> Organization:
        return get_object_or_404(organizations_visible_to(self.request.user), pk=self.kwargs["org_pk"])

    def require_platform_admin(self) -> Organization:
        organization = self.organization()  # 404 first: other tenants learn nothing
        if not is_platform_admin(self.request.user):
            raise PermissionDenied("Only platform admins may do this.")
        return organization

    def get_queryset(self) -> QuerySet[Invoice]:
        invoices = invoicing.invoices_of(organization=self.organization()).order_by("-period", "-number")
        if self.action == "list":
            return invoices
        return invoices.prefetch_related("lines")

    def get_renderers(self) -> list[BaseRenderer]:
        # Routes are wired by hand (billing/urls.py), so @action(renderer_classes=…) would not apply.
        downloads: dict[str | None, type[BaseRenderer]] = {"pdf": PDFRenderer, "csv": CSVRenderer}
        download = downloads.get(self.action)
        if download is not None:
            return [JSONRenderer(), download()]
        return super().get_renderers()

    def handle_exception(self, exc: Exception) -> Response:
        response = super().handle_exception(exc)
        # An error is a JSON body, and says so, even to a client that asked for the PDF or CSV.
        self.request.accepted_renderer = JSONRenderer()
        self.request.accepted_media_type = JSONRenderer.media_type
        return response

    def perform_content_negotiation(self, request: Request, force: bool = False) -> tuple[BaseRenderer, str]:
        # A method no action takes has only the JSON renderers, so ?format=csv would be a 404
        # before DRF could answer the 405 it owes.
        return super().perform_content_negotiation(request, force=force or self.action is None)

    def get_serializer_class(self) -> type[serializers.BaseSerializer[Invoice]]:
        return InvoiceListSerializer if self.action == "list" else InvoiceSerializer

    def _moved(self, invoice: Invoice, *, created: bool = False) -> Response:
        fresh = self.get_queryset().get(pk=invoice.pk)
        return Response(
            InvoiceSerializer(fresh).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK
        )

    @extend_schema(
        request=DraftSerializer,
        responses={201: InvoiceSerializer, 200: InvoiceSerializer},
        description=(
            "Platform admins: draft the month's invoice (201), or refresh its draft with usage that "
            "arrived since (200). A finalized or paid invoice is returned unchanged (200)."
        ),
    )
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        organization = self.require_platform_admin()
        body = DraftSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            period = invoicing.parse_period(body.validated_data["period"])
            existed = self.get_queryset().filter(period=period).exclude(status=Invoice.Status.VOID).exists()
            invoice = invoice_draft(organization=organization, period=period)
        except ValueError as exc:
            raise ValidationError({"period": [str(exc)]}) from exc
        return self._moved(invoice, created=not existed)

    @extend_schema(
        request=None,
        responses={
            200: InvoiceSerializer,
            400: OpenApiResponse(description="its month has not ended yet"),
            409: OpenApiResponse(description="not a draft"),
        },
    )
    @action(detail=True, methods=["post"])
    def finalize(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        self.require_platform_admin()
        try:
            invoice = invoice_finalize(invoice=self.get_object())
        except (IllegalTransition, InvoiceFrozen, ValueError) as exc:
            raise _refused(exc) from exc
        return self._moved(invoice)

    @extend_schema(request=None, responses={200: InvoiceSerializer, 409: OpenApiResponse(description="not finalized")})
    @action(detail=True, methods=["post"])
    def pay(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        self.require_platform_admin()
        try:
            invoice = invoice_mark_paid(invoice=self.get_object())
        except (IllegalTransition, ValueError) as exc:
            raise _refused(exc) from exc
        return self._moved(invoice)

    @extend_schema(
        request=VoidSerializer, responses={200: InvoiceSerializer, 409: OpenApiResponse(description="paid or void")}
    )
    @action(detail=True, methods=["post"])
    def void(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        self.require_platform_admin()
        body = VoidSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            invoice = invoice_void(invoice=self.get_object(), reason=body.validated_data["reason"])
        except (IllegalTransition, ValueError) as exc:
            raise _refused(exc) from exc
        return self._moved(invoice)

    @extend_schema(
        request=ReissueSerializer,
        responses={201: InvoiceSerializer, 409: OpenApiResponse(description="paid or void")},
        description="Void the invoice and draft its replacement, which takes its usage; answers the new draft.",
    )
    @action(detail=True, methods=["post"])
    def reissue(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        self.require_platform_admin()
        body = ReissueSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            invoice = invoice_reissue(invoice=self.get_object(), reason=body.validated_data["reason"])
        except (IllegalTransition, ValueError) as exc:
            raise _refused(exc) from exc
        return self._moved(invoice, created=True)

    @extend_schema(responses=PDF_RESPONSE)
    @action(detail=True, methods=["get"])
    def pdf(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponse:
        invoice = self.get_object()
        response = HttpResponse(invoice_pdf(invoice), content_type="application/pdf")
        response["Content-Disposition"] = f'attachment; filename="{invoice_filename(invoice, "pdf")}"'
        return response

    @extend_schema(responses=CSV_RESPONSE)
    @action(detail=True, methods=["get"])
    def csv(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponse:
        invoice = self.get_object()
        response = HttpResponse(invoice_csv(invoice), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="{invoice_filename(invoice, "csv")}"'
        return response
