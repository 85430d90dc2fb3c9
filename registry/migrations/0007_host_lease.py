"""One engine supervisor per host name (issue 34): the host's lease."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("registry", "0006_canaries_moved_out"),
    ]

    operations = [
        migrations.CreateModel(
            name="HostLease",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("host", models.CharField(max_length=255, unique=True)),
                ("holder", models.CharField(max_length=255)),
                ("taken_at", models.DateTimeField()),
                ("expires_at", models.DateTimeField()),
            ],
        ),
    ]
