"""Writes for accounts: organisations, memberships, invitations, API keys and their limits.

Who may do what is decided here, from the user acting (``actor``), so that every caller
(the management API, the console, commands) gets the same rules. ``actor=None`` is the
operator (a management command, ``bootstrap``), who acts as a platform admin.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any, TypeAlias

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.validators import validate_email
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.text import slugify

from accounts.models import (
    COUNT_LIMIT_FIELDS,
    LIMIT_FIELDS,
    LIMIT_MAX,
    SPEND_CAP_DECIMAL_PLACES,
    SPEND_CAP_MAX_DIGITS,
    SPEND_CAP_MIN,
    ApiKey,
    Invitation,
    Membership,
    Organization,
    Role,
    Tier,
)
from accounts.permissions import is_platform_admin
from accounts.selectors import TIER_RANK, plan_key_ceilings, role_in
from core import keys
from core.errors import InvalidInput
from core.redis import sync_redis
from core.validators import clean_percent

KEY_PREFIX = "sk-"
# 32 random bytes: 256 bits of entropy, url-safe, 43 characters after the prefix.
_SECRET_BYTES = 32
DISPLAY_PREFIX_LENGTH = 10
# What a key gets for a limit its creator leaves out (clamped to the plan for org admins).
KEY_DEFAULTS: Mapping[str, int | Decimal | None] = {
    "rate_limit_rpm": 60,
    "rate_limit_tpm": 100_000,
    "rate_limit_ipm": None,
    "max_concurrent": None,
    "monthly_token_quota": None,
    "monthly_spend_cap": None,
}
NAME_MAX_LENGTH = 255
USERNAME_MAX_LENGTH = 150
MODEL_NAME_MAX_LENGTH = 255
_SPEND_CAP_LIMIT = Decimal(10) ** (SPEND_CAP_MAX_DIGITS - SPEND_CAP_DECIMAL_PLACES)
_SPEND_CAP_QUANTUM = Decimal(1).scaleb(-SPEND_CAP_DECIMAL_PLACES)

# The user acting: a logged-in user through the API, or None for the operator.
Actor: TypeAlias = AbstractBaseUser | AnonymousUser | None


class _Omitted(enum.Enum):
    """Marks a limit its caller left out, which is not the same as an explicit None (no limit)."""

    OMITTED = enum.auto()


OMITTED = _Omitted.OMITTED


def api_key_hash(secret: str) -> str:
    """Hex SHA-256 of a full key: the only form in which keys are stored or looked up."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _publish_key_change(key_hash: str) -> None:
    """Tell every gateway to drop its cached copy of this key, after the change commits.

    Gateways never trust a cached key for more than a second anyway; this makes it at once.
    """

    def publish() -> None:
        # Best effort: the 1 s cache bound still holds without the message.
        with contextlib.suppress(Exception):
            sync_redis().publish(keys.key_invalidation_channel(), key_hash)

    transaction.on_commit(publish)


@dataclass(frozen=True)
class IssuedApiKey:
    """A freshly created key. ``secret`` exists only here; it is never stored."""

    api_key: ApiKey
    secret: str


# --- Validation -----------------------------------------------------------------------


