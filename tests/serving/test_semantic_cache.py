"""The semantic cache through real gateways, PostgreSQL + pgvector and Redis.

Fake engines answer chat and embed text (tests/support/fake_engine.py: its embeddings are hashed
bags of words, so texts sharing most words are very similar); the chat model uses the
bundled SmolLM2's tokenizer, so prompts are counted exactly as the cache requires.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from tests.support.gateway import committed, persisted, price_model, register_fake_replica, start_fake_engine
from tests.support.processes import Gateway, start_gateway

pytestmark = pytest.mark.django_db

QUESTION = "How do I reset my online banking password?"


@dataclass
class World:
    gateway: Gateway
    chat_model: str
    chat_endpoint: str
    embedder: str
    embed_endpoint: str
    artifact_uri: str  # the bundled SmolLM2's: its tokenizer counts the fake chat model's prompts


@pytest.fixture(scope="module")
def world(bundled_models, django_db_blocker, tmp_path_factory) -> Iterator[World]:
    chat_process, chat_endpoint = start_fake_engine()
    embed_process, embed_endpoint = start_fake_engine()
    suffix = uuid.uuid4().hex[:6]
    chat, embedder = f"cached-chat-{suffix}", f"cache-embedder-{suffix}"
    smollm2 = bundled_models["versions"]["smollm2-135m-instruct"].artifact_uri

    def register() -> None:
        register_fake_replica(chat, chat_endpoint, artifact_uri=smollm2)
        register_fake_replica(embedder, embed_endpoint, task="embedding")
        price_model(chat, input_per_million="10", output_per_million="30", cached_input_per_million="1")

    committed(django_db_blocker, register)
    gateway = start_gateway(
        tmp_path_factory.mktemp("cache-gateway"),
        SEMANTIC_CACHE_EMBEDDING_MODEL=embedder,
        REPLICA_STALE_AFTER="86400",
        ROUTING_REFRESH_SECONDS="0.2",
    )
    yield World(gateway, chat, chat_endpoint, embedder, embed_endpoint, smollm2)
    gateway.stop()
    for process in (chat_process, embed_process):
        process.kill()


def ask(world: World, key, question: str = QUESTION, *, headers: dict[str, str] | None = None, **body: Any):
    messages = body.pop("messages", [{"role": "user", "content": question}])
    return httpx.post(
        f"{world.gateway.base_url}/v1/chat/completions", timeout=30,
        json={"model": world.chat_model, "messages": messages, "temperature": 0, "max_tokens": 20, **body},
        headers={"Authorization": f"Bearer {key.secret}", **(headers or {})},
    )  # fmt: skip


def engine_requests(world: World) -> int:
    return int(httpx.get(f"{world.chat_endpoint}/_stats", timeout=5).json()["requests"])


def stored(world: World, key, question: str = QUESTION, **body: Any) -> tuple[httpx.Response, httpx.Response]:
    """Ask once (a miss, answered by the engine), then until the answer comes from the
    cache; returns both answers."""
    first = ask(world, key, question, **body)
    assert first.status_code == 200, first.text
    assert first.headers["x-cache"] == "miss"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        again = ask(world, key, question, **body)
        if again.headers["x-cache"] != "miss":
            return first, again
        time.sleep(0.1)
    raise AssertionError("the answer was not stored in the cache")


class TestHits:
    def test_the_same_question_is_replayed_and_metered_once_as_cached(self, world, make_api_key):
        key = make_api_key(rate_limit_rpm=10_000)
        first, hit = stored(world, key)
        before = engine_requests(world)
        assert ask(world, key).headers["x-cache"] == "hit"
        assert engine_requests(world) == before  # the engine is not asked again
        assert hit.headers["x-cache"] == "hit"
        assert hit.headers["x-cache-similarity"] == "1.0000"
        ours, theirs = hit.json(), first.json()
        assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"]
        assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
        assert ours["id"] != theirs["id"]
        assert ours["id"] == f"chatcmpl-{uuid.UUID(hit.headers['x-request-id']).hex}"
        usage = ours["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": usage["prompt_tokens"]}
        assert usage["completion_tokens"] == theirs["usage"]["completion_tokens"]
        record = persisted([hit.headers["x-request-id"]])[hit.headers["x-request-id"]]
        assert (record.cache, record.status_code) == ("hit", 200)
        assert record.cached_tokens == record.prompt_tokens == usage["prompt_tokens"]
        # Priced whole at the cached input price: 1 per million here.
        assert record.cost == Decimal(record.prompt_tokens + record.completion_tokens) / 1_000_000

    def test_a_near_repeat_is_a_verified_semantic_hit(self, world, make_api_key):
        key = make_api_key(rate_limit_rpm=10_000)
        stored(world, key, "What is the capital of Australia?")
        again = ask(world, key, "what is the capital of australia")
        assert again.headers["x-cache"] == "semantic-hit"
        assert 0.9 <= float(again.headers["x-cache-similarity"]) <= 1

    def test_a_trap_is_never_served(self, world, make_api_key):
        key = make_api_key(rate_limit_rpm=10_000)
        # 13 of 14 words shared: similar enough to be a candidate; only the verifier stops it.
        stored(world, key, "Is it safe to take ibuprofen with a cup of black coffee in the morning?")
        trap = ask(world, key, "Is it unsafe to take ibuprofen with a cup of black coffee in the morning?")
        assert trap.headers["x-cache"] == "miss"

    def test_a_hit_is_replayed_as_a_stream_like_a_live_answer(self, world, make_api_key):
        key = make_api_key(rate_limit_rpm=10_000)
        stored(world, key, "Name a primary colour.")
        with httpx.stream(
            "POST", f"{world.gateway.base_url}/v1/chat/completions", timeout=30,
            json={"model": world.chat_model, "messages": [{"role": "user", "content": "Name a primary colour."}],
                  "temperature": 0, "max_tokens": 20, "stream": True, "stream_options": {"include_usage": True}},
            headers={"Authorization": f"Bearer {key.secret}"},
        ) as response:  # fmt: skip
            assert response.headers["x-cache"] == "hit"
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert len({c["id"] for c in chunks}) == 1
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        whole = ask(world, key, "Name a primary colour.").json()["choices"][0]["message"]["content"]
        assert text == whole
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == chunks[-1]["usage"]["prompt_tokens"]

    def test_a_hit_is_replayed_over_the_websocket(self, world, make_api_key):
        key = make_api_key(rate_limit_rpm=10_000)
        stored(world, key, "Spell the word cat.")
        url = world.gateway.base_url.replace("http://", "ws://") + "/ws/v1/chat/completions"
        with connect(url, additional_headers={"Authorization": f"Bearer {key.secret}"}) as socket:
            body = {"model": world.chat_model, "messages": [{"role": "user", "content": "Spell the word cat."}],
                    "temperature": 0, "max_tokens": 20}  # fmt: skip
            socket.send(json.dumps({"type": "chat.completion", "id": "a", "body": body}))
            frames = []
            while not frames or frames[-1]["type"] != "usage":
                frames.append(json.loads(socket.recv(timeout=30)))
        assert frames[-1]["cache"] == "hit"
        assert frames[-1]["status"] == "completed"
        assert any(f["type"] == "chunk" for f in frames)
        record = persisted([frames[-1]["request_id"]])[frames[-1]["request_id"]]
        assert record.cache == "hit"


class TestScopes:
    """Never a hit across tenants, versions, system prompts or sampling parameters."""

    def test_another_tenant_never_sees_an_answer(self, world, make_api_key):
        alice, bob = make_api_key(rate_limit_rpm=10_000), make_api_key(rate_limit_rpm=10_000)
        stored(world, alice, "What time does the Louvre open?")
        assert ask(world, bob, "What time does the Louvre open?").headers["x-cache"] == "miss"

    @pytest.mark.parametrize(
        "change",
        [
            {"max_tokens": 21},
            {"top_p": 0.9},
            {"stop": ["\n"]},
            {
                "messages": [
                    {"role": "system", "content": "Answer in French."},
                    {"role": "user", "content": "Which river runs through Rome?"},
                ]
            },
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "Which river runs through Rome?"},
                ]
            },
        ],
    )
    def test_a_different_setting_or_conversation_is_another_scope(self, world, make_api_key, change):
        key = make_api_key(rate_limit_rpm=10_000)
        stored(world, key, "Which river runs through Rome?")
        assert ask(world, key, "Which river runs through Rome?", **change).headers["x-cache"] == "miss"

    def test_a_new_version_never_sees_an_older_versions_answers(self, world, make_api_key, django_db_blocker):
        from registry.models import Deployment

        key = make_api_key(rate_limit_rpm=10_000)
        stored(world, key, "What is the boiling point of water?")

        def second_version() -> None:
            Deployment.objects.filter(version__model__name=world.chat_model).update(traffic_weight=0)
            version = f"2-{uuid.uuid4().hex[:4]}"
            register_fake_replica(
                world.chat_model, world.chat_endpoint, version=version, artifact_uri=world.artifact_uri
            )

        committed(django_db_blocker, second_version)
        time.sleep(0.6)  # the gateway's routing table (refreshed every 0.2 s here)
        try:
            assert ask(world, key, "What is the boiling point of water?").headers["x-cache"] == "miss"
        finally:

            def back() -> None:
                deployments = Deployment.objects.filter(version__model__name=world.chat_model).order_by("pk")
                deployments.update(traffic_weight=0)
                deployments.filter(pk=deployments.first().pk).update(traffic_weight=100)

            committed(django_db_blocker, back)
            time.sleep(0.6)


class TestRules:
    def test_a_hot_or_default_temperature_never_uses_the_cache(self, world, make_api_key):
        key = make_api_key(rate_limit_rpm=10_000)
        for temperature in (0.7, None):
            body = {} if temperature is None else {"temperature": temperature}
            question = f"Tell me a joke about ducks ({temperature})."
            for _ in range(3):
                response = httpx.post(
                    f"{world.gateway.base_url}/v1/chat/completions", timeout=30,
                    json={"model": world.chat_model, "messages": [{"role": "user", "content": question}], **body},
                    headers={"Authorization": f"Bearer {key.secret}"},
                )  # fmt: skip
                assert response.headers["x-cache"] == "miss"
                time.sleep(0.2)

    def test_cache_control_and_the_body_opt_out(self, world, make_api_key):
        key = make_api_key(rate_limit_rpm=10_000)
        question = "How many legs does a spider have?"
        # no-store: answered and not kept.
        assert ask(world, key, question, headers={"Cache-Control": "no-store"}).headers["x-cache"] == "miss"
        time.sleep(0.5)
        assert ask(world, key, question, cache=False).headers["x-cache"] == "miss"  # the body opts out: not kept
        time.sleep(0.5)
        stored(world, key, question)  # only now kept
        assert ask(world, key, question, headers={"Cache-Control": "no-cache"}).headers["x-cache"] == "miss"
        assert ask(world, key, question, cache=False).headers["x-cache"] == "miss"
        assert ask(world, key, question).headers["x-cache"] == "hit"

    def test_the_models_policy_ttl_and_shared_scope(self, world, make_api_key, django_db_blocker):
        from registry.models import Model
        from serving.models import CachePolicy

        def policy(**fields: Any) -> None:
            CachePolicy.objects.update_or_create(model=Model.objects.get(name=world.chat_model), defaults=fields)

        alice, bob = make_api_key(rate_limit_rpm=10_000), make_api_key(rate_limit_rpm=10_000)
        committed(django_db_blocker, lambda: policy(ttl_seconds=1, shared_scope=True))
        time.sleep(0.6)
        try:
            stored(world, alice, "What is the tallest mountain?")
            assert ask(world, bob, "What is the tallest mountain?").headers["x-cache"] == "hit"  # shared
            time.sleep(1.2)
            assert ask(world, bob, "What is the tallest mountain?").headers["x-cache"] == "miss"  # expired
        finally:
            committed(django_db_blocker, lambda: CachePolicy.objects.filter(model__name=world.chat_model).delete())
            time.sleep(0.6)

    def test_a_long_prompt_is_not_cached(self, world, make_api_key, django_db_blocker):
        from registry.models import Model
        from serving.models import CachePolicy

        key = make_api_key(rate_limit_rpm=10_000)
        model = committed(django_db_blocker, lambda: Model.objects.get(name=world.chat_model))
        committed(django_db_blocker, lambda: CachePolicy.objects.update_or_create(
            model=model, defaults={"max_prompt_tokens": 30}))  # fmt: skip
        time.sleep(0.6)
        try:
            question = "Please summarise " + "the history of the printing press and its effects " * 3
            for _ in range(3):
                assert ask(world, key, question).headers["x-cache"] == "miss"
                time.sleep(0.2)
        finally:
            committed(django_db_blocker, lambda: CachePolicy.objects.filter(model=model).delete())
            time.sleep(0.6)


def report_wrong(world: World, key, request_id: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{world.gateway.base_url}/v1/cache/feedback", timeout=10,
                      json={"request_id": request_id, **body},
                      headers={"Authorization": f"Bearer {key.secret}"})  # fmt: skip


class TestErrorBudgetAndFeedback:
    """Issue 22: a served answer reported wrong tightens its entry at once; a tier outside the
    model's error budget is not served but audited (the engine answers, the two are compared)."""

    def test_a_reported_answer_tightens_its_entry_at_once(self, world, make_api_key):
        alice, bob = make_api_key(rate_limit_rpm=10_000), make_api_key(rate_limit_rpm=10_000)
        question, typo = "How do I close my savings account online?", "How do I close my savings acount online?"
        stored(world, alice, question)
        hit = ask(world, alice, typo)
        assert hit.headers["x-cache"] == "semantic-hit"
        request_id = hit.headers["x-request-id"]
        assert report_wrong(world, bob, request_id).status_code == 404  # not bob's answer
        made = report_wrong(world, alice, hit.json()["id"], reason="wrong account type")  # the body's id works too
        assert made.status_code == 200, made.text
        answer = made.json()
        assert (answer["object"], answer["wording"], answer["model"]) == ("cache.feedback", "typo", world.chat_model)
        assert answer["tightened"] >= 1
        assert ask(world, alice, typo).headers["x-cache"] == "miss"  # the entry serves only the same words now
        assert ask(world, alice, question).headers["x-cache"] == "hit"  # the same text still is
        again = report_wrong(world, alice, request_id)
        assert again.status_code == 200
        assert again.json()["created_at"] == answer["created_at"]

    @pytest.mark.parametrize(
        ("body", "param"),
        [({"request_id": "not-an-id"}, "request_id"), ({}, "request_id"),
         ({"request_id": str(uuid.uuid4()), "reason": 5}, "reason"), ({"request_id": "x", "extra": 1}, "extra")],
    )  # fmt: skip
    def test_bad_reports_are_refused_with_the_param(self, world, make_api_key, body, param):
        key = make_api_key()
        answer = httpx.post(f"{world.gateway.base_url}/v1/cache/feedback", json=body, timeout=10,
                            headers={"Authorization": f"Bearer {key.secret}"})  # fmt: skip
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == param

    def test_an_unknown_request_is_a_404_and_no_key_a_401(self, world, make_api_key):
        key = make_api_key()
        missing = report_wrong(world, key, str(uuid.uuid4()))
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_served_from_cache")
        assert httpx.post(f"{world.gateway.base_url}/v1/cache/feedback", json={"request_id": "x"}).status_code == 401

    def test_a_tier_outside_the_budget_is_audited_not_served(self, world, make_api_key, django_db_blocker):
        from registry.models import Model
        from serving.models import CachePolicy
        from serving.semcache import budget

        key = make_api_key(rate_limit_rpm=10_000)
        question = "Which platform does the night train to Vienna leave from?"
        stored(world, key, question)
        model = committed(django_db_blocker, lambda: Model.objects.get(name=world.chat_model))
        committed(django_db_blocker, lambda: CachePolicy.objects.update_or_create(
            model=model, defaults={"wrong_hit_budget": Decimal("0.1")}))  # fmt: skip
        time.sleep(0.6)
        try:
            before = budget.records_sync(world.chat_model).get("same", budget.TierRecord()).audits
            near = ask(world, key, "which platform does the night train to vienna leave from")
            assert near.headers["x-cache"] == "miss"  # 0.1 % is below what the prior can promise
            assert ask(world, key, question).headers["x-cache"] == "hit"  # the same text is always served
            deadline = time.monotonic() + 10
            while budget.records_sync(world.chat_model).get("same", budget.TierRecord()).audits == before:
                assert time.monotonic() < deadline, "the audit was not counted"
                time.sleep(0.1)
        finally:
            committed(django_db_blocker, lambda: CachePolicy.objects.filter(model=model).delete())
            time.sleep(0.6)

    def test_an_organisations_stricter_budget_applies_to_its_own_requests(self, world, make_api_key,
                                                                         django_db_blocker):  # fmt: skip
        from accounts.models import Organization
        from accounts.services import organization_update

        strict, other = make_api_key(rate_limit_rpm=10_000), make_api_key(rate_limit_rpm=10_000)
        question = "Which gate does the morning ferry to Tallinn leave from?"
        near = "which gate does the morning ferry to tallinn leave from"

        def tighten() -> None:
            organization = Organization.objects.get(pk=strict.organization_id)
            organization_update(organization=organization, cache_wrong_hit_budget="0.1")

        committed(django_db_blocker, tighten)  # gateways drop the org's grants at once
        time.sleep(0.3)
        stored(world, strict, question)
        stored(world, other, question)
        assert ask(world, strict, near).headers["x-cache"] == "miss"  # 0.1 %: outside what the prior promises
        assert ask(world, other, near).headers["x-cache"] == "semantic-hit"  # the model's 1 % for the others


