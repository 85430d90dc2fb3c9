"""Canaries and their decisions move from registry to rollout (issue 19): state only, the
tables keep their names (registry_canary, registry_canarydecision), no data moves."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

from core.model_moves import move_content_types


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("registry", "0005_replica_restart_requested_at"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        move_content_types(("canary", "canarydecision"), source="registry", target="rollout"),
        migrations.SeparateDatabaseAndState(
            # The tables stay where they are (db_table): only Django's idea of which app
            # owns them moves.
            state_operations=[
                migrations.CreateModel(
                    name="Canary",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        (
                            "steps",
                            models.JSONField(
                                help_text="the canary's percentage at each step, increasing, e.g. [5, 25, 50, 100]"
                            ),
                        ),
                        ("current_step", models.PositiveSmallIntegerField(default=0, help_text="index into steps")),
                        (
                            "interval_seconds",
                            models.PositiveIntegerField(help_text="how long each judgement's window lasts"),
                        ),
                        (
                            "min_samples",
                            models.PositiveIntegerField(
                                default=50, help_text="requests each arm needs before any verdict"
                            ),
                        ),
                        (
                            "success_criteria",
                            models.JSONField(
                                blank=True,
                                default=dict,
                                help_text="absolute bounds: max_p99_latency_ms, min_success_rate, max_ttft_p99_ms",
                            ),
                        ),
                        ("auto_promote", models.BooleanField(default=False)),
                        (
                            "status",
                            models.CharField(
                                choices=[
                                    ("running", "Running"),
                                    ("paused", "Paused"),
                                    ("promoted", "Promoted"),
                                    ("rolled_back", "Rolled back"),
                                    ("completed", "Completed, waiting for a person"),
                                ],
                                default="running",
                                max_length=20,
                            ),
                        ),
                        ("step_started_at", models.DateTimeField(help_text="start of the current step's window")),
                        ("next_decision_at", models.DateTimeField(help_text="the next interval boundary")),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        ("updated_at", models.DateTimeField(auto_now=True)),
                        (
                            "base_version",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="+",
                                to="registry.modelversion",
                            ),
                        ),
                        (
                            "canary_version",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="+",
                                to="registry.modelversion",
                            ),
                        ),
                        (
                            "created_by",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                        (
                            "model",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="canaries",
                                to="registry.model",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "registry_canary",
                        "ordering": ["-created_at", "-id"],
                    },
                ),
                migrations.CreateModel(
                    name="CanaryDecision",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("at", models.DateTimeField(db_index=True)),
                        (
                            "step",
                            models.PositiveSmallIntegerField(
                                help_text="the step judged (index into the canary's steps)"
                            ),
                        ),
                        (
                            "canary_percent",
                            models.PositiveSmallIntegerField(help_text="the canary's share during the window"),
                        ),
                        (
                            "verdict",
                            models.CharField(
                                choices=[
                                    ("promote_step", "Promote to the next step"),
                                    ("hold", "Hold"),
                                    ("rollback", "Roll back"),
                                    ("promote", "Promote"),
                                ],
                                max_length=20,
                            ),
                        ),
                        ("reasons", models.JSONField(default=list)),
                        ("figures", models.JSONField(default=dict)),
                        (
                            "actor",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                        (
                            "canary",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="decisions",
                                to="rollout.canary",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "registry_canarydecision",
                        "ordering": ["at", "id"],
                    },
                ),
                migrations.AddIndex(
                    model_name="canary",
                    index=models.Index(fields=["status", "next_decision_at"], name="canary_due"),
                ),
                migrations.AddConstraint(
                    model_name="canary",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(("status__in", ["running", "paused", "completed"])),
                        fields=("model",),
                        name="one_active_canary_per_model",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="canary",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("base_version", models.F("canary_version")), _negated=True),
                        name="canary_versions_differ",
                    ),
                ),
                migrations.AddConstraint(
                    model_name="canary",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("interval_seconds__gte", 1)), name="canary_interval_positive"
                    ),
                ),
                migrations.AddConstraint(
                    model_name="canary",
                    constraint=models.CheckConstraint(
                        condition=models.Q(("min_samples__gte", 1)), name="canary_min_samples_positive"
                    ),
                ),
            ],
        ),
    ]
