"""Reads for accounts, always scoped to what the asking user may see."""

from __future__ import annotations

from datetime import date, timedelta
from decimal import Decimal
from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from billing.models import (
    ApiKey,
    BudgetAlert,
    Invitation,
    Invoice,
    Membership,
    Organization,
    Plan,
    Price,
    Reconciliation,
    Role,
    Tier,
)


def api_key_by_hash(*, key_hash: str) -> ApiKey | None:
    return ApiKey.objects.select_related("organization").filter(key_hash=key_hash).first()


def is_platform_admin(user: Any) -> bool:
    """The ML team: superusers and anyone holding the platform-admin role."""
    if not getattr(user, "is_authenticated", False):
        return False
    return bool(user.is_superuser) or Membership.objects.filter(user=user, role=Role.PLATFORM_ADMIN).exists()


def organizations_visible_to(user: Any) -> QuerySet[Organization]:
    if is_platform_admin(user):
        return Organization.objects.all()
    return Organization.objects.filter(memberships__user=user).distinct()


def role_in(user: Any, organization: Organization) -> str | None:
    """The user's role in ``organization`` (platform admins act as its admin), or None."""
    if is_platform_admin(user):
        return Role.PLATFORM_ADMIN
    membership = Membership.objects.filter(user=user, organization=organization).first()
    return membership.role if membership else None


# Limits a key may have, each capped by its organisation's plan (money is Decimal).
KEY_CEILING_FIELDS = ("rate_limit_rpm", "rate_limit_tpm", "max_concurrent", "monthly_token_quota", "monthly_spend_cap")
# Tiers in order: a key's tier is at most its organisation's.
TIER_RANK = {Tier.FREE: 0, Tier.PAID: 1}


def plan_key_ceilings(*, organization: Organization) -> dict[str, int | Decimal | None]:
    """The most a key of ``organization`` may have of each limit, unless a platform admin sets it.

    The plan is the organisation's own limit where a platform admin set one, else the
    ceiling of its tier's ``Plan``; None means no ceiling.
    """
    plan = Plan.objects.filter(tier=organization.tier).first()
    ceilings: dict[str, int | Decimal | None] = {}
    for field in KEY_CEILING_FIELDS:
        own = getattr(organization, field)
        ceilings[field] = own if own is not None else (getattr(plan, field) if plan is not None else None)
    return ceilings


# A price that ended this recently is still loaded: a request admitted just before a switch
# is priced at its admission time, and the routing table it reads may have been reloaded
# after the switch (a request never comes out unpriced because its price just ended).
RECENTLY_ENDED = timedelta(hours=1)


def prices_in_effect_or_later(*, model_ids: list[int]) -> QuerySet[Price]:
    """Prices of these models that apply now or will, and those that ended within the last
    hour (the routing table keeps them all and picks by each request's admission time)."""
    since = timezone.now() - RECENTLY_ENDED
    return Price.objects.filter(model_id__in=model_ids).exclude(effective_to__lte=since).order_by("-effective_from")


def invitations_pending_for(user: Any) -> QuerySet[Invitation]:
    """The invitations waiting for ``user`` to accept them (matched by username)."""
    return (
        Invitation.objects.filter(username=user.get_username(), accepted_at__isnull=True)
        .select_related("organization", "invited_by")
        .order_by("-created_at")
    )


def invitations_pending_of(*, organization_id: int) -> QuerySet[Invitation]:
    """An organisation's invitations not yet accepted, newest first (for its admins: they
    list the usernames invited, which say nothing of which usernames exist)."""
    return (
        Invitation.objects.filter(organization_id=organization_id, accepted_at__isnull=True)
        .select_related("invited_by")
        .order_by("-created_at", "-pk")
    )


def api_keys_of(*, organization_id: int) -> QuerySet[ApiKey]:
    """An organisation's keys, newest first (revoked and rotated ones included)."""
    return ApiKey.objects.filter(organization_id=organization_id).select_related("rotated_to").order_by("-created_at")


def budget_alerts_of(*, organization_id: int, month: str) -> QuerySet[BudgetAlert]:
    """The budget alerts an organisation (or one of its keys) crossed in ``month`` (YYYY-MM, UTC)."""
    return (
        BudgetAlert.objects.filter(organization_id=organization_id, month=month)
        .select_related("api_key")
        .order_by("-created_at")
    )


# --- The console's customer pages (platform admins: every organisation) ---------------


def organizations_listed(*, q: str = "", tier: str = "") -> QuerySet[Organization]:
    """Organisations by name, with ``member_count`` and ``active_key_count``; ``q`` matches
    the name or slug, ``tier`` one tier."""
    found = Organization.objects.all()
    if q:
        found = found.filter(Q(name__icontains=q) | Q(slug__icontains=q))
    if tier:
        found = found.filter(tier=tier)
    return found.annotate(
        member_count=Count("memberships", distinct=True),
        active_key_count=Count("api_keys", filter=Q(api_keys__is_active=True), distinct=True),
    ).order_by("name")


def memberships_of(*, organization_id: int) -> QuerySet[Membership]:
    """An organisation's members, by username."""
    return Membership.objects.filter(organization_id=organization_id).select_related("user").order_by("user__username")


def membership_of(*, organization_id: int, username: str) -> Membership | None:
    return memberships_of(organization_id=organization_id).filter(user__username=username).first()


def user_named(*, username: str) -> Any:
    """The user with this username, or None."""
    return get_user_model().objects.filter(username=username).first()


def invoices_listed(
    *, status: str = "", period: date | None = None, organization_id: int | None = None, organization_q: str = ""
) -> QuerySet[Invoice]:
    """Every organisation's invoices, newest month first, filtered by state, month and
    organisation (its id, or its name containing ``organization_q``)."""
    found = Invoice.objects.select_related("organization")
    if status:
        found = found.filter(status=status)
    if period is not None:
        found = found.filter(period=period)
    if organization_id is not None:
        found = found.filter(organization_id=organization_id)
    if organization_q:
        found = found.filter(organization__name__icontains=organization_q)
    return found.order_by("-period", "-number")


def invoice_get(*, invoice_id: int) -> Invoice | None:
    return Invoice.objects.select_related("organization", "reissue_of").filter(pk=invoice_id).first()


def prices_listed(*, model: str = "", include_ended: bool = False) -> QuerySet[Price]:
    """Prices by model, newest first: those in effect or scheduled, or every one."""
    prices = Price.objects.select_related("model", "version").order_by("model__name", "version_id", "-effective_from")
    if not include_ended:
        prices = prices.exclude(effective_to__lte=timezone.now())
    if model:
        prices = prices.filter(model__name__icontains=model)
    return prices


def reconciliations_latest(*, ok: bool | None = None) -> QuerySet[Reconciliation]:
    """Reconciliations, newest first; only agreeing (``ok``) or only mismatching ones."""
    found = Reconciliation.objects.order_by("-created_at")
    return found if ok is None else found.filter(ok=ok)
