"""The semantic cache's store on the real PostgreSQL + pgvector: one scope only, never an
expired entry, nearest first, both plans agree; expiry in batches; purges (service, command,
API roles); a slow or absent database is a quick miss, never a hang."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from io import StringIO
from typing import Any

import numpy as np
import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import OperationalError, connection, connections, transaction
from django.db.backends.postgresql.base import DatabaseWrapper
from django.utils import timezone

from accounts.models import Role
from accounts.services import membership_set, organization_create, platform_organization
from core.db import run_db
from core.errors import InvalidInput
from serving.models import EMBEDDING_DIMENSIONS, CacheEntry
from serving.semcache import signature, store
from serving.semcache.services import cache_purge
from serving.semcache.store import CacheUnavailable, SearchTuning
from tests.support.api import client_for

PLANS = ["exact", "hnsw"]


def unit(vector: np.ndarray) -> list[float]:
    return [float(v) for v in vector / np.linalg.norm(vector)]


def random_vectors(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, EMBEDDING_DIMENSIONS))


def new_scope() -> str:
    return uuid.uuid4().hex + uuid.uuid4().hex


class Entries:
    """Writes cache entries under a model name of this test's own, and deletes them all
    afterwards. Called from an async test, it writes from a thread of its own (the ORM is
    synchronous); outside a test transaction, the writes are committed at once."""

    def __init__(self) -> None:
        self.model = f"semcache-test-{uuid.uuid4().hex[:8]}"
        self.thread = ThreadPoolExecutor(max_workers=1)

    def add(self, scope: str, embedding: list[float], *, expires_in: float = 3600, **fields: Any) -> CacheEntry:
        values: dict[str, Any] = {
            "model": self.model, "model_version": "1", "prompt": "What is the capital of France?",
            "response": {"message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"},
            "prompt_tokens": 7, "completion_tokens": 2, **fields,
        }  # fmt: skip
        expires_at = timezone.now() + timedelta(seconds=expires_in)

        def create() -> CacheEntry:
            return CacheEntry.objects.create(scope=scope, embedding=embedding, expires_at=expires_at, **values)

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return create()
        return self.thread.submit(create).result()

    def remove(self) -> None:
        self.thread.submit(connections.close_all).result()
        self.thread.shutdown()
        CacheEntry.objects.filter(model__startswith=self.model).delete()


@pytest.fixture
def entries(django_db_setup: None, django_db_blocker: Any) -> Iterator[Entries]:
    """Outside any test transaction: what the test writes is committed at once."""
    with django_db_blocker.unblock():
        store.guard.reopen()
        made = Entries()
        try:
            yield made
        finally:
            wait_for_abandoned_calls()
            store.guard.reopen()
            made.remove()


def wait_for_abandoned_calls(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while store.guard.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.guard.in_flight == 0


def ids(candidates: list[store.Candidate]) -> list[int]:
    return [c.entry_id for c in candidates]


# --- Search ---------------------------------------------------------------------------------


class TestSearch:
    @pytest.mark.parametrize("plan", PLANS)
    async def test_it_never_returns_another_scopes_entry(self, entries, plan):
        ours, theirs, empty = new_scope(), new_scope(), new_scope()
        vectors = [unit(v) for v in random_vectors(5, seed=1)]
        mine = [entries.add(ours, v).pk for v in vectors]
        for v in vectors:  # the very same vectors, in another scope (another tenant, version, …)
            entries.add(theirs, v)
        for v in vectors:
            found = await store.search(scope=ours, embedding=v, limit=10, plan=plan)
            assert set(ids(found)) == set(mine)
            assert found[0].similarity == pytest.approx(1.0, abs=1e-5)
        assert await store.search(scope=empty, embedding=vectors[0], plan=plan) == []

    @pytest.mark.parametrize("plan", PLANS)
    async def test_it_finds_the_scopes_entry_past_many_nearer_ones_of_other_scopes(self, entries, plan):
        """The filtered index scan must go on past ef_search rows of other scopes."""
        ours, crowd = new_scope(), new_scope()
        query = random_vectors(1, seed=2)[0]
        noise = random_vectors(300, seed=3)
        for row in noise:
            entries.add(crowd, unit(query + 0.05 * row))  # all nearer to the query than ours
        far = entries.add(ours, unit(query + 1.0 * random_vectors(1, seed=4)[0]))
        found = await store.search(scope=ours, embedding=unit(query), plan=plan)
        assert ids(found) == [far.pk]

    @pytest.mark.parametrize("plan", PLANS)
    async def test_expired_entries_are_never_returned(self, entries, plan):
        scope = new_scope()
        vector = unit(random_vectors(1, seed=5)[0])
        entries.add(scope, vector, expires_in=-1)
        live = entries.add(scope, vector, expires_in=60)
        assert ids(await store.search(scope=scope, embedding=vector, plan=plan)) == [live.pk]

    @pytest.mark.parametrize("plan", PLANS)
    async def test_nearest_first_with_cosine_similarity(self, entries, plan):
        scope = new_scope()
        query, other = random_vectors(2, seed=6)
        query, other = query / np.linalg.norm(query), other / np.linalg.norm(other)
        made = []
        for weight in (0.9, 0.1, 0.5, 0.3, 0.7):  # stored out of order
            vector = unit(query + weight * other)
            made.append((float(np.dot(vector, query)), entries.add(scope, vector).pk))
        expected = sorted(made, reverse=True)
        found = await store.search(scope=scope, embedding=unit(query), limit=3, plan=plan)
        assert ids(found) == [pk for _, pk in expected[:3]]
        assert [c.similarity for c in found] == pytest.approx([s for s, _ in expected[:3]], abs=1e-5)
        assert found[0].response == {"message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}
        assert (found[0].prompt, found[0].prompt_tokens, found[0].completion_tokens) == (
            "What is the capital of France?", 7, 2,
        )  # fmt: skip

    async def test_exact_and_hnsw_agree_on_small_data(self, entries):
        scope, other = new_scope(), new_scope()
        centroids = random_vectors(10, seed=7)
        rng = np.random.default_rng(8)
        for i in range(300):
            entries.add(scope, unit(centroids[i % 10] + 0.6 * rng.standard_normal(EMBEDDING_DIMENSIONS)))
            entries.add(other, unit(centroids[i % 10] + 0.6 * rng.standard_normal(EMBEDDING_DIMENSIONS)))
        for i in range(20):
            query = unit(centroids[i % 10] + 0.6 * rng.standard_normal(EMBEDDING_DIMENSIONS))
            exact = await store.search(scope=scope, embedding=query, plan="exact")
            hnsw = await store.search(scope=scope, embedding=query, plan="hnsw")
            assert ids(hnsw) == ids(exact)
            assert [c.similarity for c in hnsw] == pytest.approx([c.similarity for c in exact], abs=1e-6)

    def test_each_plan_runs_as_intended(self, entries):
        """The HNSW plan really uses the index, the exact one never does, whatever the
        statistics say; and their SET LOCAL lines end with the statement."""
        scope = new_scope()
        entries.add(scope, unit(random_vectors(1, seed=9)[0]))
        tuning = SearchTuning.from_settings()
        query = store.vector_literal(unit(random_vectors(1, seed=10)[0]))
        params = {"scope": scope, "bucket": f"{scope[0]}%", "query": query, "limit": 4}
        plans = {}
        for plan in PLANS:
            with connection.cursor() as cursor:
                cursor.execute(tuning.statement(plan, explain="EXPLAIN"), params)
                while cursor.description is None and cursor.nextset():
                    pass
                plans[plan] = "\n".join(row[0] for row in cursor.fetchall())
                cursor.execute("SHOW statement_timeout")
                assert cursor.fetchone()[0] == "0"  # nothing left behind on the connection
        assert f"Index Scan using cache_embedding_hnsw_{scope[0]} " in plans["hnsw"]
        assert "Index Only Scan using cache_scope_vectors" in plans["exact"]
        assert "cache_embedding_hnsw" not in plans["exact"]

    async def test_the_scope_size_picks_the_plan(self, entries, settings):
        settings.SEMANTIC_CACHE_EXACT_MAX_ENTRIES = 3
        small, large = new_scope(), new_scope()
        for v in random_vectors(3, seed=11):
            entries.add(small, unit(v))
        for v in random_vectors(4, seed=12):
            entries.add(large, unit(v))
        assert await run_db(store.scope_sizes_refresh) >= 2
        assert await store.scope_size(small) == 3
        assert await store.scope_size(large) == 4
        assert await store.scope_size(new_scope()) == 0
        assert store.plan_for(3) == "exact"
        assert store.plan_for(4) == "hnsw"
        assert store.plan_for(None) == "hnsw"  # Redis cannot say: the plan whose cost is bounded

    async def test_a_malformed_embedding_is_refused(self, entries):
        with pytest.raises(ValueError, match="384"):
            await store.search(scope=new_scope(), embedding=[0.1] * 10)
        with pytest.raises(ValueError, match="finite"):
            await store.search(scope=new_scope(), embedding=[float("nan")] * EMBEDDING_DIMENSIONS)


class TestFind:
    """The request path's lookup by signature (serving.semcache.signature)."""

    def add(self, entries: Entries, scope: str, prompt: str, **fields: Any) -> CacheEntry:
        return entries.add(scope, unit(random_vectors(1, seed=len(prompt))[0]), prompt=prompt,
                           signatures=signature.of_entry(scope, prompt), **fields)  # fmt: skip

    async def find(self, scope: str, prompt: str) -> list[store.Stored]:
        return await store.find(scope=scope, prompt=prompt, signatures=signature.of_query(scope, prompt),
                                bag=signature.bag_of(scope, prompt))  # fmt: skip

    async def test_it_finds_by_shared_signature_in_the_scope_only(self, entries):
        ours, theirs = new_scope(), new_scope()
        mine = self.add(entries, ours, "How do I reset my password?")
        self.add(entries, theirs, "How do I reset my password?")
        self.add(entries, ours, "How do I reset my username?")
        found = await self.find(ours, "how do I reset my pasword")  # a typo of ours
        assert [f.entry_id for f in found] == [mine.pk]
        assert found[0].embedding == pytest.approx(list(mine.embedding), abs=1e-6)
        assert not found[0].same_bag
        assert await self.find(new_scope(), "How do I reset my password?") == []
        assert await self.find(ours, "How do I delete my account?") == []

    async def test_the_same_text_first_then_the_same_words_never_expired(self, entries):
        scope = new_scope()
        typo = self.add(entries, scope, "How do I reset my pasword?")
        same = self.add(entries, scope, "How do I reset my password?")
        words = self.add(entries, scope, "how do i reset my password")
        self.add(entries, scope, "How do I reset my password?", expires_in=-1)
        found = await self.find(scope, "How do I reset my password?")
        assert [f.entry_id for f in found] == [same.pk, words.pk, typo.pk]
        assert [f.same_bag for f in found] == [True, True, False]

    async def test_an_entry_without_signatures_is_never_found(self, entries):
        scope = new_scope()
        entries.add(scope, unit(random_vectors(1, seed=20)[0]), prompt="Why is the sky blue?")
        assert await self.find(scope, "Why is the sky blue?") == []

    def test_the_lookup_uses_the_signature_index(self, entries):
        scope = new_scope()
        self.add(entries, scope, "Why is the sky blue?")
        with connection.cursor() as cursor:
            cursor.execute("SET enable_seqscan = off")
            cursor.execute(f"EXPLAIN {store.FIND_SQL}", {"scope": scope, "prompt": "x", "signatures": [1, 2],
                                                        "bag": [1], "limit": 8})  # fmt: skip
            plan = "\n".join(row[0] for row in cursor.fetchall())
            cursor.execute("RESET enable_seqscan")
        assert "cache_signatures" in plan


