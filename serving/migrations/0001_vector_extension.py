"""Create the pgvector extension the semantic cache stores embeddings with."""

from django.db import migrations
from pgvector.django import VectorExtension


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [VectorExtension()]
