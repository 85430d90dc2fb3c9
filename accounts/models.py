"""Organisations, their members and roles, invitations, API keys and plans: who may call
the platform, within which limits. The tables keep their names from when this lived in
``billing`` (``db_table``): the move changed no data."""

from __future__ import annotations

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


# The limits' fields, spelled once: counts; every cap (the counts and the spend cap: what a
# key may have, each capped by its plan); everything a caller may set (and the alert).
COUNT_LIMIT_FIELDS = ("rate_limit_rpm", "rate_limit_tpm", "rate_limit_ipm", "max_concurrent", "monthly_token_quota")
CAP_FIELDS = (*COUNT_LIMIT_FIELDS, "monthly_spend_cap")
LIMIT_FIELDS = (*CAP_FIELDS, "budget_alert_percent")


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
    # Small models are limited by the item, where tokens mean nothing.
    rate_limit_ipm = models.PositiveBigIntegerField(
        null=True, blank=True, validators=COUNT_LIMIT_VALIDATORS, help_text="inferences (predicted items) per minute"
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
        help_text="spend per UTC month, in the billing currency (each request at its model's price)",
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
    billing_email = models.EmailField(blank=True, help_text="where invoices and budget alerts are sent")
    tax_rate = models.DecimalField(
        max_digits=5, decimal_places=4, default=Decimal(0),
        validators=[MinValueValidator(Decimal(0)), MaxValueValidator(Decimal(1))],
        help_text="applied to invoice subtotals, e.g. 0.2000 for 20 %",
    )  # fmt: skip
    webhook_secret = models.CharField(
        max_length=80, blank=True, default="",
        help_text="signs the webhooks sent to its addresses (`whsec_…`; made on first use, rotatable)",
    )  # fmt: skip
    cache_wrong_hit_budget = models.DecimalField(
        max_digits=5, decimal_places=2, null=True, blank=True,
        validators=[MinValueValidator(Decimal(0)), MaxValueValidator(Decimal(100))],
        help_text="the share of wrong semantic-cache hits this organisation accepts, in % (empty: each model's); "
                  "the stricter of this and the model's applies",
    )  # fmt: skip
    batch_weight = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text="its share of batch capacity when several organisations' batches wait: an organisation of "
                  "weight 2 gets twice the lines in flight of one of weight 1 (platform admins set it)",
    )  # fmt: skip
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "billing_organization"
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
        db_table = "billing_membership"
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
    last_four = models.CharField(max_length=4, blank=True, default="", help_text="last characters, for display")
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
        db_table = "billing_apikey"
        ordering = ["-created_at"]
        constraints = [
            # The column is char(64) in spirit: exactly 64 lowercase hex digits.
            models.CheckConstraint(condition=models.Q(key_hash__regex=r"^[0-9a-f]{64}$"), name="key_hash_is_sha256"),
        ]

    def __str__(self) -> str:
        return f"{self.masked} ({self.name})"

    @property
    def masked(self) -> str:
        """How people see the key: ``sk-…abcd`` (its kind and last four characters; keys made
        before those were kept show their first characters, ``sk-AbCdEfG…``)."""
        if self.last_four:
            kind = self.prefix.split("-", 1)[0] + "-" if "-" in self.prefix else ""
            return f"{kind}…{self.last_four}"
        return f"{self.prefix}…"


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
        db_table = "billing_invitation"
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


# A plan's included credit is money: invoice amounts are in cents (billing.invoicing).
MONEY_MAX_DIGITS, MONEY_DECIMAL_PLACES = 16, 2


class Plan(models.Model):
    """What a tier includes and allows, set by platform admins.

    Key ceilings bound what an org admin may give a key where the organisation has no
    limit of its own (empty: no ceiling); ``included_credit`` is taken off every monthly
    invoice of an organisation on this plan.
    """

    tier = models.CharField(max_length=8, choices=Tier.choices, unique=True)
    name = models.CharField(max_length=100)
    included_credit = models.DecimalField(
        max_digits=MONEY_MAX_DIGITS,
        decimal_places=MONEY_DECIMAL_PLACES,
        default=Decimal(0),
        validators=[MinValueValidator(Decimal(0))],
        help_text="usage included each month, in the billing currency",
    )
    rate_limit_rpm = models.PositiveBigIntegerField(null=True, blank=True, validators=COUNT_LIMIT_VALIDATORS)
    rate_limit_tpm = models.PositiveBigIntegerField(null=True, blank=True, validators=COUNT_LIMIT_VALIDATORS)
    rate_limit_ipm = models.PositiveBigIntegerField(null=True, blank=True, validators=COUNT_LIMIT_VALIDATORS)
    max_concurrent = models.PositiveBigIntegerField(null=True, blank=True, validators=COUNT_LIMIT_VALIDATORS)
    monthly_token_quota = models.PositiveBigIntegerField(null=True, blank=True, validators=COUNT_LIMIT_VALIDATORS)
    monthly_spend_cap = models.DecimalField(
        max_digits=SPEND_CAP_MAX_DIGITS,
        decimal_places=SPEND_CAP_DECIMAL_PLACES,
        null=True,
        blank=True,
        validators=[MinValueValidator(SPEND_CAP_MIN)],
    )

    class Meta:
        db_table = "billing_plan"
        ordering = ["tier"]

    def __str__(self) -> str:
        return f"{self.name} ({self.tier})"
