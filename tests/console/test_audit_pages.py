"""The audit log in the console (issue 23): targets linked to their pages, creations in one line,
updates as what changed, filtering by object, actor and action, and a version's timeline."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from registry.models import AuditEntry, Deployment, Model, ModelVersion, Replica
from registry.services import (
    AUTOSCALER,
    audit_record,
    deployment_create,
    deployment_scale,
    replica_record_load_time,
    traffic_set,
)
from rollout.autoscaler import deployment_autoscale_set
from rollout.canary import canary_create, canary_decide, canary_promote, canary_rollback
from rollout.canary_stats import RequestSample
from rollout.hotswap import (
    SWAP,
    deployment_swap_drain,
    deployment_swap_finish,
    deployment_swap_shift,
    deployment_swap_version,
)
from tests.support.registry import make_version

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def empty_audit_log(db) -> None:
    """Session fixtures elsewhere commit audit entries; this test's transaction hides them."""
    AuditEntry.objects.all().delete()


@pytest.fixture
def admin(db):
    return get_user_model().objects.create_superuser(username="auditor", password="pw-123456789")


@pytest.fixture
def browser(admin) -> Client:
    client = Client()
    client.force_login(admin)
    return client


def entry_html(html: str, entry: AuditEntry) -> str:
    return html.split(f'data-audit="{entry.pk}"', 1)[1].split("</li>", 1)[0]


def model_with(name: str, *versions: str) -> tuple[Model, list[ModelVersion]]:
    model = Model.objects.create(name=name, task="chat")
    return model, [make_version(model, version) for version in versions]


def register_entry(actor, version: ModelVersion, size: int = 1_288_490_189) -> AuditEntry:
    """The entry model_version_create writes (without hashing an artifact)."""
    entry = audit_record(actor=actor, action="model_version.register", target_type="model_version",
                         target=str(version), before=None,
                         after={"model": version.model.name, "version": version.version, "framework": "pytorch",
                                "artifact_uri": version.artifact_uri, "artifact_sha256": "ab12" + "0" * 60,
                                "artifact_size": size, "config": {"max_seq_len": 4096},
                                "status": "registered"})  # fmt: skip
    assert entry is not None
    return entry


