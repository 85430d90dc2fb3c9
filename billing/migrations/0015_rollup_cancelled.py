# Issue 34, defect 12: a client's cancel (status 499) is not the server's error. Rollups count
# cancels on their own and errors without them.

from django.db import migrations, models

# The rollups already built are recomputed from their records, with the SQL as it is at this
# migration (billing.outcomes' definition written out: later code may change). Only rows whose
# bucket has a cancel change: every other row's errors were already right. A row is matched
# to its records as billing.rollups groups them (bucket, key, model, version, price, batch).
_RECOUNT = """
WITH counted AS (
    SELECT r.id, c.errors, c.cancelled
    FROM billing_usagerollup r
    CROSS JOIN LATERAL (
        SELECT count(*) FILTER (WHERE u.status_code NOT BETWEEN 200 AND 299 AND u.status_code <> 499) AS errors,
               count(*) FILTER (WHERE u.status_code = 499) AS cancelled
        FROM billing_usagerecord u
        WHERE u.created_at >= r.start
          AND u.created_at < r.start + CASE WHEN r.period = 'day' THEN interval '1 day' ELSE interval '1 hour' END
          AND u.api_key_id = r.api_key_id AND u.model = r.model AND u.model_version = r.model_version
          AND u.price_id IS NOT DISTINCT FROM r.price_id AND u.batch = r.batch
    ) c
)
UPDATE billing_usagerollup r
SET errors = counted.errors, cancelled = counted.cancelled
FROM counted
WHERE counted.id = r.id AND counted.cancelled > 0
"""
# Back to errors that include the cancels, before the column goes.
_UNCOUNT = "UPDATE billing_usagerollup SET errors = errors + cancelled WHERE cancelled > 0"


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0014_rollup_histograms"),
    ]

    operations = [
        migrations.AddField(
            model_name="usagerollup",
            name="cancelled",
            field=models.PositiveBigIntegerField(
                default=0, help_text="requests their clients cancelled (status 499): in requests, not in errors"
            ),
        ),
        migrations.AlterField(
            model_name="usagerollup",
            name="errors",
            field=models.PositiveBigIntegerField(
                default=0, help_text="requests whose status was not 2xx, but for those their clients cancelled"
            ),
        ),
        migrations.RunSQL(_RECOUNT, _UNCOUNT),
    ]
