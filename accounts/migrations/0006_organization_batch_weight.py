import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0005_api_key_last_four"),
    ]

    operations = [
        migrations.AddField(
            model_name="organization",
            name="batch_weight",
            field=models.PositiveSmallIntegerField(
                default=1,
                help_text="its share of batch capacity when several organisations' batches wait: an organisation of "
                "weight 2 gets twice the lines in flight of one of weight 1 (platform admins set it)",
                validators=[
                    django.core.validators.MinValueValidator(1),
                    django.core.validators.MaxValueValidator(1000),
                ],
            ),
        ),
    ]
