"""Bring a fresh installation to a usable state: schema, bundled models, admin, demo key.

Idempotent. Credentials made here for local use (the admin password, the demo key) are
kept in var/bootstrap.json, readable by the operator only, so a second run can print them
again; a real deployment sets PLATFORM_ADMIN_PASSWORD and issues keys with create_api_key.
"""

from __future__ import annotations

import json
import os
import secrets
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

from accounts.models import ApiKey, Role, Tier
from accounts.services import (
    api_key_create,
    api_key_hash,
    api_key_update,
    membership_set,
    organization_get_or_create,
    platform_organization,
)
from billing.models import Price
from billing.services import price_set
from core.embedded import VAR_DIR
from registry.bundled import BUNDLED_MODELS
from registry.models import Deployment, Model, ModelVersion
from registry.services import deployment_create

# What the bundled models cost in the demo (billing currency per million tokens: input,
# output, cached input). Change them with the prices API; bootstrap never overwrites one.
DEMO_PRICES = {
    "smollm2-135m-instruct": ("0.10", "0.30", "0.05"),
    "all-minilm-l6-v2": ("0.02", "0", "0.01"),
}
# The small models' demo prices per thousand inferences (and per thousand from the result cache).
DEMO_INFERENCE_PRICES = {
    "digits-mlp": ("0.05", "0.01"),
    "breast-cancer-gbt": ("0.08", "0.02"),
    "sentiment-minilm": ("0.20", "0.04"),
}
DEMO_ORG = "Demo"
DEMO_KEY_NAME = "demo"


def _credentials_file() -> Path:
    return Path(os.environ.get("BOOTSTRAP_CREDENTIALS", VAR_DIR / "bootstrap.json"))


def _load_credentials() -> dict[str, str]:
    path = _credentials_file()
    return json.loads(path.read_text()) if path.exists() else {}


def _save_credentials(data: dict[str, str]) -> None:
    path = _credentials_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)


class Command(BaseCommand):
    help = "Migrate, import bundled models, create the platform admin and a demo API key."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--skip-models", action="store_true", help="do not import bundled models")
        parser.add_argument("--admin-username", default=os.environ.get("PLATFORM_ADMIN_USERNAME", "admin"))

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write("== migrating the database")
        call_command("migrate", interactive=False, verbosity=0)
        if not options["skip_models"]:
            self.stdout.write("== importing bundled models")
            call_command("import_bundled_models", stdout=self.stdout)
            self.stdout.write("== building the semantic cache's paraphrase verifier")
            call_command("build_cache_verifier", stdout=self.stdout)
            self._ensure_default_deployments()
            self._ensure_default_prices()
        credentials = _load_credentials()
        self.stdout.write("== accounts")
        username = options["admin_username"]
        password = self._ensure_admin(username, credentials)
        key = self._ensure_demo_key(credentials)
        _save_credentials(credentials)
        self.stdout.write(self.style.SUCCESS("bootstrap complete"))
        self.stdout.write(f"  console login:  {username} / {password or '(set earlier; see PLATFORM_ADMIN_PASSWORD)'}")
        self.stdout.write(f"  demo API key:   {key}")
        self.stdout.write(f"  (kept for local use in {_credentials_file()})")

    def _ensure_default_deployments(self) -> None:
        """One replica of each bundled model, unless the model already has a deployment. Never
        of a bundled adapter: it is served beside its base (engines do not load adapters yet)."""
        for bundled in BUNDLED_MODELS:
            if bundled.is_adapter:
                continue
            version = ModelVersion.objects.filter(model__name=bundled.name, version=bundled.version).first()
            if version is None or Deployment.objects.filter(version__model=version.model).exists():
                continue
            deployment_create(version=version, replicas=1, min_replicas=1, max_replicas=1)
            self.stdout.write(f"  deployment created: {version} x1")

    def _ensure_default_prices(self) -> None:
        """Demo prices for the bundled models (per million tokens), unless they have a price."""
        for name, (input_price, output_price, cached_price) in DEMO_PRICES.items():
            model = Model.objects.filter(name=name).first()
            if model is None or Price.objects.filter(model=model).exists():
                continue
            price_set(
                model=model,
                input_per_million=input_price,
                output_per_million=output_price,
                cached_input_per_million=cached_price,
            )
            self.stdout.write(f"  price set: {name} {input_price} in / {output_price} out per 1M tokens")
        for name, (per_thousand, cached_per_thousand) in DEMO_INFERENCE_PRICES.items():
            model = Model.objects.filter(name=name).first()
            if model is None or Price.objects.filter(model=model).exists():
                continue
            price_set(
                model=model,
                input_per_million="0",
                output_per_million="0",
                per_thousand_inferences=per_thousand,
                cached_per_thousand_inferences=cached_per_thousand,
            )
            self.stdout.write(f"  price set: {name} {per_thousand} per 1K inferences")

    def _ensure_admin(self, username: str, credentials: dict[str, str]) -> str | None:
        user_model = get_user_model()
        user = user_model.objects.filter(username=username).first()
        env_password = os.environ.get("PLATFORM_ADMIN_PASSWORD")
        if user is None:
            password = env_password or credentials.get("admin_password") or secrets.token_urlsafe(12)
            user = user_model.objects.create_superuser(username=username, email="", password=password)
            credentials["admin_username"] = username
            credentials["admin_password"] = password
        elif env_password and not user.check_password(env_password):
            user.set_password(env_password)
            user.save(update_fields=["password"])
            credentials["admin_password"] = env_password
        platform = platform_organization()
        membership_set(user=user, organization=platform, role=Role.PLATFORM_ADMIN)
        return credentials.get("admin_password")

    def _ensure_demo_key(self, credentials: dict[str, str]) -> str:
        demo = organization_get_or_create(name=DEMO_ORG)
        saved = credentials.get("demo_key")
        existing = ApiKey.objects.filter(key_hash=api_key_hash(saved), is_active=True).first() if saved else None
        if existing is not None:
            if existing.tier != Tier.PAID:  # keys made before tiers existed default to free
                api_key_update(api_key=existing, tier=Tier.PAID)
            return str(saved)
        issued = api_key_create(
            organization=demo, name=DEMO_KEY_NAME, rate_limit_rpm=600, rate_limit_tpm=1_000_000, tier=Tier.PAID
        )
        credentials["demo_key"] = issued.secret
        return issued.secret