# --- Writes on the request's behalf -----------------------------------------------------------


class TestInsertAndHits:
    async def test_an_inserted_answer_is_found_and_counted(self, entries):
        scope = new_scope()
        vector = unit(random_vectors(1, seed=13)[0])
        before = await store.scope_size(scope)
        entry_id = await store.insert(
            scope=scope, organization_id=None, model=entries.model, model_version="7", embedding=vector,
            prompt="Why is the sky blue?", response={"message": {"role": "assistant", "content": "Rayleigh."}},
            prompt_tokens=6, completion_tokens=3, expires_at=timezone.now() + timedelta(minutes=5),
        )  # fmt: skip
        assert await store.scope_size(scope) == before + 1
        [found] = await store.search(scope=scope, embedding=vector)
        assert found.entry_id == entry_id
        assert found.response == {"message": {"role": "assistant", "content": "Rayleigh."}}

        await store.record_hit(entry_id=entry_id)
        await store.record_hit(entry_id=entry_id)
        entry = await run_db(CacheEntry.objects.get, pk=entry_id)
        assert entry.hit_count == 2
        assert entry.last_hit_at is not None

    async def test_recording_a_hit_on_a_purged_entry_is_harmless(self, entries):
        await store.record_hit(entry_id=2**62)


# --- Expiry ----------------------------------------------------------------------------------


