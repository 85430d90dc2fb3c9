"""The tables of batch jobs: stored files, batches, their lines and webhook deliveries."""

from __future__ import annotations

from django.db import models


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
    organisation's secret, retried with backoff until delivered or given up (``serving.batches.webhooks``)."""

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