class TestLinkedTargets:
    def test_each_target_links_to_its_page(self, browser, admin):
        _, [v1] = model_with("linked", "1")
        deployment = deployment_create(actor=admin, version=v1)
        replica = Replica.objects.create(deployment=deployment, host="h", state="ready")
        entries = {
            "model": audit_record(actor=admin, action="x.model", target_type="model", target="linked", before=None,
                                  after={"a": 1}),
            "version": register_entry(admin, v1),
            "deployment": AuditEntry.objects.get(action="deployment.create"),
            "replica": replica_record_load_time(replica=replica, seconds=3.2, host="h"),
            "canary": audit_record(actor=admin, action="canary.pause", target_type="canary", target="linked",
                                   before={"status": "running"}, after={"status": "paused"}),
            "bundled": audit_record(actor=admin, action="bundled.import", target_type="model",
                                    target="bundled models", before=None, after={"force": False}),
        }  # fmt: skip
        html = browser.get("/console/audit/").content.decode()

        expected = {
            "model": '<a href="/console/models/?q=linked" data-target-link>model linked</a>',
            "version": '<a href="/console/models/linked/1/" data-target-link>version linked:1</a>',
            "deployment": f'<a href="/console/deployments/?model=linked#deployment-{deployment.pk}" data-target-link>'
            f"deployment #{deployment.pk}</a>",
            "replica": f'<a href="/console/models/linked/1/#replica-{replica.pk}" data-target-link>'
            f"replica #{replica.pk}</a>",
            "canary": '<a href="/console/canaries/linked/" data-target-link>canary of linked</a>',
            "bundled": '<a href="/console/models/bundled/" data-target-link>the bundled models</a>',
        }
        for kind, entry in entries.items():
            assert entry is not None
            assert expected[kind] in entry_html(html, entry), kind

    def test_the_linked_pages_have_the_anchor(self, browser, admin):
        _, [v1] = model_with("anchored", "1")
        deployment = deployment_create(actor=admin, version=v1)
        replica = Replica.objects.create(deployment=deployment, host="h", state="ready")
        html = browser.get("/console/models/anchored/1/").content.decode()
        assert f'id="replica-{replica.pk}"' in html

    def test_a_stopped_deployment_links_to_the_board_with_stopped_ones(self, browser, admin):
        _, [v1] = model_with("stopped-one", "1")
        deployment = deployment_create(actor=admin, version=v1)
        Deployment.objects.filter(pk=deployment.pk).update(status="stopped")
        html = browser.get("/console/audit/").content.decode()
        assert f'href="/console/deployments/?model=stopped-one&amp;stopped=1#deployment-{deployment.pk}"' in html

    def test_a_deleted_target_shows_its_name_without_a_link(self, browser, admin):
        entry = audit_record(actor=admin, action="deployment.scale", target_type="deployment", target="99999",
                             before={"replicas": 1}, after={"replicas": 2})  # fmt: skip
        gone = audit_record(actor=admin, action="canary.pause", target_type="canary", target="no-such-model",
                            before={"status": "running"}, after={"status": "paused"})  # fmt: skip
        assert entry is not None
        assert gone is not None
        html = browser.get("/console/audit/").content.decode()
        row = entry_html(html, entry)
        assert "data-target-link" not in row
        assert "deployment #99999</span>" in row
        assert "data-target-link" not in entry_html(html, gone)

    def test_a_system_actor_is_named_and_marked(self, browser):
        _, [v1] = model_with("sys", "1")
        deployment = Deployment.objects.create(version=v1, replicas=1, max_replicas=3, status="running")
        deployment_scale(actor=AUTOSCALER, deployment=deployment, replicas=2, reasons=["queue of 7"])
        entry = AuditEntry.objects.get(action="autoscale")
        row = entry_html(browser.get("/console/audit/").content.decode(), entry)
        assert (
            '<span class="tag actor-system" title="A part of the platform, acting on its own">autoscaler</span>' in row
        )
        assert '<p class="audit-summary">queue of 7</p>' in row
        assert '<th scope="row">replicas</th><td class="diff-before">1</td><td class="diff-after">2</td>' in row
        assert "observations" not in row  # added empty: nothing to say


class TestCompactEntries:
    def test_a_registration_is_one_line_with_the_whole_record_folded(self, browser, admin):
        _, [v2] = model_with("llama", "v2")
        entry = register_entry(admin, v2)
        row = entry_html(browser.get("/console/audit/").content.decode(), entry)
        assert '<p class="audit-summary">registered llama v2 (sha256 ab12…, 1.2\xa0GB)</p>' in row
        assert 'class="diff"' not in row
        assert "The whole record (8 fields)" in row
        assert "<dt>config.max_seq_len</dt><dd>4096</dd>" in row

    def test_a_deployment_and_a_canary_start_are_one_line(self, browser, admin):
        model, [v1, v2] = model_with("compact", "v1", "v2")
        deployment_create(actor=admin, version=v1, traffic_weight=100, replicas=2, max_replicas=4)
        deployment_create(actor=admin, version=v2, traffic_weight=0)
        canary_create(actor=admin, model=model, base_version="v1", canary_version="v2", steps=[5, 50, 100],
                      interval_seconds=60)  # fmt: skip
        html = browser.get("/console/audit/").content.decode()
        assert "deployed compact v1: 2 replicas (min 1, max 4), 100 % of traffic" in html
        assert "deployed compact v2: 1 replica (min 1, max 1), 0 % of traffic" in html
        assert "started a canary of compact: v2 against v1, steps 5 → 50 → 100 %, judged every 60 s" in html

    def test_an_update_shows_only_the_nested_fields_that_changed(self, browser, admin):
        _, [v1] = model_with("policy", "1")
        deployment = deployment_create(actor=admin, version=v1)
        deployment_autoscale_set(actor=admin, deployment=deployment, autoscale={"enabled": True})
        deployment_autoscale_set(actor=admin, deployment=deployment, autoscale={"enabled": True, "target_p99_ms": 900})
        entry = AuditEntry.objects.filter(action="deployment.autoscale").latest("id")
        row = entry_html(browser.get("/console/audit/").content.decode(), entry)
        assert row.count('<th scope="row">') == 1
        changed = '<th scope="row">autoscale.target_p99_ms</th><td class="diff-before">—</td><td class="diff-after">900'
        assert changed in row