class TestPurgeExpired:
    def test_it_deletes_expired_entries_in_batches(self, entries):
        # Expired entries of earlier tests (some committed by gateway processes) go first, so
        # that the batches below are all ours.
        store.purge_expired(batch_size=10_000, max_batches=1000)
        scope = new_scope()
        vectors = [unit(v) for v in random_vectors(30, seed=14)]
        for v in vectors[:25]:
            entries.add(scope, v, expires_in=-60)
        live = {entries.add(scope, v).pk for v in vectors[25:]}
        ours = CacheEntry.objects.filter(model=entries.model)
        assert store.purge_expired(batch_size=10, max_batches=2) == 20  # two batches, then it stops
        assert ours.count() == 10
        store.purge_expired(batch_size=10)
        assert set(ours.values_list("pk", flat=True)) == live
        assert store.purge_expired(batch_size=10) == 0

    def test_its_clock_can_be_given(self, entries):
        scope = new_scope()
        entry = entries.add(scope, unit(random_vectors(1, seed=15)[0]), expires_in=3600)
        store.purge_expired(now=timezone.now() + timedelta(minutes=30))
        assert CacheEntry.objects.filter(pk=entry.pk).exists()
        store.purge_expired(now=timezone.now() + timedelta(hours=2))
        assert not CacheEntry.objects.filter(pk=entry.pk).exists()

    def test_the_beat_task_purges_and_recounts(self, entries):
        from serving.tasks import cache_purge_expired

        scope = new_scope()
        for v in random_vectors(3, seed=16):
            entries.add(scope, unit(v), expires_in=-1)
        cache_purge_expired()
        assert not CacheEntry.objects.filter(scope=scope).exists()
        assert asyncio.run(store.scope_size(scope)) == 0


