"""What every page of the console and the portal shares: paging a list, pager links that keep
the filters, file downloads, answers that must never be stored (a key's secret), and a
service's refusal shown on the form field it names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django import forms
from django.core.paginator import Page, Paginator
from django.http import HttpRequest, HttpResponse
from django.utils.cache import add_never_cache_headers

from core.errors import InvalidInput


def page_of(request: HttpRequest, items: Any, per_page: int, param: str = "page") -> Page[Any]:
    """The page of ``items`` the request asks for (``?page=``; out of range: the last)."""
    return Paginator(items, per_page).get_page(request.GET.get(param))


def query_without_page(request: HttpRequest, param: str = "page") -> str:
    """The list's filters, for pagination links that keep them."""
    query = request.GET.copy()
    query.pop(param, None)
    return query.urlencode()


def attachment(content: str | bytes, *, content_type: str, filename: str) -> HttpResponse:
    response = HttpResponse(content, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def never_stored(response: HttpResponse) -> HttpResponse:
    """Mark an answer that carries a secret: no cache or browser history may keep it."""
    add_never_cache_headers(response)
    response["Cache-Control"] += ", no-store"
    return response


def refuse(form: forms.Form, exc: InvalidInput, rename: Mapping[str, str] | None = None) -> None:
    """Show a service's ``InvalidInput`` on the field it names (after ``rename``; a dotted name
    ``parent.key`` on ``key``), else above the form."""
    field = (rename or {}).get(exc.field, exc.field)
    key = field.rpartition(".")[2]
    form.add_error(key if key in form.fields else None, exc.message)