class TestFilterByObject:
    @pytest.fixture
    def world(self, admin) -> dict[str, object]:
        """Two models; the first with a version, a deployment with a replica, a canary entry."""
        model, [v1] = model_with("alpha", "1")
        _, [other] = model_with("beta", "1")
        register_entry(admin, v1)
        register_entry(admin, other)
        deployment = deployment_create(actor=admin, version=v1)
        deployment_create(actor=admin, version=other)
        replica = Replica.objects.create(deployment=deployment, host="h", state="ready")
        replica_record_load_time(replica=replica, seconds=1.0, host="h")
        audit_record(actor=None, action="canary.pause", target_type="canary", target="alpha",
                     before={"status": "running"}, after={"status": "paused"})  # fmt: skip
        audit_record(actor=None, action="shadow.set", target_type="model", target="alpha", before=None,
                     after={"candidate": "1", "percent": "5.00", "enabled": True})  # fmt: skip
        return {"model": model, "version": v1, "deployment": deployment, "replica": replica}

    def found(self, browser: Client, query: str) -> list[tuple[str, str]]:
        response = browser.get(f"/console/audit/?{query}")
        assert response.status_code == 200
        return sorted((row.entry.target_type, row.entry.action) for row in response.context["rows"])

    def test_a_model_with_everything_under_it(self, browser, world):
        assert self.found(browser, "target=model:alpha") == [
            ("canary", "canary.pause"),
            ("deployment", "deployment.create"),
            ("model", "shadow.set"),
            ("model_version", "model_version.register"),
            ("replica", "replica.ready"),
        ]

    def test_a_deployment_with_its_replicas_or_a_version_with_its_deployments(self, browser, world):
        deployment = world["deployment"]
        assert self.found(browser, f"target=deployment:{deployment.pk}") == [
            ("deployment", "deployment.create"),
            ("replica", "replica.ready"),
        ]
        assert self.found(browser, "target=model_version:alpha:1") == [
            ("deployment", "deployment.create"),
            ("model_version", "model_version.register"),
            ("replica", "replica.ready"),
        ]
        assert self.found(browser, "target=canary:alpha") == [("canary", "canary.pause")]

    def test_a_deployment_made_by_a_hot_swap_includes_the_swap(self, browser, admin):
        _, [v1, v2] = model_with("swapped", "1", "2")
        old = Deployment.objects.create(version=v1, status="running", traffic_weight=100)
        new = deployment_swap_version(actor=admin, deployment=old, version=v2)
        assert self.found(browser, f"target=deployment:{new.pk}") == [
            ("deployment", "deployment.create"),
            ("deployment", SWAP),
        ]

    def test_by_actor_and_action(self, browser, admin, world):
        assert self.found(browser, "actor=auditor&action=deployment.create") == [
            ("deployment", "deployment.create"),
            ("deployment", "deployment.create"),
        ]
        assert self.found(browser, "actor=engine supervisor") == [("replica", "replica.ready")]
        html = browser.get("/console/audit/").content.decode()
        assert '<option value="engine supervisor">' in html  # the actor field suggests who acted

    def test_the_filters_are_shown_and_each_can_be_removed(self, browser, world):
        response = browser.get("/console/audit/?target=model:alpha&actor=auditor&page=1")
        html = response.content.decode()
        assert response.context["filters_shown"] == [
            ("model alpha and everything under it", "/console/audit/?actor=auditor"),
            ("by auditor", "/console/audit/?target=model%3Aalpha"),
        ]
        assert 'aria-label="Remove the filter model alpha and everything under it"' in html

    def test_one_entry_on_its_own(self, browser, world):
        entry = AuditEntry.objects.get(action="replica.ready")
        response = browser.get(f"/console/audit/?entry={entry.pk}")
        assert [row.entry for row in response.context["rows"]] == [entry]
        assert response.context["filters_shown"] == [(f"entry #{entry.pk}", "/console/audit/")]

    def test_an_exact_target_without_a_type_still_works(self, browser, world):
        assert self.found(browser, "target=alpha") == [("canary", "canary.pause"), ("model", "shadow.set")]

    def test_each_entry_links_to_the_log_of_its_target(self, browser, world):
        html = browser.get("/console/audit/").content.decode()
        deployment = world["deployment"]
        assert f'href="/console/audit/?target=deployment%3A{deployment.pk}"' in html

    def test_the_version_page_links_to_the_log_of_the_version_model_and_deployments(self, browser, world):
        html = browser.get("/console/models/alpha/1/").content.decode()
        assert 'href="/console/audit/?target=model_version%3Aalpha%3A1" data-audit-of="version"' in html
        assert 'href="/console/audit/?target=model%3Aalpha" data-audit-of="model"' in html
        deployment = world["deployment"]
        assert f'?target=deployment:{deployment.pk}" data-audit-of="deployment"' in html