def _validate_count(field: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(field, "must be a whole number")
    if value <= 0:
        raise InvalidInput(field, "must be positive (or empty for no limit)")
    if value > LIMIT_MAX:
        # The limiter computes in Redis Lua doubles; beyond this it would not count exactly.
        raise InvalidInput(field, f"must be at most {LIMIT_MAX}")


def _validate_spend_cap(value: Any) -> None:
    if value is None:
        return
    field = "monthly_spend_cap"
    try:
        cap = value if isinstance(value, Decimal) else Decimal(str(value))
    except (InvalidOperation, ValueError, TypeError):
        raise InvalidInput(field, "must be a decimal number") from None
    if not cap.is_finite():
        raise InvalidInput(field, "must be a decimal number")
    if cap <= 0:
        raise InvalidInput(field, "must be positive (or empty for no limit)")
    if cap >= _SPEND_CAP_LIMIT:
        raise InvalidInput(field, f"must be less than {_SPEND_CAP_LIMIT}")
    if cap < SPEND_CAP_MIN or cap != cap.quantize(_SPEND_CAP_QUANTUM):
        raise InvalidInput(field, f"must have at most {SPEND_CAP_DECIMAL_PLACES} decimal places")


def _validate_limits(values: Mapping[str, Any]) -> None:
    """Every limit within what the database and the limiter hold exactly."""
    for field in COUNT_LIMIT_FIELDS:
        _validate_count(field, values.get(field))
    _validate_spend_cap(values.get("monthly_spend_cap"))
    if "budget_alert_percent" in values:
        alert = values["budget_alert_percent"]
        if isinstance(alert, bool) or not isinstance(alert, int) or not 1 <= alert <= 100:
            raise InvalidInput("budget_alert_percent", "must be a whole number between 1 and 100")


def _clean_text(field: str, value: Any, *, max_length: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(field, "cannot be empty")
    text = value.strip()
    if len(text) > max_length:
        raise InvalidInput(field, f"must be at most {max_length} characters")
    return text


EMAIL_MAX_LENGTH = 254
_TAX_RATE_QUANTUM = Decimal("0.0001")


def _clean_billing_email(value: Any) -> str:
    """An address for invoices and budget alerts, or "" for none."""
    if not isinstance(value, str):
        raise InvalidInput("billing_email", "must be an email address")
    text = value.strip()
    if not text:
        return ""
    if len(text) > EMAIL_MAX_LENGTH:
        raise InvalidInput("billing_email", f"must be at most {EMAIL_MAX_LENGTH} characters")
    try:
        validate_email(text)
    except ValidationError:
        raise InvalidInput("billing_email", "must be an email address") from None
    return text


def _clean_tax_rate(value: Any) -> Decimal:
    """A fraction of the subtotal (0.2 is 20 %), as the invoice applies it."""
    try:
        rate = value if isinstance(value, Decimal) else Decimal(str(value))
    except (InvalidOperation, ValueError, TypeError):
        raise InvalidInput("tax_rate", "must be a decimal number") from None
    if not rate.is_finite() or not Decimal(0) <= rate <= Decimal(1):
        raise InvalidInput("tax_rate", "must be between 0 and 1 (0.2 is 20 %)")
    if rate != rate.quantize(_TAX_RATE_QUANTUM):
        raise InvalidInput("tax_rate", "must have at most 4 decimal places")
    return rate


def _validate_tier(tier: Any) -> None:
    if tier not in Tier.values:
        raise InvalidInput("tier", f"must be one of {', '.join(Tier.values)}")


def _validate_expiry(expires_at: datetime | None) -> None:
    if expires_at is None:
        return
    if expires_at.tzinfo is None:
        raise InvalidInput("expires_at", "must be timezone-aware")
    if expires_at <= timezone.now():
        raise InvalidInput("expires_at", "must be in the future")


def _validate_models(allowed_models: Sequence[str]) -> list[str]:
    if isinstance(allowed_models, str):
        raise InvalidInput("allowed_models", "must be a list of model names")
    return [_clean_text("allowed_models", name, max_length=MODEL_NAME_MAX_LENGTH) for name in allowed_models]


# --- Who may do what ------------------------------------------------------------------


def _acts_as_platform_admin(actor: Actor) -> bool:
    return actor is None or is_platform_admin(actor)


def _acting_role(actor: Actor, organization: Organization) -> str:
    """The role ``actor`` writes to ``organization`` in; PermissionDenied unless an admin one."""
    if actor is None:
        return Role.PLATFORM_ADMIN
    role = role_in(actor, organization)
    if role not in (Role.PLATFORM_ADMIN, Role.ORG_ADMIN):
        raise PermissionDenied("Only organisation admins may do this.")
    return role


def _clamp(default: int | Decimal | None, ceiling: int | Decimal | None) -> int | Decimal | None:
    if ceiling is None:
        return default
    if default is None:
        return ceiling
    return min(default, ceiling)


def _check_within_plan(*, organization: Organization, values: Mapping[str, Any], current: ApiKey | None = None) -> None:
    """A key's tier and limits, as set by an org admin, may only narrow the organisation's plan.

    The plan is set by platform admins (selectors.plan_key_ceilings); without this an org
    admin could give a free organisation paid-tier keys or lift its rate limits and quotas.
    A value a key already has (set by a platform admin) may be sent back unchanged.
    """
    ceilings = plan_key_ceilings(organization=organization)
    for field, value in values.items():
        if current is not None and getattr(current, field) == value:
            continue
        if field == "tier":
            if TIER_RANK[Tier(value)] > TIER_RANK[Tier(organization.tier)]:
                raise InvalidInput("tier", f"cannot be above the organisation's tier ({organization.tier})")
            continue
        if field not in ceilings:
            continue
        ceiling = ceilings[field]
        if ceiling is None:
            continue
        if value is None:
            raise InvalidInput(field, f"cannot be empty (no limit) under this organisation's plan; at most {ceiling}")
        if value > ceiling:
            raise InvalidInput(field, f"must be at most {ceiling} under this organisation's plan")


# --- Organisations --------------------------------------------------------------------


def _check_organization_name_free(*, name: str, exclude: Organization | None = None) -> str:
    """The slug for ``name``; InvalidInput when another organisation has that name or slug."""
    slug = slugify(name)
    if not slug:
        raise InvalidInput("name", "must contain letters or digits")
    if len(slug) > NAME_MAX_LENGTH:
        raise InvalidInput("name", f"must be at most {NAME_MAX_LENGTH} characters")
    others = Organization.objects.all() if exclude is None else Organization.objects.exclude(pk=exclude.pk)
    if others.filter(Q(name__iexact=name) | Q(slug=slug)).exists():
        raise InvalidInput("name", "another organisation already has this name")
    return slug


def organization_create(
    *,
    name: str,
    slug: str | None = None,
    tier: str = Tier.PAID,
    billing_email: str = "",
    tax_rate: Decimal | str = Decimal(0),
    cache_wrong_hit_budget: Decimal | str | None = None,
    batch_weight: int = 1,
    actor: Actor = None,
    **limits: Any,
) -> Organization:
    """A new organisation (platform admins only): its tier and limits are its plan; invoices
    and budget alerts go to ``billing_email`` and carry ``tax_rate`` (a fraction)."""
    if not _acts_as_platform_admin(actor):
        raise PermissionDenied("Only platform admins create organisations.")
    unknown = set(limits) - set(LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"unknown limits {', '.join(sorted(unknown))}")
    name = _clean_text("name", name, max_length=NAME_MAX_LENGTH)
    derived = _check_organization_name_free(name=name)
    if slug is not None:
        slug = _clean_text("slug", slug, max_length=NAME_MAX_LENGTH)
        if slugify(slug) != slug:
            raise InvalidInput("slug", "must be lowercase letters, digits and hyphens")
        if Organization.objects.filter(slug=slug).exists():
            raise InvalidInput("slug", "another organisation already has this slug")
    _validate_tier(tier)
    _validate_limits(limits)
    billing = {"billing_email": _clean_billing_email(billing_email), "tax_rate": _clean_tax_rate(tax_rate),
               "cache_wrong_hit_budget": clean_percent("cache_wrong_hit_budget", cache_wrong_hit_budget),
               "batch_weight": _clean_batch_weight(batch_weight)}  # fmt: skip
    try:
        with transaction.atomic():
            return Organization.objects.create(name=name, slug=slug or derived, tier=tier, **billing, **limits)
    except IntegrityError:  # a concurrent create took the name
        raise InvalidInput("name", "another organisation already has this name") from None


BATCH_WEIGHT_MAX = 1000


def _clean_batch_weight(value: Any) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not 1 <= int(text) <= BATCH_WEIGHT_MAX:
        raise InvalidInput("batch_weight", f"must be a whole number from 1 to {BATCH_WEIGHT_MAX}")
    return int(text)


def organization_get_or_create(*, name: str) -> Organization:
    org, _ = Organization.objects.get_or_create(name=name, defaults={"slug": slugify(name)})
    return org


def platform_organization() -> Organization:
    """The platform's own organisation (``PLATFORM_ORGANIZATION``): the ML team's memberships
    and what its staff use themselves (their playground) are held and metered there, never
    on a customer's account."""
    return organization_get_or_create(name=settings.PLATFORM_ORGANIZATION)


def organization_update(*, organization: Organization, actor: Actor = None, **changes: Any) -> Organization:
    """Change an organisation's name or its semantic-cache wrong-hit budget (its admins), tier,
    limits, billing email, tax rate or batch weight (platform admins only).

    Gateways see new limits within a second. The slug stays: it is the organisation's
    stable identifier.
    """
    allowed = {"name", "tier", "billing_email", "tax_rate", "cache_wrong_hit_budget", "batch_weight", *LIMIT_FIELDS}
    unknown = set(changes) - allowed
    if unknown:
        raise ValueError(f"cannot change {', '.join(sorted(unknown))}")
    role = _acting_role(actor, organization)
    if set(changes) - {"name", "cache_wrong_hit_budget"} and role != Role.PLATFORM_ADMIN:
        raise PermissionDenied("Only platform admins change tiers, limits and budgets.")
    if "cache_wrong_hit_budget" in changes:
        changes["cache_wrong_hit_budget"] = clean_percent("cache_wrong_hit_budget", changes["cache_wrong_hit_budget"])
    if "name" in changes:
        changes["name"] = _clean_text("name", changes["name"], max_length=NAME_MAX_LENGTH)
        _check_organization_name_free(name=changes["name"], exclude=organization)
    if "tier" in changes:
        _validate_tier(changes["tier"])
    if "billing_email" in changes:
        changes["billing_email"] = _clean_billing_email(changes["billing_email"])
    if "tax_rate" in changes:
        changes["tax_rate"] = _clean_tax_rate(changes["tax_rate"])
    if "batch_weight" in changes:
        changes["batch_weight"] = _clean_batch_weight(changes["batch_weight"])
    _validate_limits(changes)
    try:
        with transaction.atomic():
            for name, value in changes.items():
                setattr(organization, name, value)
            organization.save(update_fields=list(changes))
            for key_hash in organization.api_keys.values_list("key_hash", flat=True):
                _publish_key_change(key_hash)
    except IntegrityError:  # a concurrent rename took the name
        organization.refresh_from_db()
        raise InvalidInput("name", "another organisation already has this name") from None
    return organization


WEBHOOK_SECRET_PREFIX = "whsec_"


def organization_webhook_secret(*, organization_id: int, rotate: bool = False) -> str:
    """The secret that signs the organisation's webhooks (serving.batches.webhooks), made on first use;
    ``rotate`` replaces it at once (receivers then accept the old and new one for a while).

    The first use sets it with an UPDATE guarded on the empty value and reads it back, so two
    concurrent first uses (a batch's callback and the portal) agree on one secret rather
    than each signing with its own. Organization.DoesNotExist for an unknown id.
    """
    fresh = WEBHOOK_SECRET_PREFIX + secrets.token_urlsafe(_SECRET_BYTES)
    organizations = Organization.objects.filter(pk=organization_id)
    if rotate:
        if not organizations.update(webhook_secret=fresh):
            raise Organization.DoesNotExist(f"no organisation {organization_id}")
        return fresh
    current = organizations.values_list("webhook_secret", flat=True).get()
    if current:
        return current
    organizations.filter(webhook_secret="").update(webhook_secret=fresh)
    return organizations.values_list("webhook_secret", flat=True).get()


# --- Members and invitations ----------------------------------------------------------


def _guard_platform_admin_membership(*, user: Any, membership: Membership | None) -> None:
    """Only platform admins change or remove a platform admin's membership (no demotion)."""
    if membership is not None and membership.role == Role.PLATFORM_ADMIN:
        raise PermissionDenied("Only platform admins change a platform admin's membership.")
    if is_platform_admin(user):
        raise PermissionDenied("Only platform admins change a platform admin's membership.")


class LastOrgAdmin(PermissionDenied):
    """Refused: an org admin's change would leave the organisation without an org admin, and
    its members with no one to manage its keys, members and invoices.

    A PermissionDenied like the other refusals here, so every caller refuses it the same way
    (the management API answers 403 with this message).
    """

    def __init__(self) -> None:
        super().__init__("An organisation keeps at least one org admin: make another member an org admin first.")


def _guard_last_org_admin(*, membership: Membership) -> None:
    """LastOrgAdmin when ``membership`` is its organisation's only org admin.

    Call inside transaction.atomic: it locks the organisation's row, so that two admins
    removing (or demoting) each other at once cannot both succeed, and reads the role as
    stored, not the caller's possibly stale copy.
    """
    Organization.objects.select_for_update().only("pk").get(pk=membership.organization_id)
    admins = Membership.objects.filter(organization_id=membership.organization_id, role=Role.ORG_ADMIN)
    if admins.filter(pk=membership.pk).exists() and not admins.exclude(pk=membership.pk).exists():
        raise LastOrgAdmin()


def membership_set(
    *, user: AbstractBaseUser, organization: Organization, role: Role | str, actor: Actor = None
) -> Membership:
    """Add ``user`` to ``organization`` with ``role``, or change their role.

    Platform admins add anyone directly. Org admins only change the roles of existing
    members (new users are invited: invitation_create), never to or from platform admin,
    and never demote the organisation's last org admin (LastOrgAdmin).
    """
    if role not in Role.values:
        raise InvalidInput("role", f"must be one of {', '.join(Role.values)}")
    acting = _acting_role(actor, organization)
    with transaction.atomic():
        if acting != Role.PLATFORM_ADMIN:
            if role == Role.PLATFORM_ADMIN:
                raise PermissionDenied("Only platform admins grant the platform-admin role.")
            existing = Membership.objects.filter(user_id=user.pk, organization=organization).first()
            if existing is None:
                raise PermissionDenied("Org admins invite users; only platform admins add them directly.")
            _guard_platform_admin_membership(user=user, membership=existing)
            if role != Role.ORG_ADMIN:
                _guard_last_org_admin(membership=existing)
        membership, _ = Membership.objects.update_or_create(
            user=user, organization=organization, defaults={"role": role}
        )
    return membership


def membership_remove(*, membership: Membership, actor: Actor = None) -> None:
    """Remove a member; a platform admin's membership only by a platform admin.

    Org admins never remove the organisation's last org admin (LastOrgAdmin), themselves
    included. Platform admins, who add anyone directly, may (winding an organisation down).
    """
    acting = _acting_role(actor, membership.organization)
    with transaction.atomic():
        if acting != Role.PLATFORM_ADMIN:
            _guard_platform_admin_membership(user=membership.user, membership=membership)
            _guard_last_org_admin(membership=membership)
        membership.delete()


def invitation_create(
    *, organization: Organization, username: str, role: Role | str = Role.ORG_MEMBER, actor: Actor = None
) -> Invitation:
    """Invite ``username`` into ``organization``; the user accepts it (invitation_accept).

    The result is the same whether or not the username exists, so that an org admin cannot
    learn which usernames exist. Inviting again updates the pending invitation. A current
    member who is a platform admin cannot be invited into another role (members are
    visible to org admins already, so refusing tells them nothing new).
    """
    acting = _acting_role(actor, organization)
    username = _clean_text("username", username, max_length=USERNAME_MAX_LENGTH)
    if role == Role.PLATFORM_ADMIN:
        raise PermissionDenied("Only platform admins grant the platform-admin role.")
    if role not in (Role.ORG_ADMIN, Role.ORG_MEMBER):
        raise InvalidInput("role", f"must be one of {Role.ORG_ADMIN}, {Role.ORG_MEMBER}")
    if acting != Role.PLATFORM_ADMIN:
        member = (
            Membership.objects.filter(organization=organization, user__username=username).select_related("user").first()
        )
        if member is not None:
            _guard_platform_admin_membership(user=member.user, membership=member)
    invited_by_id = actor.pk if isinstance(actor, AbstractBaseUser) else None
    invitation, _ = Invitation.objects.update_or_create(
        organization=organization,
        username=username,
        accepted_at=None,
        defaults={"role": role, "invited_by_id": invited_by_id},
    )
    return invitation


def invitation_accept(*, invitation: Invitation, user: AbstractBaseUser) -> Membership:
    """The invited user joins the organisation with the invited role.

    Accepting never lowers a platform admin's own platform-admin membership.
    """
    with transaction.atomic():
        locked = Invitation.objects.select_for_update().select_related("organization").get(pk=invitation.pk)
        if locked.accepted_at is not None or locked.username != user.get_username():
            raise InvalidInput("invitation", "this invitation is not open to you")
        existing = Membership.objects.filter(user_id=user.pk, organization=locked.organization).first()
        if existing is not None and existing.role == Role.PLATFORM_ADMIN:
            membership = existing
        else:
            membership, _ = Membership.objects.update_or_create(
                user_id=user.pk, organization=locked.organization, defaults={"role": locked.role}
            )
        locked.accepted_at = timezone.now()
        locked.save(update_fields=["accepted_at"])
    invitation.accepted_at = locked.accepted_at
    return membership


def invitation_cancel(*, invitation: Invitation, actor: Actor = None) -> None:
    """An org admin withdraws a pending invitation: it can no longer be accepted.

    InvalidInput when it was accepted or withdrawn meanwhile (accepted ones stay, as history).
    """
    _acting_role(actor, invitation.organization)
    deleted, _ = Invitation.objects.filter(pk=invitation.pk, accepted_at__isnull=True).delete()
    if not deleted:
        raise InvalidInput("invitation", "this invitation was accepted or cancelled already")


def invitation_decline(*, invitation: Invitation, user: AbstractBaseUser) -> None:
    """The invited user turns a pending invitation down; it goes, as if cancelled.

    InvalidInput unless it is pending and addressed to ``user``.
    """
    deleted, _ = Invitation.objects.filter(
        pk=invitation.pk, accepted_at__isnull=True, username=user.get_username()
    ).delete()
    if not deleted:
        raise InvalidInput("invitation", "this invitation is not open to you")


# --- API keys -------------------------------------------------------------------------


def api_key_create(
    *,
    organization: Organization,
    name: str,
    rate_limit_rpm: int | _Omitted = OMITTED,
    rate_limit_tpm: int | _Omitted = OMITTED,
    rate_limit_ipm: int | _Omitted | None = OMITTED,
    allowed_models: Sequence[str] = (),
    expires_at: datetime | None = None,
    tier: str | None = None,
    max_concurrent: int | _Omitted | None = OMITTED,
    monthly_token_quota: int | _Omitted | None = OMITTED,
    monthly_spend_cap: Decimal | _Omitted | None = OMITTED,
    budget_alert_percent: int = 80,
    actor: Actor = None,
) -> IssuedApiKey:
    """A new key of ``organization``; the secret is in the result only.

    Limits left out get KEY_DEFAULTS. An org admin's key stays within the organisation's
    plan: defaults are clamped to its ceilings, and a tier or limit above them is refused.
    """
    acting = _acting_role(actor, organization)
    ceilings = None if acting == Role.PLATFORM_ADMIN else plan_key_ceilings(organization=organization)
    given: dict[str, Any] = {
        "rate_limit_rpm": rate_limit_rpm,
        "rate_limit_tpm": rate_limit_tpm,
        "rate_limit_ipm": rate_limit_ipm,
        "max_concurrent": max_concurrent,
        "monthly_token_quota": monthly_token_quota,
        "monthly_spend_cap": monthly_spend_cap,
    }
    limits: dict[str, Any] = {}
    for field, value in given.items():
        if isinstance(value, _Omitted):
            value = KEY_DEFAULTS[field] if ceilings is None else _clamp(KEY_DEFAULTS[field], ceilings[field])
        limits[field] = value
    name = _clean_text("name", name, max_length=NAME_MAX_LENGTH)
    models = _validate_models(allowed_models)
    _validate_expiry(expires_at)
    tier = tier or organization.tier
    _validate_tier(tier)
    _validate_limits({**limits, "budget_alert_percent": budget_alert_percent})
    for field in ("rate_limit_rpm", "rate_limit_tpm"):
        if limits[field] is None:
            raise InvalidInput(field, "a key always has requests and tokens per minute limits")
    if acting != Role.PLATFORM_ADMIN:
        _check_within_plan(organization=organization, values={**limits, "tier": tier})
    secret = KEY_PREFIX + secrets.token_urlsafe(_SECRET_BYTES)
    with transaction.atomic():
        api_key = ApiKey.objects.create(
            key_hash=api_key_hash(secret),
            prefix=secret[:DISPLAY_PREFIX_LENGTH],
            last_four=secret[-4:],
            organization=organization,
            name=name,
            allowed_models=models,
            expires_at=expires_at,
            tier=tier,
            budget_alert_percent=budget_alert_percent,
            **limits,
        )
    return IssuedApiKey(api_key=api_key, secret=secret)


def api_key_update(*, api_key: ApiKey, actor: Actor = None, **changes: Any) -> ApiKey:
    """Rename a key, change its models, expiry, tier or limits; applied by gateways within 1 s.

    An org admin's changes stay within the organisation's plan (see _check_within_plan).
    """
    allowed = {"name", "allowed_models", "expires_at", "tier", *LIMIT_FIELDS}
    unknown = set(changes) - allowed
    if unknown:
        raise ValueError(f"cannot change {', '.join(sorted(unknown))}")
    acting = _acting_role(actor, api_key.organization)
    if "name" in changes:
        changes["name"] = _clean_text("name", changes["name"], max_length=NAME_MAX_LENGTH)
    if "allowed_models" in changes:
        changes["allowed_models"] = _validate_models(changes["allowed_models"])
    if "expires_at" in changes:
        _validate_expiry(changes["expires_at"])
    if "tier" in changes:
        _validate_tier(changes["tier"])
    _validate_limits(changes)
    for field in ("rate_limit_rpm", "rate_limit_tpm"):
        if field in changes and changes[field] is None:
            raise InvalidInput(field, "a key always has requests and tokens per minute limits")
    if acting != Role.PLATFORM_ADMIN:
        _check_within_plan(organization=api_key.organization, values=changes, current=api_key)
    with transaction.atomic():
        for name, value in changes.items():
            setattr(api_key, name, value)
        api_key.save(update_fields=list(changes))
        _publish_key_change(api_key.key_hash)
    return api_key


def api_key_revoke(*, api_key: ApiKey, actor: Actor = None) -> ApiKey:
    """Refused by every gateway process within a second (at once where pub/sub reaches it).

    Keys are revoked, never deleted: their usage records and alerts keep pointing at them.
    """
    _acting_role(actor, api_key.organization)
    with transaction.atomic():
        ApiKey.objects.filter(pk=api_key.pk).update(is_active=False, revoked_at=timezone.now())
        api_key.refresh_from_db(fields=["is_active", "revoked_at"])
        _publish_key_change(api_key.key_hash)
    return api_key


def api_key_rotate(*, api_key: ApiKey, grace: timedelta, actor: Actor = None) -> IssuedApiKey:
    """A new key with the same grants; the old one keeps working for ``grace``, then expires."""
    _acting_role(actor, api_key.organization)
    if not api_key.is_active:
        raise ValueError("a revoked key cannot be rotated")
    if grace < timedelta(0):
        raise InvalidInput("grace_seconds", "cannot be negative")
    with transaction.atomic():
        locked = ApiKey.objects.select_for_update().get(pk=api_key.pk)
        if locked.rotated_to_id is not None:
            raise ValueError("this key was already rotated")
        now = timezone.now()
        if locked.expires_at is not None and locked.expires_at <= now:
            raise ValueError("an expired key cannot be rotated; issue a new key")
        # The same grants, narrowed to the organisation's plan as it is now (it may have been
        # downgraded since they were given): created as the operator, within those bounds.
        organization = locked.organization
        ceilings = plan_key_ceilings(organization=organization)
        limits: dict[str, Any] = {field: _clamp(getattr(locked, field), ceilings.get(field)) for field in LIMIT_FIELDS}
        tier = locked.tier
        if TIER_RANK[Tier(tier)] > TIER_RANK[Tier(organization.tier)]:
            tier = organization.tier
        issued = api_key_create(
            organization=organization,
            name=locked.name,
            allowed_models=locked.allowed_models,
            expires_at=locked.expires_at,
            tier=tier,
            **limits,
        )
        ends = now + grace
        locked.expires_at = min(ends, locked.expires_at) if locked.expires_at else ends
        locked.rotated_to = issued.api_key
        locked.save(update_fields=["expires_at", "rotated_to"])
        _publish_key_change(locked.key_hash)
    api_key.refresh_from_db()
    return issued


PLAYGROUND_KEY_PREFIX = "playground"


def playground_key_hash(*, organization_id: int, user_id: int) -> str:
    """The stored hash of a member's playground key: an HMAC of SECRET_KEY, not the SHA-256 of
    any secret, so no bearer key can ever match it; the key is usable only by the console's
    playground, for a signed-in member (serving.gateway.session_auth)."""
    message = f"playground-key:{organization_id}:{user_id}".encode()
    return hmac.new(settings.SECRET_KEY.encode(), message, hashlib.sha256).hexdigest()


def playground_key_get_or_create(*, organization: Organization, user: AbstractBaseUser) -> ApiKey:
    """The key that a member's playground requests are metered to: one per (organisation,
    user), made on first use with the key defaults clamped to the organisation's plan, so
    its limits and budgets apply as to any key. It has no secret to show or leak.

    A revoked or expired one is returned as it is: an org admin who revoked it meant it.
    Platform staff act as admins of every organisation, but what they run in a customer's
    playground is theirs, not the customer's: their key is the platform organisation's.
    """
    if is_platform_admin(user):
        organization = platform_organization()
    key_hash = playground_key_hash(organization_id=organization.pk, user_id=int(user.pk))
    existing = ApiKey.objects.select_related("organization").filter(key_hash=key_hash).first()
    if existing is not None:
        return existing
    ceilings = plan_key_ceilings(organization=organization)
    limits = {field: _clamp(default, ceilings[field]) for field, default in KEY_DEFAULTS.items()}
    name = f"Playground ({user.get_username()})"[:NAME_MAX_LENGTH]
    try:
        with transaction.atomic():
            return ApiKey.objects.create(
                key_hash=key_hash,
                prefix=PLAYGROUND_KEY_PREFIX,
                organization=organization,
                name=name,
                tier=organization.tier,
                **limits,
            )
    except IntegrityError:  # made by a concurrent first use
        return ApiKey.objects.select_related("organization").get(key_hash=key_hash)


def api_keys_touch(*, last_used: dict[int, datetime]) -> None:
    """Record when keys were last used (batched by the gateways, at most once a minute a key)."""
    for key_id, when in last_used.items():
        ApiKey.objects.filter(pk=key_id).exclude(last_used_at__gte=when).update(last_used_at=when)
