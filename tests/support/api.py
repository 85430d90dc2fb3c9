"""Clients for the management API."""

from __future__ import annotations

from typing import Any

from rest_framework.test import APIClient


def client_for(user: Any) -> APIClient:
    """An API client signed in as ``user`` (or anonymous for None)."""
    client = APIClient()
    client.force_authenticate(user)
    return client
