"""Canaries: a version taking a growing share of a model's traffic while it is judged.

The tables were the registry's (``registry_canary``, ``registry_canarydecision``) and keep
their names: ``rollout`` took them over by a state-only migration (issue 19).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from registry.models import Model, ModelVersion


class Canary(models.Model):
    """A canary rollout of one model: ``canary_version`` takes a growing share of the traffic
    from ``base_version``, step by step, while ``rollout.canary`` judges it at each interval.

    Moves only through ``rollout.canary`` (row locked, guarded by ``TRANSITIONS``). Completed:
    every step passed without ``auto_promote``; the split stays at the last step until a
    person promotes or rolls back.
    """

    class Status(models.TextChoices):
        RUNNING = "running", "Running"
        PAUSED = "paused", "Paused"
        PROMOTED = "promoted", "Promoted"
        ROLLED_BACK = "rolled_back", "Rolled back"
        COMPLETED = "completed", "Completed, waiting for a person"

    TRANSITIONS: dict[str, frozenset[str]] = {
        Status.RUNNING: frozenset({Status.PAUSED, Status.PROMOTED, Status.ROLLED_BACK, Status.COMPLETED}),
        Status.PAUSED: frozenset({Status.RUNNING, Status.PROMOTED, Status.ROLLED_BACK}),
        Status.COMPLETED: frozenset({Status.PROMOTED, Status.ROLLED_BACK}),
        Status.PROMOTED: frozenset(),
        Status.ROLLED_BACK: frozenset(),
    }
    # A model has at most one canary in these states (a database constraint).
    ACTIVE_STATUSES = (Status.RUNNING, Status.PAUSED, Status.COMPLETED)

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="canaries")
    base_version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="+")
    canary_version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="+")
    steps = models.JSONField(help_text="the canary's percentage at each step, increasing, e.g. [5, 25, 50, 100]")
    current_step = models.PositiveSmallIntegerField(default=0, help_text="index into steps")
    interval_seconds = models.PositiveIntegerField(help_text="how long each judgement's window lasts")
    min_samples = models.PositiveIntegerField(default=50, help_text="requests each arm needs before any verdict")
    success_criteria = models.JSONField(
        default=dict, blank=True, help_text="absolute bounds: max_p99_latency_ms, min_success_rate, max_ttft_p99_ms"
    )
    auto_promote = models.BooleanField(default=False)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.RUNNING)
    step_started_at = models.DateTimeField(help_text="start of the current step's window")
    next_decision_at = models.DateTimeField(help_text="the next interval boundary")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["model"],
                condition=models.Q(status__in=["running", "paused", "completed"]),
                name="one_active_canary_per_model",
            ),
            models.CheckConstraint(
                condition=~models.Q(base_version=models.F("canary_version")), name="canary_versions_differ"
            ),
            models.CheckConstraint(condition=models.Q(interval_seconds__gte=1), name="canary_interval_positive"),
            models.CheckConstraint(condition=models.Q(min_samples__gte=1), name="canary_min_samples_positive"),
        ]
        indexes = [models.Index(fields=["status", "next_decision_at"], name="canary_due")]
        db_table = "registry_canary"  # made by the registry before rollout/ existed (issue 19)

    def __str__(self) -> str:
        return f"{self.model.name}: {self.base_version.version} → {self.canary_version.version} ({self.status})"

    @property
    def canary_percent(self) -> int:
        return int(self.steps[self.current_step])


class CanaryDecision(models.Model):
    """One judgement of a canary, with the figures and test statistics that drove it. Never edited."""

    class Verdict(models.TextChoices):
        PROMOTE_STEP = "promote_step", "Promote to the next step"
        HOLD = "hold", "Hold"
        ROLLBACK = "rollback", "Roll back"
        PROMOTE = "promote", "Promote"

    canary = models.ForeignKey(Canary, on_delete=models.CASCADE, related_name="decisions")
    at = models.DateTimeField(db_index=True)
    step = models.PositiveSmallIntegerField(help_text="the step judged (index into the canary's steps)")
    canary_percent = models.PositiveSmallIntegerField(help_text="the canary's share during the window")
    verdict = models.CharField(max_length=20, choices=Verdict.choices)
    reasons = models.JSONField(default=list)
    # Per arm: n, error rate, latency/TTFT/TPOT p50 and p99, empty and truncated shares;
    # per test: statistic, p-value, adjusted p-value, effect, sample sizes (rollout.canary_stats).
    figures = models.JSONField(default=dict)
    # None: an automatic decision by the controller; else the person who paused, promoted …
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["at", "id"]
        db_table = "registry_canarydecision"

    def __str__(self) -> str:
        return f"canary {self.canary_id} step {self.step}: {self.verdict}"
