"""An API key's limits as the limiter holds it to them, for the one summary every key list shows
(``console/_key_limits.html``): the key's own, each at most its organisation's plan ceiling,
where an empty limit under a ceiling is the ceiling (``accounts.grants.ScopeLimits``, the grant's
one rule). So a key with no spend cap of its own, in an organisation with one, shows the cap its
budget alerts are raised against.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings

from accounts.grants import ScopeLimits
from accounts.models import ApiKey, Organization
from accounts.selectors import plan_key_ceilings
from core import formats

# ScopeLimits' name for each of the key's limit fields.
_FIELDS = {
    "rpm": "rate_limit_rpm",
    "tpm": "rate_limit_tpm",
    "ipm": "rate_limit_ipm",
    "concurrent": "max_concurrent",
    "token_quota": "monthly_token_quota",
    "spend_cap": "monthly_spend_cap",
}


@dataclass(frozen=True)
class LimitText:
    text: str  # "60 requests/min", "$0.0002/month"
    held_by: str  # "" (the key's own), "organisation" or "plan": whose limit holds the key


@dataclass(frozen=True)
class KeyLimits:
    """``limits``: what the key is held to; ``inherited``: which of them (ScopeLimits' names)
    are not the key's own but its organisation's (``"organisation"``) or its plan's (``"plan"``)."""

    key: ApiKey
    limits: ScopeLimits
    inherited: dict[str, str]

    @property
    def texts(self) -> list[LimitText]:
        """The limits that hold, in people's units: counts as quantities, the spend cap as configured."""
        limits = self.limits
        # (field, value, noun, its plural, per): "1 request/min", "60 requests/min".
        shown = [
            ("rpm", limits.rpm, "request", "requests", "/min"),
            ("tpm", limits.tpm, "token", "tokens", "/min"),
            ("ipm", limits.ipm, "inference", "inferences", "/min"),
            ("concurrent", limits.concurrent, "at once", "at once", ""),
            ("token_quota", limits.token_quota, "token", "tokens", "/month"),
        ]
        texts = [
            LimitText(f"{formats.quantity(value)} {one if value == 1 else many}{per}", self.inherited.get(name, ""))
            for name, value, one, many, per in shown
            if value is not None
        ]
        if limits.spend_cap is not None:
            cap = formats.unit_price(limits.spend_cap, str(settings.BILLING_CURRENCY))
            texts.append(LimitText(f"{cap}/month", self.inherited.get("spend_cap", "")))
        return texts


def key_limits(keys: Iterable[ApiKey], *, organization: Organization) -> dict[int, KeyLimits]:
    """Each key's limits within ``organization``'s plan (one read of the plan for them all), by key id."""
    ceilings = plan_key_ceilings(organization=organization)
    found: dict[int, KeyLimits] = {}
    for key in keys:
        limits = ScopeLimits.of(key, ceilings=ceilings)
        inherited = {
            name: "organisation" if getattr(organization, field) is not None else "plan"
            for name, field in _FIELDS.items()
            if getattr(limits, name) is not None and getattr(limits, name) != getattr(key, field)
        }
        found[key.pk] = KeyLimits(key, limits, inherited)
    return found
