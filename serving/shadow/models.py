"""Shadow traffic's table: what a candidate answered to a copy of a request, beside the version that served it."""

from __future__ import annotations

from django.db import models


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
