"""Shared fixtures of the registry's API tests: the people who call it and a model with deployments."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from accounts.models import Role
from accounts.services import membership_set, platform_organization
from registry.models import Deployment, Model
from tests.support.api import client_for
from tests.support.registry import make_version


@pytest.fixture
def people(alice_org) -> dict[str, Any]:
    """ml (the platform team), alice (an org admin, nothing more), and nobody signed in."""
    users = get_user_model().objects
    ml, alice = (users.create_user(username=name, password="pw-1234567890") for name in ("ml", "alice"))
    membership_set(user=ml, organization=platform_organization(), role=Role.PLATFORM_ADMIN)
    membership_set(user=alice, organization=alice_org, role=Role.ORG_ADMIN)
    return {"ml": ml, "alice": alice, "anonymous": None}


@pytest.fixture
def ml(people) -> APIClient:
    return client_for(people["ml"])


@pytest.fixture
def chat_model(db) -> Model:
    """gpt-tiny with v1 and v2 deployed and running, and v3 whose only deployment is stopped."""
    model = Model.objects.create(name="gpt-tiny", task="chat")
    for name, status in (("v1", "running"), ("v2", "pending"), ("v3", "stopped")):
        weight = 100 if name == "v1" else 0
        Deployment.objects.create(version=make_version(model, name), status=status, traffic_weight=weight)
    return model
