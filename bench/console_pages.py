"""Do the usage pages stay fast with a million usage records? They should: they read rollups.

An organisation ``Bench pages`` gets usage records spread over the last ``--days`` days (raw
SQL, ``generate_series``), rollups are rebuilt for that span (``billing.rollups.rollups_rebuild``,
what the Celery beat task does minute by minute), and each page that shows usage is fetched
``--repeat`` times with Django's test client, signed in as a platform admin (console pages) or
as the organisation's admin (portal pages). That is done first with ``--small`` records and
then with ``--records``, in one run, so the table's ratio (median time with many records /
with few) says whether a page's cost follows the raw records. Each page's SQL is captured too:
the last column says whether any query touched the raw ``billing_usagerecord`` table.

Needs the embedded services and a migrated database (``make bootstrap``). The organisation's
records and rollups are deleted at the end (and at the start, from an earlier run).

    .venv/bin/python bench/console_pages.py                     # 1,000 then 1,000,000 records
    .venv/bin/python bench/console_pages.py --records 200000 --repeat 5

Writes bench/results/console_pages-<time>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mock_suite import django_setup, report_start, write_report

ORG = "Bench pages"
MODELS = (("bench-pages-chat", "1"), ("bench-pages-chat", "2"), ("bench-pages-embed", "1"))


def setup() -> tuple[Any, Any, Any, Any]:
    """The organisation, its key, its admin and a platform admin (created once, reused)."""
    from django.contrib.auth import get_user_model

    from accounts.models import ApiKey, Role
    from accounts.services import api_key_create, membership_set, organization_get_or_create

    users = get_user_model()
    org = organization_get_or_create(name=ORG)
    key = ApiKey.objects.filter(organization=org, name="pages", revoked_at__isnull=True).first()
    if key is None:
        key = api_key_create(organization=org, name="pages").api_key
    org_admin, _ = users.objects.get_or_create(username="bench-pages-admin")
    membership_set(user=org_admin, organization=org, role=Role.ORG_ADMIN)
    staff, _ = users.objects.get_or_create(username="bench-pages-staff", defaults={"is_staff": True})
    if not staff.is_superuser:
        staff.is_superuser = staff.is_staff = True
        staff.save(update_fields=["is_superuser", "is_staff"])
    return org, key, org_admin, staff


def clear(org: Any) -> None:
    from billing.models import UsageRecord, UsageRollup

    UsageRollup.objects.filter(organization=org).delete()
    UsageRecord.objects.filter(organization=org).delete()


def fill(org: Any, key: Any, *, count: int, days: int) -> float:
    """Add ``count`` records spread over the last ``days`` days; seconds taken."""
    from django.db import connection

    started = time.perf_counter()
    names = "ARRAY[" + ", ".join(f"'{name}'" for name, _ in MODELS) + "]"
    versions = "ARRAY[" + ", ".join(f"'{version}'" for _, version in MODELS) + "]"
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO billing_usagerecord (
                request_id, api_key_id, organization_id, model, model_version, prompt_tokens,
                completion_tokens, cached_tokens, total_tokens, latency_ms, ttft_ms, status_code,
                created_at, cache, finish_reason, cost)
            SELECT gen_random_uuid(), %s, %s, ({names})[1 + mod(i, {len(MODELS)})],
                   ({versions})[1 + mod(i, {len(MODELS)})], 20 + mod(i, 200), 10 + mod(i, 90), 0,
                   30 + mod(i, 200) + mod(i, 90), 50 + mod(i, 900), 10 + mod(i, 90),
                   CASE WHEN mod(i, 97) = 0 THEN 500 ELSE 200 END,
                   now() - (random() * %s * interval '1 day'), 'miss', 'stop', mod(i, 300) * 0.000001
            FROM generate_series(1, %s) AS i
            """,
            [key.pk, org.pk, days, count],
        )
    return time.perf_counter() - started


