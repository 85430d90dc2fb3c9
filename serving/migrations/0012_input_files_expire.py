"""Uploaded batch input files expire (FILES_INPUT_RETENTION_DAYS after their upload): those
uploaded before this rule get the same date, counted from their upload."""

from datetime import timedelta

from django.conf import settings
from django.db import migrations
from django.db.models import F


def expire_uploads(apps, schema_editor):
    StoredFile = apps.get_model("serving", "StoredFile")
    days = timedelta(days=getattr(settings, "FILES_INPUT_RETENTION_DAYS", 30))
    StoredFile.objects.filter(purpose="batch", expires_at__isnull=True).update(expires_at=F("created_at") + days)


class Migration(migrations.Migration):
    dependencies = [
        ("serving", "0011_cache_signatures"),
    ]

    operations = [migrations.RunPython(expire_uploads, migrations.RunPython.noop)]
