"""Shared fixtures of the accounts tests: the people of the two-tenant world, and API clients."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient


@pytest.fixture
def people(db: None) -> dict[str, Any]:
    """alice and bob (future org admins), carol (a member), ml (the platform team)."""
    users = get_user_model().objects
    return {
        name: users.create_user(username=name, password="pw-1234567890") for name in ("alice", "bob", "carol", "ml")
    }


def client_for(user: Any) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client
