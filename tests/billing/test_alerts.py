"""Budget alerts: one row and one email per threshold, never twice; a failing mail server
delays the email, never the alert; the email is a task of its own (the slow queue), queued
once the rows are committed."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.core import mail
from django.core.mail.backends.base import BaseEmailBackend

from accounts.models import ApiKey
from accounts.services import api_key_create
from billing import usage
from billing.models import BudgetAlert
from billing.services import budget_alert_notify
from billing.tasks import budget_alerts_email, budget_alerts_notify_pending, budget_alerts_persist
from billing.usage import persist_budget_alerts
from core import keys
from core.redis import sync_redis

pytestmark = pytest.mark.django_db

MONTH = datetime.now(UTC).strftime("%Y-%m")
LOCMEM = "django.core.mail.backends.locmem.EmailBackend"


class FailingBackend(BaseEmailBackend):
    """A mail server that is down."""

    attempts = 0

    def send_messages(self, email_messages: Any) -> int:
        FailingBackend.attempts += 1
        raise ConnectionRefusedError("mail server down")


@pytest.fixture(autouse=True)
def streams(settings):
    settings.PERSIST_RETRY_AFTER_SECONDS = 0
    settings.EMAIL_BACKEND = LOCMEM
    client = sync_redis()
    names = [keys.budget_alerts(), keys.budget_alert_dead_letters()]
    client.delete(*names)
    yield client
    client.delete(*names)


@pytest.fixture(autouse=True)
def eager_celery():
    """Tasks queued with .delay() run at once, in this process (the alerts' email)."""
    conf = budget_alerts_email.app.conf
    previous = conf.task_always_eager
    conf.task_always_eager = True
    yield
    conf.task_always_eager = previous


@pytest.fixture
def persist(django_capture_on_commit_callbacks) -> Callable[..., int]:
    """Store the alerts as the metering worker does, then run the email task it queued on
    commit, as the slow worker would."""

    def run(task: Callable[[], int] = persist_budget_alerts) -> int:
        with django_capture_on_commit_callbacks(execute=True):
            return task()

    return run


@pytest.fixture
def key(alice_org) -> ApiKey:
    alice_org.billing_email = "ap@alice.example"
    alice_org.save()
    return api_key_create(organization=alice_org, name="batch jobs").api_key


def raise_alert(client, key: ApiKey, threshold: int, *, scope: str = "key", budget: str = "tokens",
                limit: int = 1000) -> None:  # fmt: skip
    """An alert as the limiter raises it (billing/ledger.lua): one stream entry per threshold."""
    ident = key.pk if scope == "key" else key.organization_id
    client.xadd(
        keys.budget_alerts(),
        {"scope": scope, "id": str(ident), "org": str(key.organization_id), "budget": budget, "month": MONTH,
         "threshold": str(threshold), "limit": str(limit), "used": str(limit * threshold // 100)},
    )  # fmt: skip


class TestOnePerThreshold:
    def test_each_threshold_is_its_own_row_and_email(self, streams, key, persist):
        for threshold in (50, 80, 90, 100):  # 90: the key's own budget_alert_percent
            raise_alert(streams, key, threshold)
        raise_alert(streams, key, 50, scope="org", budget="spend", limit=25_000_000)  # 25.00 in micro-units
        assert persist() == 5
        rows = BudgetAlert.objects.order_by("api_key_id", "threshold_percent")
        assert [(r.api_key_id, r.budget, r.threshold_percent) for r in rows] == [
            (key.pk, "tokens", 50), (key.pk, "tokens", 80), (key.pk, "tokens", 90), (key.pk, "tokens", 100),
            (None, "spend", 50),
        ]  # fmt: skip
        assert all(r.notified_at is not None for r in rows)
        assert len(mail.outbox) == 5
        assert {tuple(m.to) for m in mail.outbox} == {("ap@alice.example",)}
        subjects = sorted(m.subject for m in mail.outbox)
        assert any("'batch jobs'" in s and "at 90 %" in s for s in subjects)
        spend = next(m for m in mail.outbox if "spend cap" in m.subject)
        assert "the organisation" in spend.subject
        assert "Limit: $25.00" in spend.body  # the pages' money, not "25.000000 USD"
        assert "Used (including requests in flight): $12.50" in spend.body

    def test_a_cap_under_a_cent_reads_as_on_the_pages(self, streams, key, persist):
        raise_alert(streams, key, 100, scope="org", budget="spend", limit=200)  # 0.0002 in micro-units
        raise_alert(streams, key, 50, limit=1_234_567)  # a token quota
        assert persist() == 2
        spend = next(m for m in mail.outbox if "spend cap" in m.subject)
        assert "Limit: $0.0002\n" in spend.body  # as configured, never "< $0.01" nor "0.000200 USD"
        assert "Used (including requests in flight): $0.0002\n" in spend.body
        tokens = next(m for m in mail.outbox if "token quota" in m.subject)
        assert "Limit: 1,234,567 tokens" in tokens.body
        assert "Used (including requests in flight): 617,283 tokens" in tokens.body

    def test_an_alert_is_stored_and_sent_once(self, streams, key, persist):
        raise_alert(streams, key, 80)
        raise_alert(streams, key, 80)  # the same threshold again (a replayed entry)
        assert persist() == 2
        raise_alert(streams, key, 80)
        assert persist(budget_alerts_persist) == 1
        assert budget_alerts_notify_pending() == 0
        assert BudgetAlert.objects.count() == 1
        assert len(mail.outbox) == 1
        alert = BudgetAlert.objects.get()
        assert budget_alert_notify(alert_id=alert.pk) is False
        assert len(mail.outbox) == 1

    def test_the_scope_makes_separate_alerts(self, streams, key, persist):
        other = api_key_create(organization=key.organization, name="other").api_key
        raise_alert(streams, key, 80)
        raise_alert(streams, other, 80)
        raise_alert(streams, key, 80, scope="org")
        assert persist() == 3
        assert BudgetAlert.objects.count() == 3
        assert len(mail.outbox) == 3


class TestQueuedEmail:
    def test_the_email_waits_for_the_commit_and_is_a_task_of_its_own(
        self, streams, key, django_capture_on_commit_callbacks
    ):
        for threshold in (50, 80):
            raise_alert(streams, key, threshold)
        with django_capture_on_commit_callbacks() as queued:
            assert persist_budget_alerts() == 2
        # Stored and acknowledged, nothing sent: a mail server that hangs holds up the slow
        # queue's task, never the metering task that stores alerts.
        assert BudgetAlert.objects.filter(notified_at__isnull=True).count() == 2
        assert int(streams.xpending(keys.budget_alerts(), usage.GROUP)["pending"]) == 0
        assert mail.outbox == []
        assert len(queued) == 1  # one task for the run's new alerts
        queued[0]()
        assert len(mail.outbox) == 2
        assert not BudgetAlert.objects.filter(notified_at__isnull=True).exists()

    def test_nothing_new_queues_nothing(self, streams, key, persist, django_capture_on_commit_callbacks):
        raise_alert(streams, key, 80)
        assert persist() == 1
        raise_alert(streams, key, 80)  # stored already
        with django_capture_on_commit_callbacks() as queued:
            assert persist_budget_alerts() == 1
        assert queued == []
        assert len(mail.outbox) == 1


class TestMailFailures:
    def test_a_failing_mail_server_never_blocks_persistence(self, streams, key, settings, persist):
        settings.EMAIL_BACKEND = "tests.billing.test_alerts.FailingBackend"
        FailingBackend.attempts = 0
        for threshold in (50, 80, 100):
            raise_alert(streams, key, threshold)
        assert persist() == 3
        assert BudgetAlert.objects.filter(notified_at__isnull=True).count() == 3
        assert int(streams.xpending(keys.budget_alerts(), usage.GROUP)["pending"]) == 0  # acknowledged
        assert FailingBackend.attempts == 1  # the server is down: the rest wait for the retry
        assert budget_alerts_notify_pending() == 0  # still down
        settings.EMAIL_BACKEND = LOCMEM
        assert budget_alerts_notify_pending() == 3
        assert len(mail.outbox) == 3
        assert not BudgetAlert.objects.filter(notified_at__isnull=True).exists()
        assert budget_alerts_notify_pending() == 0
        assert len(mail.outbox) == 3

    def test_no_billing_email_stores_the_alert_and_sends_nothing(self, streams, key, persist):
        key.organization.billing_email = ""
        key.organization.save()
        raise_alert(streams, key, 80)
        assert persist() == 1
        assert BudgetAlert.objects.get().notified_at is None
        assert budget_alerts_notify_pending() == 0
        assert mail.outbox == []

    def test_old_unsent_alerts_are_not_retried(self, streams, key, settings, persist):
        settings.EMAIL_BACKEND = "tests.billing.test_alerts.FailingBackend"
        raise_alert(streams, key, 80)
        persist()
        BudgetAlert.objects.update(created_at=datetime.now(UTC) - timedelta(days=4))
        settings.EMAIL_BACKEND = LOCMEM
        assert budget_alerts_notify_pending() == 0
        assert mail.outbox == []
