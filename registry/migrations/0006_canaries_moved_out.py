"""Canaries moved to rollout (issue 19): state only, the tables stay."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("registry", "0005_replica_restart_requested_at"),
        ("rollout", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveField(
                    model_name="canarydecision",
                    name="canary",
                ),
                migrations.RemoveField(
                    model_name="canarydecision",
                    name="actor",
                ),
                migrations.DeleteModel(
                    name="Canary",
                ),
                migrations.DeleteModel(
                    name="CanaryDecision",
                ),
            ],
        ),
    ]