class TestFailures:
    def test_a_stuck_cache_table_is_a_miss_not_a_failure(self, world, make_api_key, django_db_blocker):
        """The database slow for the cache (its table locked): the request is answered anyway."""
        from django.db import connection

        from serving.models import CacheEntry

        key = make_api_key(rate_limit_rpm=10_000)
        stored(world, key, "What colour is the sky?")
        locked, release = threading.Event(), threading.Event()

        def hold_lock() -> None:
            with django_db_blocker.unblock():
                from django.db import transaction

                with transaction.atomic():
                    with connection.cursor() as cursor:
                        cursor.execute(f"LOCK TABLE {CacheEntry._meta.db_table} IN ACCESS EXCLUSIVE MODE")
                    locked.set()
                    release.wait(30)
                connection.close()

        holder = threading.Thread(target=hold_lock)
        holder.start()
        try:
            assert locked.wait(10)
            started = time.monotonic()
            response = ask(world, key, "What colour is the sky?")
            assert response.status_code == 200
            assert response.headers["x-cache"] == "miss"
            assert time.monotonic() - started < 10
        finally:
            release.set()
            holder.join(30)

    def test_the_embedding_replica_down_is_a_miss_unless_the_text_is_the_same(self, world, make_api_key,
                                                                              django_db_blocker):  # fmt: skip
        from registry.models import Replica

        key = make_api_key(rate_limit_rpm=10_000)
        stored(world, key, "Who painted the Mona Lisa?")
        # This world's replica only: a stale row of an earlier test may name the same (reused) port.
        ours = Replica.objects.filter(deployment__version__model__name=world.embedder)
        moved = committed(django_db_blocker, lambda: ours.filter(endpoint=world.embed_endpoint).update(
            endpoint="http://127.0.0.1:9"))  # fmt: skip
        assert moved == 1
        time.sleep(0.6)
        try:
            # Words that pass need the embedding's similarity guard: without the embedder, a miss.
            response = ask(world, key, "who painted the mona lisa")
            assert (response.status_code, response.headers["x-cache"]) == (200, "miss")
            # The same text needs no embedding: found by its signature, served.
            response = ask(world, key, "Who painted the Mona Lisa?")
            assert (response.status_code, response.headers["x-cache"]) == (200, "hit")
        finally:
            committed(django_db_blocker, lambda: ours.filter(endpoint="http://127.0.0.1:9").update(
                endpoint=world.embed_endpoint))  # fmt: skip
            time.sleep(0.6)


class TestEmbeddingsCache:
    def test_the_same_input_is_an_exact_hit_metered_as_cached(self, world, make_api_key):
        key = make_api_key(rate_limit_rpm=10_000)
        other = make_api_key(rate_limit_rpm=10_000)

        def embed(api_key) -> httpx.Response:
            return httpx.post(
                f"{world.gateway.base_url}/v1/embeddings", timeout=30,
                json={"model": world.embedder, "input": ["kittens", "puppies"], "encoding_format": "float"},
                headers={"Authorization": f"Bearer {api_key.secret}"},
            )  # fmt: skip

        first = embed(key)
        assert first.headers["x-cache"] == "miss"
        deadline = time.monotonic() + 5
        while (second := embed(key)).headers["x-cache"] != "hit":
            assert time.monotonic() < deadline, "the embeddings answer was not stored"
            time.sleep(0.1)
        assert second.json()["data"] == first.json()["data"]
        assert second.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
        record = persisted([second.headers["x-request-id"]])[second.headers["x-request-id"]]
        assert (record.cache, record.cached_tokens) == ("hit", 3)
        assert embed(other).headers["x-cache"] == "miss"  # another tenant's key: its own scope
