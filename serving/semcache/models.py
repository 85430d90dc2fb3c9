"""The semantic cache's tables: entries (pgvector, one HNSW index per scope bucket) and feedback on served answers."""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex
from django.db import models
from django.db.models import Value
from pgvector.django import HnswIndex, VectorField

# all-minilm-l6-v2, the bundled embedding model the cache embeds prompts with.
EMBEDDING_DIMENSIONS = 384
# A scope is a lowercase hex SHA-256; its first digit picks one of these HNSW indexes.
SCOPE_BUCKETS = "0123456789abcdef"


class CacheEntry(models.Model):
    """One cached answer: found only inside its exact ``scope`` (a hash of the model version,
    the system prompt, the sampling parameters that change the answer, the conversation
    before the last user turn, and the tenant scope), by the embedding of its last user turn.
    """

    scope = models.CharField(max_length=64, help_text="hex SHA-256 (serving.semcache.policy.scope_of)")
    organization = models.ForeignKey(
        "accounts.Organization", null=True, blank=True, on_delete=models.CASCADE, related_name="cache_entries",
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
    # Raised by feedback on a wrong hit (serving.semcache.feedback), for the entry and its
    # neighbours: 0 serves every wording tier, 1 only the same words, 2 only the same text.
    strictness = models.PositiveSmallIntegerField(default=0)
    # The paraphrase tier's evidence on this entry (serving.semcache.bound): its answer compared
    # with the engine's for prompts the verifier scored against it, as [[score, agreed], …].
    evidence = models.JSONField(default=list, db_default=Value([], output_field=models.JSONField()), blank=True)
    # How a lookup finds it without embedding the query: hashes of its normalised word bag
    # and variants (serving.semcache.signature), matched by overlap through a GIN index.
    signatures = ArrayField(models.BigIntegerField(), default=list, blank=True)

    class Meta:
        indexes = [
            # fastupdate off: a lookup would otherwise scan the pending list of recent inserts
            # (up to gin_pending_list_limit, 4 MB) on every request; an insert (off the request
            # path) updates the index at once instead.
            GinIndex(fields=["signatures"], name="cache_signatures", fastupdate=False),
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


class CacheFeedback(models.Model):
    """A served cache answer reported wrong (by the customer's key or a platform admin): the
    entry and its neighbours were tightened, and the report counts in the model's estimate."""

    request_id = models.CharField(max_length=64, unique=True, help_text="the request that was served the answer")
    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="cache_feedback")
    model = models.CharField(max_length=255)
    model_version = models.CharField(max_length=50)
    # No database constraint: entries are purged with plain DELETEs (serving.semcache.store)
    # and a report outlives the entry it was about.
    entry = models.ForeignKey(CacheEntry, null=True, blank=True, on_delete=models.DO_NOTHING, db_constraint=False,
                              related_name="feedback")  # fmt: skip
    wording = models.CharField(max_length=20, help_text="the tier the answer was served at (exact, same, typo …)")
    reason = models.CharField(max_length=500, blank=True)
    reported_by = models.CharField(max_length=255, help_text="an API key's prefix, or a console user")
    tightened = models.PositiveIntegerField(default=0, help_text="entries tightened (the served one and neighbours)")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["model", "created_at"], name="cache_feedback_model")]

    def __str__(self) -> str:
        return f"wrong cache answer for {self.request_id}"