# --- Purges by operators -------------------------------------------------------------------------


@pytest.fixture
def cached(db: None) -> dict[str, Any]:
    """Entries of two models, two versions each, stored by two organisations (in the test's transaction)."""
    alice = organization_create(name="Alice Corp")
    bob = organization_create(name="Bob Ltd")
    made = Entries()
    rows: dict[tuple[str, str, str], int] = {}
    vectors = iter(random_vectors(16, seed=17))
    for model in ("chat-a", "chat-b"):
        for version in ("1", "2"):
            for org in (alice, bob):
                for _ in range(2):
                    made.add(new_scope(), unit(next(vectors)), model=f"{made.model}-{model}", model_version=version,
                             organization=org)  # fmt: skip
                rows[(model, version, org.name)] = 2
    return {"prefix": made.model, "alice": alice, "bob": bob}


def remaining(cached: dict[str, Any]) -> set[tuple[str, str, str]]:
    entries = CacheEntry.objects.filter(model__startswith=cached["prefix"]).select_related("organization")
    return {(e.model.rsplit("-", 1)[1], e.model_version, e.organization.name) for e in entries}


ALL = {(m, v, o) for m in ("a", "b") for v in ("1", "2") for o in ("Alice Corp", "Bob Ltd")}


class TestCachePurge:
    def test_by_model(self, cached):
        assert cache_purge(model=f"{cached['prefix']}-chat-a") == 8
        assert remaining(cached) == {k for k in ALL if k[0] == "b"}

    def test_by_model_and_version(self, cached):
        assert cache_purge(model=f"{cached['prefix']}-chat-a", version="2") == 4
        assert remaining(cached) == ALL - {("a", "2", "Alice Corp"), ("a", "2", "Bob Ltd")}

    def test_by_organization(self, cached):
        assert cache_purge(organization=cached["bob"]) == 8
        assert remaining(cached) == {k for k in ALL if k[2] == "Alice Corp"}

    def test_by_everything_at_once(self, cached):
        assert cache_purge(model=f"{cached['prefix']}-chat-b", version="1", organization=cached["alice"].pk) == 2
        assert remaining(cached) == ALL - {("b", "1", "Alice Corp")}

    def test_in_batches(self, cached):
        assert cache_purge(organization=cached["alice"], batch_size=3) == 8
        assert remaining(cached) == {k for k in ALL if k[2] == "Bob Ltd"}

    def test_without_a_filter_it_refuses(self, cached):
        with pytest.raises(InvalidInput):
            cache_purge()
        with pytest.raises(InvalidInput):
            cache_purge(model=" ")
        assert remaining(cached) == ALL


