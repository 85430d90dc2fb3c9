"""Organisations, memberships, invitations, API keys and plans move from billing to accounts
(issue 19): state only, the tables keep their names, no data moves."""

from decimal import Decimal

import django.contrib.postgres.fields
import django.core.validators
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

from core.model_moves import move_content_types


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("billing", "0009_invoice_billed_to"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        move_content_types(
            ("organization", "membership", "apikey", "invitation", "plan"), source="billing", target="accounts"
        ),
        migrations.SeparateDatabaseAndState(
            # The tables stay where they are (db_table): only Django's idea of which app
            # owns them moves.
            state_operations=[
                migrations.CreateModel(
                    name="Organization",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        (
                            "rate_limit_rpm",
                            models.PositiveBigIntegerField(
                                blank=True,
                                help_text="requests per minute",
                                null=True,
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "rate_limit_tpm",
                            models.PositiveBigIntegerField(
                                blank=True,
                                help_text="tokens per minute",
                                null=True,
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "max_concurrent",
                            models.PositiveBigIntegerField(
                                blank=True,
                                help_text="requests at once",
                                null=True,
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "monthly_token_quota",
                            models.PositiveBigIntegerField(
                                blank=True,
                                help_text="tokens per UTC month",
                                null=True,
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "monthly_spend_cap",
                            models.DecimalField(
                                blank=True,
                                decimal_places=6,
                                help_text="spend per UTC month, in the billing currency (each request at its model's price)",
                                max_digits=14,
                                null=True,
                                validators=[django.core.validators.MinValueValidator(Decimal("0.000001"))],
                            ),
                        ),
                        (
                            "budget_alert_percent",
                            models.PositiveSmallIntegerField(
                                default=80,
                                help_text="a soft alert when a budget is this full (percent)",
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(100),
                                ],
                            ),
                        ),
                        ("name", models.CharField(max_length=255, unique=True)),
                        ("slug", models.SlugField(max_length=255, unique=True)),
                        (
                            "tier",
                            models.CharField(
                                choices=[("free", "Free"), ("paid", "Paid")], default="paid", max_length=8
                            ),
                        ),
                        (
                            "billing_email",
                            models.EmailField(
                                blank=True, help_text="where invoices and budget alerts are sent", max_length=254
                            ),
                        ),
                        (
                            "tax_rate",
                            models.DecimalField(
                                decimal_places=4,
                                default=Decimal("0"),
                                help_text="applied to invoice subtotals, e.g. 0.2000 for 20 %",
                                max_digits=5,
                                validators=[
                                    django.core.validators.MinValueValidator(Decimal("0")),
                                    django.core.validators.MaxValueValidator(Decimal("1")),
                                ],
                            ),
                        ),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        "db_table": "billing_organization",
                        "ordering": ["name"],
                    },
                ),
                migrations.CreateModel(
                    name="Plan",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        (
                            "tier",
                            models.CharField(choices=[("free", "Free"), ("paid", "Paid")], max_length=8, unique=True),
                        ),
                        ("name", models.CharField(max_length=100)),
                        (
                            "included_credit",
                            models.DecimalField(
                                decimal_places=2,
                                default=Decimal("0"),
                                help_text="usage included each month, in the billing currency",
                                max_digits=16,
                                validators=[django.core.validators.MinValueValidator(Decimal("0"))],
                            ),
                        ),
                        (
                            "rate_limit_rpm",
                            models.PositiveBigIntegerField(
                                blank=True,
                                null=True,
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "rate_limit_tpm",
                            models.PositiveBigIntegerField(
                                blank=True,
                                null=True,
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "max_concurrent",
                            models.PositiveBigIntegerField(
                                blank=True,
                                null=True,
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "monthly_token_quota",
                            models.PositiveBigIntegerField(
                                blank=True,
                                null=True,
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "monthly_spend_cap",
                            models.DecimalField(
                                blank=True,
                                decimal_places=6,
                                max_digits=14,
                                null=True,
                                validators=[django.core.validators.MinValueValidator(Decimal("0.000001"))],
                            ),
                        ),
                    ],
                    options={
                        "db_table": "billing_plan",
                        "ordering": ["tier"],
                    },
                ),
                migrations.CreateModel(
                    name="Membership",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        (
                            "role",
                            models.CharField(
                                choices=[
                                    ("platform_admin", "Platform admin"),
                                    ("org_admin", "Org admin"),
                                    ("org_member", "Org member"),
                                ],
                                default="org_member",
                                max_length=20,
                            ),
                        ),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        (
                            "user",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="memberships",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                        (
                            "organization",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="memberships",
                                to="accounts.organization",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "billing_membership",
                        "constraints": [
                            models.UniqueConstraint(fields=("user", "organization"), name="uniq_membership")
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="Invitation",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("username", models.CharField(max_length=150)),
                        (
                            "role",
                            models.CharField(
                                choices=[("org_admin", "Org admin"), ("org_member", "Org member")],
                                default="org_member",
                                max_length=20,
                            ),
                        ),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        ("accepted_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "invited_by",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                        (
                            "organization",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="invitations",
                                to="accounts.organization",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "billing_invitation",
                        "ordering": ["-created_at"],
                        "constraints": [
                            models.UniqueConstraint(
                                condition=models.Q(("accepted_at__isnull", True)),
                                fields=("organization", "username"),
                                name="uniq_pending_invitation",
                            ),
                            models.CheckConstraint(
                                condition=models.Q(("role__in", ["org_admin", "org_member"])),
                                name="invitation_role_is_org_role",
                            ),
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="ApiKey",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        (
                            "max_concurrent",
                            models.PositiveBigIntegerField(
                                blank=True,
                                help_text="requests at once",
                                null=True,
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "monthly_token_quota",
                            models.PositiveBigIntegerField(
                                blank=True,
                                help_text="tokens per UTC month",
                                null=True,
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "monthly_spend_cap",
                            models.DecimalField(
                                blank=True,
                                decimal_places=6,
                                help_text="spend per UTC month, in the billing currency (each request at its model's price)",
                                max_digits=14,
                                null=True,
                                validators=[django.core.validators.MinValueValidator(Decimal("0.000001"))],
                            ),
                        ),
                        (
                            "budget_alert_percent",
                            models.PositiveSmallIntegerField(
                                default=80,
                                help_text="a soft alert when a budget is this full (percent)",
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(100),
                                ],
                            ),
                        ),
                        (
                            "key_hash",
                            models.CharField(help_text="hex SHA-256 of the full key", max_length=64, unique=True),
                        ),
                        ("prefix", models.CharField(help_text="first characters, for display", max_length=16)),
                        ("name", models.CharField(max_length=255)),
                        (
                            "rate_limit_rpm",
                            models.PositiveBigIntegerField(
                                default=60,
                                help_text="requests per minute",
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "rate_limit_tpm",
                            models.PositiveBigIntegerField(
                                default=100000,
                                help_text="tokens per minute",
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(1000000000000000),
                                ],
                            ),
                        ),
                        (
                            "tier",
                            models.CharField(
                                choices=[("free", "Free"), ("paid", "Paid")], default="free", max_length=8
                            ),
                        ),
                        (
                            "allowed_models",
                            django.contrib.postgres.fields.ArrayField(
                                base_field=models.CharField(max_length=255),
                                blank=True,
                                default=list,
                                help_text="empty means every model",
                                size=None,
                            ),
                        ),
                        ("is_active", models.BooleanField(default=True)),
                        ("expires_at", models.DateTimeField(blank=True, null=True)),
                        ("revoked_at", models.DateTimeField(blank=True, null=True)),
                        ("last_used_at", models.DateTimeField(blank=True, null=True)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        (
                            "rotated_to",
                            models.OneToOneField(
                                blank=True,
                                help_text="the key that replaced this one; this one works until expires_at",
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="rotated_from",
                                to="accounts.apikey",
                            ),
                        ),
                        (
                            "organization",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="api_keys",
                                to="accounts.organization",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "billing_apikey",
                        "ordering": ["-created_at"],
                        "constraints": [
                            models.CheckConstraint(
                                condition=models.Q(("key_hash__regex", "^[0-9a-f]{64}$")), name="key_hash_is_sha256"
                            )
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
