"""Organisations, members and their roles, API keys, and usage records."""

from __future__ import annotations

import uuid
from decimal import Decimal

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

# The largest value of any count limit (requests or tokens per minute, requests at once,
# tokens per month). The limiter computes in Redis Lua, whose numbers are doubles, exact
# for integers up to 2**53 (~9.007e15); 10**15 stays exact there with room for a month's
# used + reserved on top. A 64-bit column holds it.
LIMIT_MAX = 10**15
# monthly_spend_cap is DecimalField(14, 6): at most 99_999_999.999999, which the limiter
# holds in micro-units (< 10**14), again exact in a double.
SPEND_CAP_MAX_DIGITS = 14
SPEND_CAP_DECIMAL_PLACES = 6
SPEND_CAP_MIN = Decimal("0.000001")


# Every count limit is at least 1 (empty means no limit) and at most LIMIT_MAX.
COUNT_LIMIT_VALIDATORS = [MinValueValidator(1), MaxValueValidator(LIMIT_MAX)]


class Tier(models.TextChoices):
    """A plan's tier: under load, free-tier requests are refused before paid ones."""

    FREE = "free", "Free"
    PAID = "paid", "Paid"


class Limits(models.Model):
    """Rate limits and monthly budgets, shared by organisations and keys.

    Empty (null) means "no limit at this level". Every request is checked against the
    key's limits and its organisation's, in one atomic step (serving/limits.py).
    """

    rate_limit_rpm = models.PositiveBigIntegerField(
        null=True, blank=True, validators=COUNT_LIMIT_VALIDATORS, help_text="requests per minute"
    )
    rate_limit_tpm = models.PositiveBigIntegerField(
        null=True, blank=True, validators=COUNT_LIMIT_VALIDATORS, help_text="tokens per minute"
    )
    max_concurrent = models.PositiveBigIntegerField(
        null=True, blank=True, validators=COUNT_LIMIT_VALIDATORS, help_text="requests at once"
    )
    monthly_token_quota = models.PositiveBigIntegerField(
        null=True, blank=True, validators=COUNT_LIMIT_VALIDATORS, help_text="tokens per UTC month"
    )
    monthly_spend_cap = models.DecimalField(
        max_digits=SPEND_CAP_MAX_DIGITS,
        decimal_places=SPEND_CAP_DECIMAL_PLACES,
        null=True,
        blank=True,
        validators=[MinValueValidator(SPEND_CAP_MIN)],
        help_text="spend per UTC month (counted in tokens until model prices exist)",
    )
    budget_alert_percent = models.PositiveSmallIntegerField(
        default=80,
        validators=[MinValueValidator(1), MaxValueValidator(100)],
        help_text="a soft alert when a budget is this full (percent)",
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
    """A customer's API key. Only the SHA-256 of the secret is stored; the secret is shown once.

    Keys are never deleted, only revoked: usage records, budget alerts and in-flight usage
    events refer to them, and a deleted key would turn its requests into dead letters.
    """

    key_hash = models.CharField(max_length=64, unique=True, help_text="hex SHA-256 of the full key")
    prefix = models.CharField(max_length=16, help_text="first characters, for display")
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="api_keys")
    name = models.CharField(max_length=255)
    # A key always has per-minute limits (its organisation's may be empty).
    rate_limit_rpm = models.PositiveBigIntegerField(
        default=60, validators=COUNT_LIMIT_VALIDATORS, help_text="requests per minute"
    )
    rate_limit_tpm = models.PositiveBigIntegerField(
        default=100_000, validators=COUNT_LIMIT_VALIDATORS, help_text="tokens per minute"
    )
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
    # Wide enough for any value a quota (a 64-bit integer: 19 digits) or a spend cap can
    # take, and for "used", which may pass the limit by a request's reservation.
    limit = models.DecimalField(max_digits=32, decimal_places=6)
    used = models.DecimalField(max_digits=32, decimal_places=6, help_text="used + reserved when crossed")
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


# The roles an invitation may carry: platform admin is granted by platform admins only.
INVITABLE_ROLES = [(Role.ORG_ADMIN.value, Role.ORG_ADMIN.label), (Role.ORG_MEMBER.value, Role.ORG_MEMBER.label)]


class Invitation(models.Model):
    """An org admin's invitation of a username into an organisation; the named user accepts it.

    Org admins invite rather than add, and are answered the same whether or not the
    username exists, so the API never tells a tenant which usernames are taken.
    """

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="invitations")
    username = models.CharField(max_length=150)
    role = models.CharField(max_length=20, choices=INVITABLE_ROLES, default=Role.ORG_MEMBER)
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    accepted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            # One pending invitation per user and organisation; inviting again updates it.
            models.UniqueConstraint(
                fields=["organization", "username"],
                condition=models.Q(accepted_at__isnull=True),
                name="uniq_pending_invitation",
            ),
            # The platform-admin role is granted by platform admins only, never by invitation.
            models.CheckConstraint(
                condition=models.Q(role__in=[Role.ORG_ADMIN, Role.ORG_MEMBER]), name="invitation_role_is_org_role"
            ),
        ]

    def __str__(self) -> str:
        state = "accepted" if self.accepted_at else "pending"
        return f"{self.username} to {self.organization} as {self.role} ({state})"
