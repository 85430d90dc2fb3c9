"""Per-model rules the routing snapshot carries to every gateway: the semantic cache's policy and the shadow policy."""

from __future__ import annotations

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models


class CachePolicy(models.Model):
    """How the semantic cache treats one model; a model without a row gets the defaults
    (``SEMANTIC_CACHE_*`` settings). Set by platform admins."""

    model = models.OneToOneField("registry.Model", on_delete=models.CASCADE, related_name="cache_policy")
    enabled = models.BooleanField(default=True)
    max_temperature = models.DecimalField(
        max_digits=3,
        decimal_places=2,
        default=Decimal("0.5"),
        validators=[MinValueValidator(Decimal(0)), MaxValueValidator(Decimal(2))],
        help_text="requests sampling hotter than this are never cached nor served from the cache",
    )
    max_prompt_tokens = models.PositiveIntegerField(default=2000, validators=[MinValueValidator(1)])
    ttl_seconds = models.PositiveIntegerField(default=3600, validators=[MinValueValidator(1)])
    shared_scope = models.BooleanField(
        default=False, help_text="share entries across organisations (only for models whose answers are public)"
    )
    wrong_hit_budget = models.DecimalField(
        max_digits=5, decimal_places=2, null=True, blank=True,
        validators=[MinValueValidator(Decimal(0)), MaxValueValidator(Decimal(100))],
        help_text="the share of wrong semantic hits accepted, in % (empty: SEMANTIC_CACHE_WRONG_HIT_BUDGET); "
                  "a wording tier whose measured rate may exceed it is not served",
    )  # fmt: skip
    paraphrases = models.BooleanField(
        null=True, blank=True,
        help_text="serve prompts worded otherwise when the learned verifier and the entry's own bound agree "
                  "(empty: SEMANTIC_CACHE_PARAPHRASES)",
    )  # fmt: skip
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "cache policies"

    def __str__(self) -> str:
        return f"cache policy of {self.model}"


class ShadowPolicy(models.Model):
    """Mirror a share of one model's requests to a candidate version (shadow traffic).

    Set by platform admins. The customer is always answered by the version routing chose;
    the candidate's answer is discarded and only its figures are kept (``ShadowRecord``),
    never metered, limited or billed. Gateways read the enabled policies into their routing
    snapshot (``serving.gateway.routing``), so mirroring costs the request path no query.
    """

    model = models.OneToOneField("registry.Model", on_delete=models.CASCADE, related_name="shadow_policy")
    candidate = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.CASCADE, related_name="shadow_policies",
        help_text="the version that receives the copies (a version of this model, deployed: its weight may be 0)",
    )  # fmt: skip
    percent = models.DecimalField(
        max_digits=5,
        decimal_places=2,
        validators=[MinValueValidator(Decimal(0)), MaxValueValidator(Decimal(100))],
        help_text="share of the model's requests copied, 0-100 (picked by a hash of the request id)",
    )
    enabled = models.BooleanField(default=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "shadow policies"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(percent__gte=0, percent__lte=100), name="shadow_percent_0_to_100"
            ),
        ]

    def __str__(self) -> str:
        return f"shadow {self.percent}% of {self.model} to {self.candidate}"

    def clean(self) -> None:
        # The admin form's check; serving.shadow.services.shadow_policy_set checks the same.
        if self.model_id is not None and self.candidate_id is not None and self.candidate.model_id != self.model_id:
            raise ValidationError({"candidate": "Pick a version of this model."})
