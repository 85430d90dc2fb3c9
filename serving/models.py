"""The data plane's own tables: the semantic cache (entries, per-model rules) and shadow traffic."""

from __future__ import annotations

from decimal import Decimal

from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex
from django.core.exceptions import ValidationError
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
    wrong_hit_budget = models.DecimalField(
        max_digits=5, decimal_places=2, null=True, blank=True,
        validators=[MinValueValidator(Decimal(0)), MaxValueValidator(Decimal(100))],
        help_text="the share of wrong semantic hits accepted, in % (empty: SEMANTIC_CACHE_WRONG_HIT_BUDGET); "
                  "a wording tier whose measured rate may exceed it is not served",
    )  # fmt: skip
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


class ShadowPolicy(models.Model):
    """Mirror a share of one model's requests to a candidate version (shadow traffic).

    Set by platform admins. The customer is always answered by the version routing chose;
    the candidate's answer is discarded and only its figures are kept (``ShadowRecord``),
    never metered, limited or billed. Gateways read the enabled policies into their routing
    snapshot (``serving.routing``), so mirroring costs the request path no query.
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
        # The admin form's check; serving.services.shadow_policy_set checks the same.
        if self.model_id is not None and self.candidate_id is not None and self.candidate.model_id != self.model_id:
            raise ValidationError({"candidate": "Pick a version of this model."})


class ShadowRecord(models.Model):
    """What the candidate did with one mirrored request (its answer itself is discarded).

    A table of its own, never a usage record: nothing here is metered, rolled up or
    invoiced. ``request_id`` is the primary request's, so each row compares with that
    request's ``billing.UsageRecord``.
    """

    request_id = models.UUIDField(unique=True, help_text="the primary request's id")
    model = models.CharField(max_length=255)
    candidate_version = models.CharField(max_length=50)
    primary_version = models.CharField(max_length=50, help_text="the version that answered the customer")
    endpoint = models.CharField(max_length=16)
    stream = models.BooleanField(help_text="mirrored as a stream (the primary streamed)")
    status_code = models.PositiveSmallIntegerField(help_text="the candidate's outcome, as a client would have seen it")
    latency_ms = models.PositiveIntegerField()
    ttft_ms = models.PositiveIntegerField(null=True, blank=True, help_text="streams only")
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    finish_reason = models.CharField(max_length=16, blank=True, default="")
    # A small model's copy: the items it carried, and on how many of them the candidate's
    # prediction (its label) was the primary's: the agreement rate no token model has.
    inferences = models.PositiveIntegerField(default=0)
    agreements = models.PositiveIntegerField(default=0, help_text="items whose label the candidate predicted as well")
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(help_text="when the copy was sent (UTC)")

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["model", "candidate_version", "created_at"], name="shadow_candidate_time"),
            models.Index(fields=["created_at"], name="shadow_time"),
        ]

    def __str__(self) -> str:
        return f"shadow of {self.request_id} on {self.model}:{self.candidate_version} ({self.status_code})"


class StoredFile(models.Model):
    """A file of OpenAI's Files API (``/v1/files``): a batch's input (purpose ``batch``), and
    later its output and errors. Its bytes live in the artifact store
    (``registry.artifacts``: ``put_file``), under the organisation's folder; the row is the
    index. An organisation sees only its own files, whichever of its keys uploaded them."""

    PURPOSES = ("batch", "batch_output")

    public_id = models.CharField(max_length=40, unique=True, help_text="`file-…`, the API's id")
    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="files")
    api_key = models.ForeignKey(
        "accounts.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="files",
        help_text="the key that uploaded it (none for a file the platform wrote)",
    )  # fmt: skip
    purpose = models.CharField(max_length=20, choices=[(p, p) for p in PURPOSES])
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField()
    lines = models.PositiveIntegerField(help_text="its JSONL requests (or results)")
    sha256 = models.CharField(max_length=64)
    uri = models.CharField(max_length=500, help_text="where the artifact store keeps it")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["organization", "-created_at"], name="file_org_recent")]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.filename})"


class Batch(models.Model):
    """A batch job (OpenAI's Batch API, ``/v1/batches``, and the seeds' ``/api/v1/batch``):
    the requests of an input file run offline on capacity interactive traffic leaves idle,
    at the batch price, each exactly once (``serving.batches``). Its lines are ``BatchLine``
    rows; its answers are written, in line order, to an output and an error file when it ends.
    """

    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    # What each status may become (``core.transitions``). A batch the worker cannot carry on
    # (its file cannot be read into lines, its results cannot be written) fails on its own,
    # from any unfinished status; a batch still validating when its window ends expires.
    TRANSITIONS = {
        "validating": {"in_progress", "failed", "cancelling", "expired"},
        "in_progress": {"finalizing", "cancelling", "failed"},
        "cancelling": {"cancelled", "failed"},
        "finalizing": {"completed", "expired", "cancelled", "failed"},
    }
    UNFINISHED = tuple(TRANSITIONS)  # a status that may still move; the others are final

    public_id = models.CharField(max_length=40, unique=True, help_text="`batch_…`, the API's id")
    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="batches")
    api_key = models.ForeignKey(
        "accounts.ApiKey", on_delete=models.PROTECT, related_name="batches", help_text="whose grant its lines run under"
    )
    endpoint = models.CharField(max_length=40)
    model = models.CharField(max_length=255, blank=True, default="", help_text="every line's; set when validated")
    input_file = models.ForeignKey(
        StoredFile, null=True, on_delete=models.SET_NULL, related_name="batches_in",
        help_text="empty once the file is deleted (its lines are kept with the batch)",
    )  # fmt: skip
    input_file_public_id = models.CharField(max_length=40)
    output_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="batches_out"
    )
    error_file = models.ForeignKey(
        StoredFile, null=True, blank=True, on_delete=models.SET_NULL, related_name="batches_err"
    )
    completion_window = models.CharField(max_length=10, default="24h")
    metadata = models.JSONField(default=dict, blank=True)
    callback_url = models.CharField(max_length=2000, blank=True, default="", help_text="the seeds' webhook")
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.VALIDATING)
    errors = models.JSONField(default=list, blank=True, help_text="why validation failed")
    # Why it stopped early: "" (it did not), "cancelled", "expired", "insufficient_quota".
    stop_reason = models.CharField(max_length=20, blank=True, default="")
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["organization", "-created_at"], name="batch_org_recent"),
            models.Index(fields=["status"], name="batch_status"),
        ]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.status})"


class BatchLine(models.Model):
    """One request of a batch and, once run, its answer. ``status`` moves pending → running →
    succeeded | failed, and running → pending again when an attempt is given back (its worker
    died, its engine failed). The answer is written before the usage event (``metered``), so a
    line whose answer was written is never run again, and its event is written exactly once."""

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    index = models.PositiveIntegerField(help_text="its place in the input file, from 0")
    custom_id = models.CharField(max_length=512)
    body = models.JSONField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    lease_until = models.DateTimeField(null=True, blank=True, help_text="a running line's worker renews this")
    owner = models.CharField(max_length=64, blank=True, default="", help_text="the worker running it")
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    response = models.JSONField(null=True, blank=True, help_text="the answer's body")
    error = models.JSONField(null=True, blank=True, help_text="{code, message} when it failed")
    usage_event = models.JSONField(null=True, blank=True, help_text="its usage event until it is written")
    metered = models.BooleanField(default=False)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["batch", "index"], name="batch_line_unique_index")]
        indexes = [
            models.Index(fields=["batch", "status", "index"], name="batch_line_todo"),
            models.Index(
                fields=["lease_until"], name="batch_line_leases", condition=models.Q(status="running")
            ),
            # Lines finished lately: the console's throughput, the seeds' estimated_time.
            models.Index(fields=["finished_at"], name="batch_line_finished"),
            models.Index(
                fields=["batch"], name="batch_line_unmetered",
                condition=models.Q(metered=False, status__in=["succeeded", "failed"]),
            ),
        ]  # fmt: skip

    def __str__(self) -> str:
        return f"{self.batch_id}#{self.index} ({self.status})"


class WebhookDelivery(models.Model):
    """One webhook to a customer's address (the seeds' batch ``callback_url``): signed with the
    organisation's secret, retried with backoff until delivered or given up (``serving.webhooks``)."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"

    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="webhooks")
    batch = models.ForeignKey(Batch, null=True, blank=True, on_delete=models.SET_NULL, related_name="webhooks")
    url = models.CharField(max_length=2000)
    event = models.CharField(max_length=40)
    payload = models.JSONField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(db_index=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["organization", "-created_at"], name="webhook_org_recent")]

    def __str__(self) -> str:
        return f"{self.event} → {self.url} ({self.status})"