class TestPurgeCommand:
    def test_it_prints_how_many(self, cached):
        out = StringIO()
        call_command("purge_cache", "--model", f"{cached['prefix']}-chat-a", "--version", "1", stdout=out)
        assert out.getvalue().strip() == "Purged 4 cache entries."
        call_command("purge_cache", "--org", "Bob Ltd", stdout=out)
        assert out.getvalue().splitlines()[-1] == "Purged 6 cache entries."
        assert remaining(cached) == {("a", "2", "Alice Corp"), ("b", "1", "Alice Corp"), ("b", "2", "Alice Corp")}

    def test_it_refuses_no_filter_and_unknown_organisations(self, cached):
        with pytest.raises(CommandError, match="at least one"):
            call_command("purge_cache", stdout=StringIO())
        with pytest.raises(CommandError, match="no organisation"):
            call_command("purge_cache", "--org", "Nobody Inc", stdout=StringIO())
        assert remaining(cached) == ALL


@pytest.fixture
def people(cached: dict[str, Any]) -> dict[str, Any]:
    users = get_user_model().objects
    ml, alice = (users.create_user(username=name, password="pw-1234567890") for name in ("ml", "alice"))
    membership_set(user=ml, organization=platform_organization(), role=Role.PLATFORM_ADMIN)
    membership_set(user=alice, organization=cached["alice"], role=Role.ORG_ADMIN)
    return {"ml": ml, "alice": alice, "anonymous": None}


class TestCacheApi:
    def test_a_platform_admin_purges(self, cached, people):
        client = client_for(people["ml"])
        response = client.post("/api/cache/purge/", {"model": f"{cached['prefix']}-chat-b"}, format="json")
        assert response.status_code == 200
        assert response.json() == {"purged": 8}
        response = client.post("/api/cache/purge/", {"organization": cached["bob"].pk}, format="json")
        assert response.json() == {"purged": 4}
        assert remaining(cached) == {("a", "1", "Alice Corp"), ("a", "2", "Alice Corp")}

    @pytest.mark.parametrize("who", ["alice", "anonymous"])
    def test_nobody_else_may(self, cached, people, who):
        client = client_for(people[who])
        response = client.post("/api/cache/purge/", {"organization": cached["alice"].pk}, format="json")
        assert response.status_code in (401, 403)
        assert client.get("/api/cache/stats/").status_code in (401, 403)
        assert remaining(cached) == ALL

    @pytest.mark.parametrize(
        ("body", "field"),
        [({}, "non_field_errors"), ({"organization": 0}, "organization"), ({"model": ""}, "model")],
    )
    def test_bad_filters_are_a_400_naming_the_field(self, cached, people, body, field):
        response = client_for(people["ml"]).post("/api/cache/purge/", body, format="json")
        assert response.status_code == 400
        assert field in response.json()
        assert remaining(cached) == ALL

    def test_stats_count_entries_per_model_and_version(self, cached, people):
        CacheEntry.objects.filter(model=f"{cached['prefix']}-chat-a", model_version="1").update(
            expires_at=timezone.now() - timedelta(seconds=1), hit_count=3
        )
        body = client_for(people["ml"]).get("/api/cache/stats/").json()
        ours = {(r["model"], r["version"]): r for r in body["models"] if r["model"].startswith(cached["prefix"])}
        assert ours[(f"{cached['prefix']}-chat-a", "1")] == {
            "model": f"{cached['prefix']}-chat-a", "version": "1", "entries": 0, "expired": 4, "hits": 12,
        }  # fmt: skip
        assert ours[(f"{cached['prefix']}-chat-b", "2")]["entries"] == 4
        assert body["entries"] >= 12
        assert body["hnsw_index_bytes"] > 0
        assert body["index_bytes"] >= body["hnsw_index_bytes"]

    def test_the_endpoints_are_in_the_schema(self, people):
        schema = client_for(people["ml"]).get("/api/schema/", HTTP_ACCEPT="application/json").json()
        assert "post" in schema["paths"]["/api/cache/purge/"]
        assert "get" in schema["paths"]["/api/cache/stats/"]


