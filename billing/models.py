"""Organisations, members and their roles, API keys, and usage records."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models


class Tier(models.TextChoices):
    """A plan's tier: under load, free-tier requests are refused before paid ones."""

    FREE = "free", "Free"
    PAID = "paid", "Paid"


class Limits(models.Model):
    """Rate limits and monthly budgets, shared by organisations and keys.

    Empty (null) means "no limit at this level". Every request is checked against the
    key's limits and its organisation's, in one atomic step (serving/limits.py).
    """

    rate_limit_rpm = models.PositiveIntegerField(null=True, blank=True, help_text="requests per minute")
    rate_limit_tpm = models.PositiveIntegerField(null=True, blank=True, help_text="tokens per minute")
    max_concurrent = models.PositiveIntegerField(null=True, blank=True, help_text="requests at once")
    monthly_token_quota = models.PositiveBigIntegerField(null=True, blank=True, help_text="tokens per UTC month")
    monthly_spend_cap = models.DecimalField(
        max_digits=14,
        decimal_places=6,
        null=True,
        blank=True,
        help_text="spend per UTC month (counted in tokens until model prices exist)",
    )
    budget_alert_percent = models.PositiveSmallIntegerField(
        default=80, help_text="a soft alert when a budget is this full"
    )

    class Meta:
        abstract = True


class Organization(Limits):
    name = models.CharField(max_length=255, unique=True)
    slug = models.SlugField(max_length=255, unique=True)
    tier = models.CharField(max_length=8, choices=Tier.choices, default=Tier.PAID)
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


class ApiKey(Limits):
    """A customer's API key. Only the SHA-256 of the secret is stored; the secret is shown once."""

    key_hash = models.CharField(max_length=64, unique=True, help_text="hex SHA-256 of the full key")
    prefix = models.CharField(max_length=16, help_text="first characters, for display")
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="api_keys")
    name = models.CharField(max_length=255)
    rate_limit_rpm = models.PositiveIntegerField(default=60)
    rate_limit_tpm = models.PositiveIntegerField(default=100_000)
    tier = models.CharField(max_length=8, choices=Tier.choices, default=Tier.FREE)
    allowed_models = ArrayField(
        models.CharField(max_length=255), default=list, blank=True, help_text="empty means every model"
    )
    is_active = models.BooleanField(default=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    rotated_to = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="rotated_from",
        help_text="the key that replaced this one; this one works until expires_at",
    )  # fmt: skip
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


class BudgetAlert(models.Model):
    """A budget crossed its alert threshold (once per scope, budget and UTC month)."""

    class Budget(models.TextChoices):
        TOKENS = "tokens", "Token quota"
        SPEND = "spend", "Spend cap"

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="budget_alerts")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="budget_alerts")
    budget = models.CharField(max_length=8, choices=Budget.choices)
    month = models.CharField(max_length=7, help_text="YYYY-MM, UTC")
    threshold_percent = models.PositiveSmallIntegerField()
    limit = models.DecimalField(max_digits=20, decimal_places=6)
    used = models.DecimalField(max_digits=20, decimal_places=6, help_text="used + reserved when crossed")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "api_key", "budget", "month"],
                name="uniq_budget_alert",
                nulls_distinct=False,
            )
        ]

    def __str__(self) -> str:
        scope = f"key {self.api_key_id}" if self.api_key_id else f"org {self.organization_id}"
        return f"{scope} {self.budget} {self.month} at {self.threshold_percent}%"
