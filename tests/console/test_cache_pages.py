"""The console's cache pages: who may open them, the figures against the rollups and the store,
editing a model's policy, and purging with a confirm step."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.messages import get_messages
from django.test import Client
from django.utils import timezone

from accounts.models import ApiKey, Membership, Organization, Role
from accounts.services import api_key_create, organization_create
from billing.cache_savings import cache_savings
from billing.models import UsageRecord, UsageRollup
from billing.usage_selectors import TierHits, cache_hits_by_tier
from core.errors import InvalidInput
from core.stats import wilson
from registry.models import AuditEntry, Model, Task
from serving.models import EMBEDDING_DIMENSIONS, CacheEntry, CachePolicy
from serving.semcache.services import cache_policy_set

pytestmark = pytest.mark.django_db

PAGES = ("/console/cache/", "/console/cache/policies/", "/console/cache/purge/?model=x")


def rollup(key: ApiKey, *, start: datetime, model: str, version: str = "1", requests: int = 100, hits: int = 0,
           cached: int = 0, saved: str = "0") -> UsageRollup:  # fmt: skip
    return UsageRollup.objects.create(
        period=UsageRollup.Period.HOUR, start=start, organization_id=key.organization_id, api_key=key, model=model,
        model_version=version, requests=requests, cache_hits=hits, cached_tokens=cached, saved=Decimal(saved),
        cost=Decimal("0.01"),
    )  # fmt: skip


def entry(*, model: str, version: str = "1", organization: Organization | None = None, expired: bool = False,
          hits: int = 0, evidence: list[list[float]] | None = None) -> CacheEntry:  # fmt: skip
    now = timezone.now()
    return CacheEntry.objects.create(
        scope="a" * 64, organization=organization, model=model, model_version=version,
        embedding=[0.1] * EMBEDDING_DIMENSIONS, prompt="hello", response={"message": {"content": "hi"}},
        prompt_tokens=3, completion_tokens=2, hit_count=hits, evidence=evidence or [],
        expires_at=now - timedelta(minutes=1) if expired else now + timedelta(hours=1),
    )  # fmt: skip


def requests(key: ApiKey, model: str, counts: dict[tuple[str, str], int], *, at: datetime) -> None:
    """Usage records of ``model`` at ``at``: per (cache, cache_tier), that many requests."""
    UsageRecord.objects.bulk_create(
        UsageRecord(api_key=key, organization_id=key.organization_id, model=model, model_version="1",
                    status_code=200, created_at=at, cache=cache, cache_tier=tier)
        for (cache, tier), n in counts.items() for _ in range(n)
    )  # fmt: skip


@pytest.fixture
def org(db: None) -> Organization:
    return organization_create(name="Cache Page Org")


@pytest.fixture
def key(org: Organization) -> ApiKey:
    return api_key_create(organization=org, name="cache-page").api_key


@pytest.fixture
def admin(db: None) -> Any:
    return get_user_model().objects.create_superuser(username="cache-admin", password="pw-123456789")


@pytest.fixture
def admin_browser(admin: Any) -> Client:
    client = Client()
    client.force_login(admin)
    return client


def figure_of(response: Any) -> dict[str, Any]:
    found = re.search(r'<script id="cache-hit-rate-figure" type="application/json">(.*?)</script>',
                      response.content.decode(), re.S)  # fmt: skip
    assert found, "the page carries its figure"
    data: dict[str, Any] = json.loads(found.group(1))
    return data


class TestPermissions:
    @pytest.mark.parametrize("url", PAGES)
    def test_anonymous_visitors_go_to_the_login_page(self, url: str) -> None:
        response = Client().get(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/accounts/login/")

    @pytest.mark.parametrize("role", [Role.ORG_MEMBER, Role.ORG_ADMIN])
    def test_organisation_members_and_admins_get_403(self, org: Organization, role: str) -> None:
        user = get_user_model().objects.create_user(username=f"cache-{role}", password="pw-123456789")
        Membership.objects.create(user=user, organization=org, role=role)
        client = Client()
        client.force_login(user)
        for url in PAGES:
            assert client.get(url).status_code == 403, url
        Model.objects.create(name="guarded", task=Task.CHAT)
        assert client.post("/console/cache/purge/", {"model": "guarded"}).status_code == 403
        assert client.post("/console/cache/policies/guarded/", {"ttl_seconds": 5}).status_code == 403
        assert Client().post("/console/cache/purge/", {"model": "guarded"}).status_code == 302

    def test_the_navigation_links_the_cache_page_for_platform_admins(self, admin_browser: Client) -> None:
        response = admin_browser.get("/console/cache/")
        assert response.status_code == 200
        assert 'href="/console/cache/"' in response.content.decode()


class TestFigures:
    def test_the_selector_sums_the_rollups_per_version_and_hour(self, key: ApiKey) -> None:
        now = datetime(2031, 3, 1, 12, 30, tzinfo=UTC)
        this_hour, last_hour = now.replace(minute=0), now.replace(minute=0) - timedelta(hours=1)
        rollup(key, start=last_hour, model="sel-a", requests=100, hits=25, cached=1000, saved="0.50")
        rollup(key, start=this_hour, model="sel-a", requests=50, hits=50, cached=500, saved="0.25")
        rollup(key, start=this_hour, model="sel-b", version="2", requests=10, hits=0)
        rollup(key, start=now - timedelta(days=2), model="sel-a", requests=999, hits=999)  # outside the window
        report = cache_savings(span=timedelta(days=1), now=now)
        by_version = {(v.model, v.version): v for v in report.versions}
        a = by_version[("sel-a", "1")]
        assert (a.requests, a.cache_hits, a.cached_tokens, a.saved) == (150, 75, 1500, Decimal("0.75"))
        assert a.hit_rate == 0.5
        assert by_version[("sel-b", "2")].hit_rate == 0
        series = {s.label: s for s in report.series}["sel-a:1"]
        assert series.hit_rates[series.hours.index(last_hour)] == 0.25
        assert series.hit_rates[series.hours.index(this_hour)] == 1.0
        assert series.hit_rates[0] is None  # no requests that hour: a gap, not zero

    def test_the_page_shows_what_the_rollups_and_the_store_hold(self, admin_browser: Client, key: ApiKey) -> None:
        this_hour = timezone.now().astimezone(UTC).replace(minute=0, second=0, microsecond=0)
        rollup(key, start=this_hour, model="page-model", version="7", requests=200, hits=50, cached=4000, saved="1.25")
        rollup(key, start=this_hour - timedelta(hours=2), model="page-model", version="7", requests=100, hits=100,
               cached=2000, saved="0.75")  # fmt: skip
        entry(model="page-model", version="7", hits=3)
        entry(model="page-model", version="7", hits=4)
        entry(model="page-model", version="7", expired=True)
        response = admin_browser.get("/console/cache/", {"q": "page-model"})
        assert response.status_code == 200
        html = response.content.decode()
        row = re.search(r'<tr data-version="page-model:7">(.*?)</tr>', html, re.S)
        assert row, html
        cells = dict(re.findall(r'<td data-col="([\w-]+)"[^>]*>([^<]*)</td>', row.group(1)))
        assert cells == {
            "entries": "2", "expired": "1", "entry-hits": "7", "requests": "300", "hits": "150",
            "hit-rate": "50.0 %", "cached-tokens": "6,000", "saved": "$2.00",
        }  # fmt: skip
        trace = {t["name"]: t for t in figure_of(response)["data"]}["page-model:7"]
        xs = [datetime.fromisoformat(x) for x in trace["x"]]
        assert trace["y"][xs.index(this_hour)] == 25.0
        assert trace["y"][xs.index(this_hour - timedelta(hours=2))] == 100.0
        assert "Wrong-hit budget" in html
        assert "HNSW indexes" in html

    def test_the_filter_narrows_the_table(self, admin_browser: Client, key: ApiKey) -> None:
        entry(model="kept-model")
        entry(model="other-model")
        html = admin_browser.get("/console/cache/", {"q": "kept"}).content.decode()
        assert 'data-version="kept-model:1"' in html
        assert 'data-version="other-model:1"' not in html

    def test_an_unknown_window_is_a_field_error_and_the_default_window_is_shown(self, admin_browser: Client) -> None:
        response = admin_browser.get("/console/cache/", {"window": "year"})
        assert response.status_code == 200
        assert "Select a valid choice" in response.content.decode()
        assert response.context["window"].key == "day"


class TestPurge:
    def test_the_confirm_step_counts_and_the_post_deletes_exactly_those(
        self, admin_browser: Client, org: Organization
    ) -> None:
        other = organization_create(name="Other Cache Org")
        mine = [entry(model="purge-me", version="1", organization=org) for _ in range(3)]
        kept = [
            entry(model="purge-me", version="2", organization=org),
            entry(model="purge-me", version="1", organization=other),
            entry(model="keep-me", version="1", organization=org),
        ]
        filters = {"model": "purge-me", "version": "1", "organization": str(org.pk)}
        response = admin_browser.get("/console/cache/purge/", filters)
        assert response.status_code == 200
        assert response.context["count"] == 3
        assert 'data-count="3"' in response.content.decode()
        assert CacheEntry.objects.filter(pk__in=[e.pk for e in mine]).count() == 3  # nothing gone yet
        response = admin_browser.post("/console/cache/purge/", filters)
        assert response.status_code == 302
        assert response["Location"] == "/console/cache/"
        assert not CacheEntry.objects.filter(pk__in=[e.pk for e in mine]).exists()
        assert CacheEntry.objects.filter(pk__in=[e.pk for e in kept]).count() == 3
        assert [str(m) for m in get_messages(response.wsgi_request)] == [
            f"Purged 3 cache entries (model purge-me, version 1, organisation {org.name})."
        ]

    def test_a_purge_needs_a_filter(self, admin_browser: Client) -> None:
        entry(model="untouched")
        for response in (admin_browser.get("/console/cache/purge/"), admin_browser.post("/console/cache/purge/", {})):
            assert response.status_code == 400
            assert "Give at least one of model, version or organisation." in response.content.decode()
        assert CacheEntry.objects.filter(model="untouched").exists()

    def test_an_unknown_organisation_is_a_field_error(self, admin_browser: Client) -> None:
        response = admin_browser.post("/console/cache/purge/", {"organization": "999999"})
        assert response.status_code == 400
        assert "Select a valid choice" in response.content.decode()


class TestPolicy:
    VALID = {"enabled": "on", "max_temperature": "0.30", "max_prompt_tokens": "1500", "ttl_seconds": "600"}

    def test_the_list_shows_defaults_and_policies(self, admin_browser: Client) -> None:
        Model.objects.create(name="no-policy", task=Task.CHAT)
        model = Model.objects.create(name="has-policy", task=Task.CHAT)
        CachePolicy.objects.create(model=model, enabled=False, ttl_seconds=42)
        html = admin_browser.get("/console/cache/policies/", {"q": "policy"}).content.decode()
        assert '<tr data-model="no-policy">' in html
        assert "(defaults)" in html
        row = re.search(r'<tr data-model="has-policy">(.*?)</tr>', html, re.S)
        assert row
        assert ">off<" in row.group(1)
        assert "<td>42</td>" in row.group(1)

    def test_paraphrases_are_the_models_choice_shown_in_the_list(self, admin_browser: Client) -> None:
        model = Model.objects.create(name="paraphrase-policy", task=Task.CHAT)
        admin_browser.post("/console/cache/policies/paraphrase-policy/", {**self.VALID, "paraphrases": "on"})
        assert CachePolicy.objects.get(model=model).paraphrases is True
        html = admin_browser.get("/console/cache/policies/", {"q": "paraphrase-policy"}).content.decode()
        row = re.search(r'<tr data-model="paraphrase-policy">(.*?)</tr>', html, re.S)
        assert row
        assert "<td>served</td>" in row.group(1)
        admin_browser.post("/console/cache/policies/paraphrase-policy/", self.VALID)
        assert CachePolicy.objects.get(model=model).paraphrases is False
        form = admin_browser.get("/console/cache/policies/paraphrase-policy/").content.decode()
        assert 'name="paraphrases"' in form

    def test_a_valid_edit_saves_audits_and_redirects(self, admin_browser: Client, admin: Any) -> None:
        AuditEntry.objects.all().delete()
        model = Model.objects.create(name="policy-model", task=Task.CHAT)
        assert admin_browser.get("/console/cache/policies/policy-model/").status_code == 200
        response = admin_browser.post("/console/cache/policies/policy-model/",
                                      {**self.VALID, "shared_scope": "on", "wrong_hit_budget": "0.5"})  # fmt: skip
        assert response.status_code == 302
        assert response["Location"] == "/console/cache/policies/?q=policy-model"
        policy = CachePolicy.objects.get(model=model)
        assert (policy.enabled, policy.max_temperature, policy.max_prompt_tokens, policy.ttl_seconds,
                policy.shared_scope) == (True, Decimal("0.30"), 1500, 600, True)  # fmt: skip
        assert policy.wrong_hit_budget == Decimal("0.5")
        audit = AuditEntry.objects.get(action="cache_policy.set")
        assert (audit.actor_id, audit.target, audit.before) == (admin.pk, "policy-model", None)
        assert audit.after == {"enabled": True, "max_temperature": "0.30", "max_prompt_tokens": 1500,
                               "ttl_seconds": 600, "shared_scope": True, "wrong_hit_budget": "0.50",
                               "paraphrases": False}  # fmt: skip
        assert [str(m) for m in get_messages(response.wsgi_request)] == [
            "Saved the cache policy of policy-model; gateways apply it at once."
        ]
        # Unticked boxes switch it off; the audit keeps before and after.
        admin_browser.post("/console/cache/policies/policy-model/", {**self.VALID, "enabled": ""})
        second = AuditEntry.objects.filter(action="cache_policy.set").order_by("-pk").first()
        assert second is not None
        assert second.before is not None
        assert second.after is not None
        assert (second.before["enabled"], second.after["enabled"], second.after["shared_scope"]) == (True, False, False)

    @pytest.mark.parametrize(
        ("field", "value", "message"),
        [
            ("max_temperature", "2.5", "less than or equal to 2"),
            ("max_temperature", "0.123", "no more than 2 decimal places"),
            ("max_prompt_tokens", "0", "greater than or equal to 1"),
            ("ttl_seconds", "abc", "Enter a whole number"),
            ("ttl_seconds", "", "This field is required"),
            ("wrong_hit_budget", "101", "less than or equal to 100"),
            ("wrong_hit_budget", "-1", "greater than or equal to 0"),
        ],
    )
    def test_invalid_values_are_field_errors(self, admin_browser: Client, field: str, value: str, message: str) -> None:
        model = Model.objects.create(name="strict-model", task=Task.CHAT)
        response = admin_browser.post("/console/cache/policies/strict-model/", {**self.VALID, field: value})
        assert response.status_code == 400
        assert message in " ".join(response.context["form"].errors[field])
        assert not CachePolicy.objects.filter(model=model).exists()
        assert not AuditEntry.objects.filter(action="cache_policy.set", target="strict-model").exists()

    def test_an_unknown_model_is_404(self, admin_browser: Client) -> None:
        assert admin_browser.get("/console/cache/policies/nope/").status_code == 404

    def test_the_service_refuses_out_of_range_values(self) -> None:
        model = Model.objects.create(name="service-model", task=Task.CHAT)
        with pytest.raises(InvalidInput) as caught:
            cache_policy_set(model=model, enabled=True, max_temperature="3", max_prompt_tokens=1, ttl_seconds=1,
                             shared_scope=False)  # fmt: skip
        assert caught.value.field == "max_temperature"
        with pytest.raises(InvalidInput) as caught:
            cache_policy_set(model=model, enabled=True, max_temperature="0.5", max_prompt_tokens=1, ttl_seconds=0,
                             shared_scope=False)  # fmt: skip
        assert caught.value.field == "ttl_seconds"

    def test_an_unchanged_save_is_not_audited_again(self) -> None:
        model = Model.objects.create(name="same-model", task=Task.CHAT)
        for _ in range(2):
            cache_policy_set(model=model, enabled=True, max_temperature="0.5", max_prompt_tokens=10, ttl_seconds=60,
                             shared_scope=False)  # fmt: skip
        assert AuditEntry.objects.filter(action="cache_policy.set", target="same-model").count() == 1


class TestWrongHits:
    """Issue 22: per model, hits, the wrong-hit estimate with its interval, reports, the tiers
    served; a platform admin reports a wrong answer by its request id."""

    def test_each_model_shows_its_estimate_and_the_tiers_it_serves(self, admin_browser: Client, org) -> None:
        import uuid

        from serving.semcache import budget

        model = f"quality-{uuid.uuid4().hex[:6]}"
        entry(model=model, organization=org)
        budget.count_sync(model, "same", "served", 40)
        budget.count_sync(model, budget.EXACT, "served", 7)
        budget.count_sync(model, "typo", "audits", 100)
        budget.count_sync(model, "typo", "disagreed", 9)  # the typo tier is outside a 1 % budget
        try:
            html = admin_browser.get("/console/cache/").content.decode()
        finally:
            budget.reset(model)
        row = re.search(rf'<tr data-model="{model}">(.*?)</tr>', html, re.S)
        assert row, html
        cells = dict(re.findall(r'data-col="([a-z]+)">(.*?)</td>', row.group(1), re.S))
        assert (cells["exact"], cells["semantic"], cells["audits"]) == ("7", "40", "100 (9)")
        assert cells["budget"] == "1.00 %"
        assert cells["tiers"] == "same, reordered"  # typo closed by its disagreements; paraphrases off by default
        assert re.fullmatch(r"[\d.]+ % <span class=\"muted small\">\[[\d.]+ % to [\d.]+ %\]</span>", cells["estimate"])

    def test_an_admin_reports_a_wrong_answer(self, admin_browser: Client, org) -> None:
        import asyncio
        import uuid

        from serving.models import CacheFeedback
        from serving.semcache import budget, feedback

        model = f"reported-{uuid.uuid4().hex[:6]}"
        served = entry(model=model, organization=org)
        request_id = uuid.uuid4()
        asyncio.run(feedback.note_served(request_id, feedback.Served(
            organization_id=org.pk, model=model, model_version="1", entry_id=served.pk, wording="typo",
            scope=served.scope,
        )))  # fmt: skip
        try:
            response = admin_browser.post("/console/cache/feedback/",
                                          {"request_id": f"chatcmpl-{request_id.hex}", "reason": "wrong"})  # fmt: skip
            assert response.status_code == 302
            assert "Recorded" in " ".join(str(m) for m in get_messages(response.wsgi_request))
            assert CacheFeedback.objects.get(request_id=request_id.hex).reported_by == "cache-admin"
            served.refresh_from_db()
            assert served.strictness == 1
            unknown = admin_browser.post("/console/cache/feedback/", {"request_id": str(uuid.uuid4())})
            assert "No answer from the cache" in " ".join(str(m) for m in get_messages(unknown.wsgi_request))
        finally:
            budget.reset(model)


class TestTiers:
    """Issue 39: per model and tier, the window's hits and their share, the audits' observed wrong
    rate with its interval beside the estimate, serving or closed against δ."""

    MISS, HIT, SEMANTIC = "miss", "hit", "semantic-hit"

    def test_the_selector_counts_requests_and_hits_by_tier(self, key: ApiKey) -> None:
        other = api_key_create(organization=organization_create(name="Other Tier Org"), name="other").api_key
        now = timezone.now()
        requests(key, "tiers-a", {
            (self.MISS, ""): 10, (self.HIT, ""): 3, (self.HIT, "exact"): 2, (self.SEMANTIC, "same"): 4,
            (self.SEMANTIC, ""): 1, (self.SEMANTIC, "paraphrase"): 5,
        }, at=now - timedelta(hours=1))  # fmt: skip
        requests(key, "tiers-a", {(self.SEMANTIC, "paraphrase"): 7}, at=now - timedelta(days=2))  # before the window
        requests(other, "tiers-a", {(self.MISS, ""): 1, (self.SEMANTIC, "typo"): 2}, at=now - timedelta(hours=1))
        requests(key, "tiers-b", {(self.MISS, ""): 2}, at=now - timedelta(hours=1))
        since = now - timedelta(days=1)
        every = cache_hits_by_tier(since=since, until=now, models=["tiers-a", "tiers-b"])
        assert every == {
            "tiers-a": TierHits("tiers-a", 28, {"exact": 5, "same": 4, "words": 1, "paraphrase": 5, "typo": 2}),
            "tiers-b": TierHits("tiers-b", 2, {}),
        }
        own = cache_hits_by_tier(since=since, until=now, organization_id=key.organization_id, models=["tiers-a"])
        assert own == {"tiers-a": TierHits("tiers-a", 25, {"exact": 5, "same": 4, "words": 1, "paraphrase": 5})}
        assert own["tiers-a"].share("paraphrase") == 0.2

    def test_the_page_shows_each_tiers_share_observed_rate_state_and_bound(
        self, admin_browser: Client, key, settings
    ) -> None:
        import uuid

        settings.SEMANTIC_CACHE_PARAPHRASES = True  # off by default
        settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_SERVED, settings.SEMANTIC_CACHE_PARAPHRASE_PRIOR_WRONG = 600, 1
        from serving.semcache import budget

        model = f"tiers-{uuid.uuid4().hex[:6]}"
        requests(key, model, {(self.MISS, ""): 30, (self.HIT, "exact"): 2, (self.SEMANTIC, "same"): 3,
                              (self.SEMANTIC, "paraphrase"): 5}, at=timezone.now() - timedelta(hours=1))  # fmt: skip
        entry(model=model, evidence=[[0.91, 1], [0.82, 0]])  # raised by a mismatch
        entry(model=model, evidence=[[0.95, 1]])
        entry(model=model, evidence=[[0.7, 0]], expired=True)  # no longer served
        budget.count_sync(model, budget.PARAPHRASE, "audits", 50)
        budget.count_sync(model, budget.PARAPHRASE, "disagreed", 3)
        budget.count_sync(model, budget.PARAPHRASE, "reported", 1)
        try:
            html = admin_browser.get("/console/cache/").content.decode()
        finally:
            budget.reset(model)
        assert "Error bound δ" in html
        assert re.search(rf'<tr data-model="{model}">.*?data-col="budget">1.00 %</td>', html, re.S)
        tiers = re.search(rf'<tr class="quality-tiers" data-tiers-of="{model}">(.*?)</details>', html, re.S)
        assert tiers, html
        cells = {
            tier: dict(re.findall(r'data-col="([a-z]+)"[^>]*>(.*?)</td>', row, re.S))
            for tier, row in re.findall(r'<tr data-tier="([a-z]+)">(.*?)</tr>', tiers.group(1), re.S)
        }
        assert list(cells) == ["exact", "same", "typo", "reordered", "paraphrase"]
        assert "Paraphrases (learned verifier)" in tiers.group(1)
        paraphrase = cells["paraphrase"]
        assert (paraphrase["hits"], paraphrase["share"], paraphrase["audits"], paraphrase["reported"]) == (
            "5", "12.5 %", "50 (3)", "1")  # fmt: skip
        low, high = wilson(4, 51)  # 3 disagreed and 1 reported, of 50 audits and 1 report
        assert paraphrase["observed"] == f"7.84 % [{low * 100:.2f} % to {high * 100:.1f} %]"
        # With the prior (600 judged offline, 1 wrong) the estimate's upper end still passes 1 %: closed.
        prior_low, prior_high = wilson(1 + 4, 600 + 51)
        assert prior_high > 0.01
        assert paraphrase["estimate"] == f"0.77 % [{prior_low * 100:.2f} % to {prior_high * 100:.2f} %]"
        assert "closed: outside δ" in paraphrase["state"]
        assert "serving" in cells["same"]["state"]
        assert cells["same"]["observed"] == "no audits yet"
        assert (cells["same"]["hits"], cells["same"]["share"]) == ("3", "7.50 %")
        assert "always served" in cells["exact"]["state"]
        assert cells["exact"]["audits"] == "—"
        assert re.search(r'data-col="raised">.*?<strong>1</strong>', tiers.group(1), re.S)

    def test_a_model_whose_policy_turns_paraphrases_off_says_so(self, admin_browser: Client) -> None:
        model = Model.objects.create(name="no-paraphrases", task=Task.CHAT)
        CachePolicy.objects.create(model=model, paraphrases=False)
        entry(model=model.name)
        html = admin_browser.get("/console/cache/").content.decode()
        row = re.search(r'<tr data-model="no-paraphrases">.*?data-col="tiers">(.*?)</td>', html, re.S)
        assert row
        assert row.group(1) == "same, typo, reordered"
        tiers = re.search(r'data-tiers-of="no-paraphrases">(.*?)</details>', html, re.S)
        assert tiers
        state = re.search(r'<tr data-tier="paraphrase">.*?data-col="state">(.*?)</td>', tiers.group(1), re.S)
        assert state
        assert "off (the model&#x27;s policy)" in state.group(1)

    def test_the_count_of_raised_entries_is_capped_and_says_so(self) -> None:
        from serving.semcache.selectors import RaisedEntries, entries_raised_by_mismatch

        for evidence in ([[0.9, 0]], [[0.8, 0]], [[0.85, 0]], [[0.99, 1]]):
            entry(model="raised-cap", evidence=evidence)
        assert entries_raised_by_mismatch(models=["raised-cap", "nothing-stored"]) == {
            "raised-cap": RaisedEntries(raised=3, scanned=4, capped=False),
            "nothing-stored": RaisedEntries(raised=0, scanned=0, capped=False),
        }
        capped = entries_raised_by_mismatch(models=["raised-cap"], cap=2)["raised-cap"]
        assert (capped.scanned, capped.capped) == (2, True)
        assert capped.raised <= 2
