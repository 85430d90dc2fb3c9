"""Organisations, members and their roles, API keys, and usage records."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models


class Organization(models.Model):
    name = models.CharField(max_length=255, unique=True)
    slug = models.SlugField(max_length=255, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Role(models.TextChoices):
    PLATFORM_ADMIN = "platform_admin", "Platform admin"
    ORG_ADMIN = "org_admin", "Org admin"
    ORG_MEMBER = "org_member", "Org member"


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.ORG_MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "organization"], name="uniq_membership")]

    def __str__(self) -> str:
        return f"{self.user} in {self.organization} ({self.role})"


class ApiKey(models.Model):
    """A customer's API key. Only the SHA-256 of the secret is stored; the secret is shown once."""

    key_hash = models.CharField(max_length=64, unique=True, help_text="hex SHA-256 of the full key")
    prefix = models.CharField(max_length=16, help_text="first characters, for display")
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="api_keys")
    name = models.CharField(max_length=255)
    rate_limit_rpm = models.PositiveIntegerField(default=60)
    rate_limit_tpm = models.PositiveIntegerField(default=100_000)
    allowed_models = ArrayField(
        models.CharField(max_length=255), default=list, blank=True, help_text="empty means every model"
    )
    is_active = models.BooleanField(default=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # The column is char(64) in spirit: exactly 64 lowercase hex digits.
            models.CheckConstraint(condition=models.Q(key_hash__regex=r"^[0-9a-f]{64}$"), name="key_hash_is_sha256"),
        ]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"


class UsageRecord(models.Model):
    """What one admitted request consumed. ``request_id`` is unique: one record per request."""

    request_id = models.UUIDField(unique=True, default=uuid.uuid4)
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="usage_records")
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="usage_records")
    model = models.CharField(max_length=255)
    model_version = models.CharField(max_length=50)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    total_tokens = models.PositiveIntegerField(default=0)
    latency_ms = models.PositiveIntegerField(default=0)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    status_code = models.PositiveSmallIntegerField()
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["api_key", "created_at"], name="usage_key_time"),
            models.Index(fields=["model", "created_at"], name="usage_model_time"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.total_tokens} tokens"
