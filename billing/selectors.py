"""Reads for accounts."""

from __future__ import annotations

from billing.models import ApiKey


def api_key_by_hash(*, key_hash: str) -> ApiKey | None:
    return ApiKey.objects.select_related("organization").filter(key_hash=key_hash).first()