# --- A failing database is a miss --------------------------------------------------------------


class TestFailures:
    async def test_a_locked_table_costs_a_search_its_timeout_then_none(self, entries, settings):
        settings.SEMANTIC_CACHE_SEARCH_TIMEOUT_MS = 200
        scope = new_scope()
        vector = unit(random_vectors(1, seed=18)[0])
        entries.add(scope, vector)
        locked, release = threading.Event(), threading.Event()

        def hold_lock() -> None:  # what a long migration or VACUUM FULL would do
            try:
                with transaction.atomic():
                    connection.cursor().execute(f"LOCK TABLE {store.TABLE} IN ACCESS EXCLUSIVE MODE")
                    locked.set()
                    release.wait(10)
            finally:
                connection.close()

        holder = threading.Thread(target=hold_lock)
        holder.start()
        try:
            assert locked.wait(5)
            began = time.monotonic()
            with pytest.raises(CacheUnavailable):
                await store.search(scope=scope, embedding=vector, plan="exact")
            assert time.monotonic() - began < 1.0
            began = time.monotonic()
            with pytest.raises(CacheUnavailable, match="failed recently"):
                await store.search(scope=scope, embedding=vector)
            assert time.monotonic() - began < 0.05  # refused without touching the database
        finally:
            release.set()
            holder.join()
        store.guard.reopen()
        assert ids(await store.search(scope=scope, embedding=vector)) != []

    async def test_an_unreachable_database_never_holds_a_search_or_many_threads(self, entries, settings, monkeypatch):
        settings.SEMANTIC_CACHE_SEARCH_TIMEOUT_MS = 100
        settings.SEMANTIC_CACHE_MAX_DB_CALLS = 2
        settings.SEMANTIC_CACHE_RETRY_AFTER = 0.0  # so that each call tries again

        def unreachable(self: Any, conn_params: Any) -> Any:
            time.sleep(1.5)  # a pool waiting for a connection it cannot open
            raise OperationalError("connection refused")

        monkeypatch.setattr(DatabaseWrapper, "get_new_connection", unreachable)
        vector = unit(random_vectors(1, seed=19)[0])
        for _ in range(2):
            began = time.monotonic()
            with pytest.raises(CacheUnavailable, match="did not answer"):
                await store.search(scope=new_scope(), embedding=vector, plan="exact")
            assert time.monotonic() - began < 0.6
        # Two worker threads are still waiting on the database: the next calls are refused at once.
        began = time.monotonic()
        with pytest.raises(CacheUnavailable, match="in flight"):
            await store.search(scope=new_scope(), embedding=vector, plan="exact")
        await store.record_hit(entry_id=1)  # best effort: no exception
        with pytest.raises(CacheUnavailable):
            await store.insert(
                scope=new_scope(), organization_id=None, model=entries.model, model_version="1", embedding=vector,
                prompt="p", response={}, prompt_tokens=1, completion_tokens=1, expires_at=timezone.now(),
            )  # fmt: skip
        assert time.monotonic() - began < 0.05
        monkeypatch.undo()
        wait_for_abandoned_calls()
