"""The semantic cache's entries and each model's cache rules (the data plane's own tables)."""

from __future__ import annotations

from decimal import Decimal

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from pgvector.django import HnswIndex, VectorField

# all-minilm-l6-v2, the bundled embedding model the cache embeds prompts with.
EMBEDDING_DIMENSIONS = 384
# A scope is a lowercase hex SHA-256; its first digit picks one of these HNSW indexes.
SCOPE_BUCKETS = "0123456789abcdef"


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
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "cache policies"

    def __str__(self) -> str:
        return f"cache policy of {self.model}"


class CacheEntry(models.Model):
    """One cached answer: found only inside its exact ``scope`` (a hash of the model version,
    the system prompt, the sampling parameters that change the answer, the conversation
    before the last user turn, and the tenant scope), by the embedding of its last user turn.
    """

    scope = models.CharField(max_length=64, help_text="hex SHA-256 (serving.semcache.policy.scope_of)")
    organization = models.ForeignKey(
        "billing.Organization", null=True, blank=True, on_delete=models.CASCADE, related_name="cache_entries",
        help_text="whose request stored it (entries of a shared scope are served to others too)",
    )  # fmt: skip
    model = models.CharField(max_length=255)
    model_version = models.CharField(max_length=50)
    embedding = VectorField(dimensions=EMBEDDING_DIMENSIONS)
    prompt = models.TextField(help_text="the last user turn, as embedded and verified")
    response = models.JSONField(help_text="the answer to replay: message (role, content, …) and finish_reason")
    prompt_tokens = models.PositiveIntegerField()
    completion_tokens = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    hit_count = models.PositiveIntegerField(default=0)
    last_hit_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # One HNSW index per first hex digit of the scope (a bucket of 1/16 of the
            # entries): a search filtered to one scope walks a graph where its scope is 16
            # times denser than in one index over everything, which is what keeps pgvector's
            # iterative scan short. Small scopes are searched exactly instead, from the
            # covering index below without touching the table. Measurements:
            # docs/performance.md, "Semantic cache: lookup at 1M entries".
            *(
                HnswIndex(
                    name=f"cache_embedding_hnsw_{bucket}",
                    fields=["embedding"],
                    m=16,
                    ef_construction=64,
                    opclasses=["vector_cosine_ops"],
                    condition=models.Q(scope__startswith=bucket),
                )
                for bucket in SCOPE_BUCKETS
            ),
            models.Index(fields=["scope", "expires_at"], include=["id", "embedding"], name="cache_scope_vectors"),
            models.Index(fields=["expires_at"], name="cache_expiry"),
            models.Index(fields=["model", "model_version"], name="cache_model_version"),
        ]

    def __str__(self) -> str:
        return f"{self.model}:{self.model_version} {self.prompt[:40]!r}"