def same_samples(*, model: str, version: str, since: object) -> list[RequestSample]:
    return [RequestSample(status_code=200, latency_ms=100 + n, ttft_ms=20, completion_tokens=10) for n in range(40)]


class TestVersionTimeline:
    def test_a_canary_from_start_to_promotion(self, browser, admin):
        model, [v1, v2] = model_with("life", "v1", "v2")
        register_entry(admin, v1)
        register_entry(admin, v2)
        d1 = deployment_create(actor=admin, version=v1, traffic_weight=100)
        d2 = deployment_create(actor=admin, version=v2, traffic_weight=0, max_replicas=3)
        traffic_set(actor=admin, model=model, weights={"v1": 100})  # changes nothing: not an event
        start = timezone.now()
        canary = canary_create(actor=admin, model=model, base_version="v1", canary_version="v2", steps=[10, 50, 100],
                               interval_seconds=60, min_samples=5, now=start)  # fmt: skip
        decision = canary_decide(canary_id=canary.pk, load_samples=same_samples, now=start + timedelta(seconds=61))
        assert decision is not None
        assert decision.verdict == "promote_step"
        canary.refresh_from_db()
        canary_promote(actor=admin, canary=canary)
        deployment_scale(actor=AUTOSCALER, deployment=d2, replicas=2, reasons=["busy"])
        Deployment.objects.filter(pk=d2.pk).update(status="running")

        response = browser.get("/console/models/life/v2/")
        events = [(e.kind, e.label, e.entry.actor_name) for e in response.context["timeline"]]
        assert events == [
            ("registered", "registered", "auditor"),
            ("deployed", f"deployed as deployment #{d2.pk}: 1 replica, 0 % of traffic", "auditor"),
            ("traffic", "traffic 0 → 10 %", "auditor"),
            ("canary", "canary started against v1 at 10 %", "auditor"),
            ("traffic", "traffic 10 → 50 %", "canary controller"),
            ("canary", "canary step 2 of 3: 50 %", "canary controller"),
            ("traffic", "traffic 50 → 100 %", "auditor"),
            ("promoted", "promoted: serving 100 %", "auditor"),
            ("scaled", f"autoscaled deployment #{d2.pk}: 1 → 2 replicas", "autoscaler"),
        ]
        html = response.content.decode()
        timeline = html.split("data-timeline", 1)[1].split("</ol>", 1)[0]
        first = response.context["timeline"][0].entry
        assert f'href="/console/audit/?entry={first.pk}"' in timeline
        assert f"{first.created_at:%Y-%m-%d %H:%M}</time>" in timeline
        assert '<span class="tag actor-system" title="A part of the platform, acting on its own">canary controller' in (
            timeline
        )
        assert 'data-lifecycle="promoted"' in html  # the badge of what it is now, unchanged

        base = [(e.kind, e.label) for e in browser.get("/console/models/life/v1/").context["timeline"]]
        assert base == [
            ("registered", "registered"),
            ("deployed", f"deployed as deployment #{d1.pk}: 1 replica, 100 % of traffic"),
            ("traffic", "traffic 100 → 90 %"),
            ("canary", "base of a canary of v2 at 10 %"),
            ("traffic", "traffic 90 → 50 %"),
            ("canary", "canary v2 step 2 of 3: 50 %, this version 50 %"),
            ("traffic", "traffic 50 → 0 %"),
            ("stopped", "replaced by v2 (promoted): no traffic"),
        ]

    def test_a_canary_held_for_a_person_then_rolled_back(self, browser, admin):
        model, [v1, v2] = model_with("held", "v1", "v2")
        deployment_create(actor=admin, version=v1, traffic_weight=100)
        deployment_create(actor=admin, version=v2, traffic_weight=0)
        start = timezone.now()
        canary = canary_create(actor=admin, model=model, base_version="v1", canary_version="v2", steps=[10, 100],
                               interval_seconds=60, min_samples=5, now=start)  # fmt: skip
        canary_decide(canary_id=canary.pk, load_samples=same_samples, now=start + timedelta(seconds=61))
        canary.refresh_from_db()
        canary_rollback(actor=admin, canary=canary)

        candidate = [(e.kind, e.label) for e in browser.get("/console/models/held/v2/").context["timeline"]]
        assert candidate[-4:] == [
            ("traffic", "traffic 10 → 100 %"),
            ("canary", "canary step 2 of 2: 100 %, waiting for a person to promote"),
            ("traffic", "traffic 100 → 0 %"),
            ("rolled_back", "rolled back: no traffic"),
        ]
        base = [(e.kind, e.label) for e in browser.get("/console/models/held/v1/").context["timeline"]]
        assert base[-2:] == [("traffic", "traffic 0 → 100 %"), ("traffic", "canary v2 rolled back: serving 100 %")]

    def test_a_hot_swap_from_both_sides(self, browser, admin):
        _, [v1, v2] = model_with("swap-life", "1", "2")
        old = Deployment.objects.create(version=v1, status="running", traffic_weight=100)
        new = deployment_swap_version(actor=admin, deployment=old, version=v2)
        swap = AuditEntry.objects.get(action=SWAP)
        Deployment.objects.filter(pk=new.pk).update(status="running")
        Replica.objects.create(deployment=new, host="h", state="ready", last_heartbeat=timezone.now())
        assert deployment_swap_shift(swap=swap, heartbeat_after=timezone.now() - timedelta(minutes=1))
        assert deployment_swap_drain(swap=swap)
        assert deployment_swap_finish(swap=swap, outcome="completed", reason="every old replica stopped")

        leaving = [(e.kind, e.label) for e in browser.get("/console/models/swap-life/1/").context["timeline"]]
        assert leaving == [
            ("swap", f"hot-swap to 2 started: deployment #{old.pk} → #{new.pk}"),
            ("swap", "hot-swap to 2: traffic moved"),
            ("stopped", f"hot-swap to 2: deployment #{old.pk} draining"),
            ("stopped", f"hot-swap to 2 completed: deployment #{old.pk} stopped"),
        ]
        arriving = [(e.kind, e.label) for e in browser.get("/console/models/swap-life/2/").context["timeline"]]
        assert arriving == [
            ("deployed", f"deployed as deployment #{new.pk}: 1 replica, 0 % of traffic"),
            ("swap", f"hot-swap from 1 started: deployment #{old.pk} → #{new.pk}"),
            ("swap", "hot-swap from 1: traffic moved here"),
            ("swap", "hot-swap from 1 completed"),
        ]

    def test_a_version_with_no_events_says_so(self, browser):
        model_with("quiet", "1")
        html = browser.get("/console/models/quiet/1/").content.decode()
        assert "No events recorded for this version yet." in html