def rebuild(days: int) -> float:
    from billing.rollups import rollups_rebuild

    started = time.perf_counter()
    now = datetime.now(UTC)
    rollups_rebuild(start=now - timedelta(days=days + 1), end=now + timedelta(hours=1))
    return time.perf_counter() - started


def rolled_up(org: Any) -> int:
    """Requests the organisation's daily rollups count (the pages read these)."""
    from django.db.models import Sum

    from billing.models import UsageRollup

    total = UsageRollup.objects.filter(organization=org, period="day").aggregate(n=Sum("requests"))["n"]
    return int(total or 0)


def pages(org: Any) -> list[tuple[str, str, str]]:
    """(label, path, who): the pages that show usage."""
    return [
        ("console overview, last day", "/console/?range=day", "staff"),
        ("console overview, 30 days", "/console/?range=30d", "staff"),
        ("console customer page", f"/console/customers/{org.pk}/", "staff"),
        ("console customers list", "/console/customers/", "staff"),
        ("console cache page", "/console/cache/", "staff"),
        ("portal usage (org admin)", f"/portal/{org.pk}/", "org_admin"),
        ("usage API, org (org admin)", f"/api/orgs/{org.pk}/usage/", "org_admin"),
    ]


def measure(org: Any, clients: dict[str, Any], repeat: int) -> dict[str, dict[str, Any]]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    out: dict[str, dict[str, Any]] = {}
    for label, path, who in pages(org):
        client = clients[who]
        first = client.get(path)
        if first.status_code != 200:
            raise SystemExit(f"{path} answered {first.status_code} to {who}")
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            client.get(path)
            times.append(time.perf_counter() - started)
        with CaptureQueriesContext(connection) as queries:
            client.get(path)
        raw = any("billing_usagerecord" in q["sql"] for q in queries.captured_queries)
        out[label] = {
            "path": path,
            "median_ms": statistics.median(times) * 1000,
            "queries": len(queries.captured_queries),
            "reads_raw_records": raw,
        }
        print(f"  {label:32} {out[label]['median_ms']:8.1f} ms  {out[label]['queries']:3} queries", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault("ALLOWED_HOSTS", "testserver")
    django_setup()
    from django.test import Client

    from billing.models import UsageRecord

    org, key, org_admin, staff = setup()
    clients = {"staff": Client(), "org_admin": Client()}
    clients["staff"].force_login(staff)
    clients["org_admin"].force_login(org_admin)
    report: dict[str, Any] = {**report_start(args), "runs": {}}
    clear(org)
    try:
        for count in (args.small, args.records):
            have = UsageRecord.objects.filter(organization=org).count()
            filled = fill(org, key, count=count - have, days=args.days)
            rebuilt = rebuild(args.days)
            rolled = rolled_up(org)
            if rolled != count:
                raise SystemExit(f"the daily rollups hold {rolled} requests of {count} records")
            print(f"{count} records (inserted in {filled:.1f} s, rollups rebuilt in {rebuilt:.1f} s):", flush=True)
            timed = measure(org, clients, args.repeat)
            report["runs"][str(count)] = {"insert_s": filled, "rollups_s": rebuilt, "pages": timed}
    finally:
        clear(org)
    small, large = (report["runs"][str(n)]["pages"] for n in (args.small, args.records))
    lines = [
        f"| page | {args.small:,} records | {args.records:,} records | ratio | queries | reads raw records |",
        "|---|---|---|---|---|---|",
    ]
    for label in small:
        a, b = small[label], large[label]
        lines.append(
            f"| {label} | {a['median_ms']:.1f} ms | {b['median_ms']:.1f} ms | {b['median_ms'] / a['median_ms']:.2f} | "
            f"{b['queries']} | {'yes' if b['reads_raw_records'] else 'no'} |"
        )
    report["table"] = "\n".join(lines)
    print("\n" + report["table"] + "\n")
    print(f"wrote {write_report('console_pages', report)}")


if __name__ == "__main__":
    main()
