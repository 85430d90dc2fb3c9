"""The paraphrase tier through a real gateway with the real learned verifier (built once per
session: tests/support/fixtures.py ``cache_verifier``), PostgreSQL + pgvector and Redis; a fake
engine answers. The model's policy turns the tier on with a loose bound (10 %: a score of
0.8 with this verifier), since what is tested here is the path (found by embedding, judged,
served with its tier named, metered to its entry, shown in the request log, kept inside its
tenant), not the verifier's quality: that is bench/semantic_cache_paraphrase.py's, on
held-out sources."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.gateway import committed, persisted, price_model, register_fake_replica, start_fake_engine
from tests.support.processes import Gateway, start_gateway

pytestmark = pytest.mark.django_db

QUESTION = "How long should I boil an egg?"
PARAPHRASE = "What's the boiling time for an egg?"


@dataclass
class World:
    gateway: Gateway
    chat_model: str


@pytest.fixture(scope="module")
def world(bundled_models, cache_verifier: Path, django_db_blocker, tmp_path_factory) -> Iterator[World]:
    from registry.models import Model
    from serving.semcache.services import cache_policy_set

    chat_process, chat_endpoint = start_fake_engine()
    embed_process, embed_endpoint = start_fake_engine()
    suffix = uuid.uuid4().hex[:6]
    chat, embedder = f"paraphrased-chat-{suffix}", f"paraphrase-embedder-{suffix}"
    smollm2 = bundled_models["versions"]["smollm2-135m-instruct"].artifact_uri

    def register() -> None:
        register_fake_replica(chat, chat_endpoint, artifact_uri=smollm2)
        register_fake_replica(embedder, embed_endpoint, task="embedding")
        price_model(chat, input_per_million="10", output_per_million="30", cached_input_per_million="1")
        cache_policy_set(model=Model.objects.get(name=chat), enabled=True, max_temperature="0.5",
                         max_prompt_tokens=2000, ttl_seconds=3600, shared_scope=False, wrong_hit_budget="10",
                         paraphrases=True)  # fmt: skip

    committed(django_db_blocker, register)
    gateway = start_gateway(
        tmp_path_factory.mktemp("paraphrase-gateway"),
        SEMANTIC_CACHE_EMBEDDING_MODEL=embedder,
        TEST_SEMANTIC_CACHE_VERIFIER_DIR=str(cache_verifier),
        SEMANTIC_CACHE_PARAPHRASE_EXPLORE_RATE="0",
        # The tier's own error budget opens on a prior this large.
        SEMANTIC_CACHE_PARAPHRASE_PRIOR_SERVED="1000",
        REPLICA_STALE_AFTER="86400",
        ROUTING_REFRESH_SECONDS="0.2",
    )
    yield World(gateway, chat)
    gateway.stop()
    for process in (chat_process, embed_process):
        process.kill()


def ask(world: World, key, question: str) -> httpx.Response:
    return httpx.post(
        f"{world.gateway.base_url}/v1/chat/completions", timeout=30,
        json={"model": world.chat_model, "messages": [{"role": "user", "content": question}], "temperature": 0,
              "max_tokens": 20},
        headers={"Authorization": f"Bearer {key.secret}"},
    )  # fmt: skip


def warm(world: World, key) -> None:
    """The gateway starts loading its local models on its first lookup without waiting for
    them (that lookup embeds through the replica): one question, then time for the load."""
    response = ask(world, key, f"Warm-up question number {uuid.uuid4().hex[:6]}?")
    assert response.status_code == 200, response.text
    time.sleep(3.0)


def stored(world: World, key, question: str) -> httpx.Response:
    first = ask(world, key, question)
    assert first.status_code == 200, first.text
    assert first.headers["x-cache"] == "miss"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if ask(world, key, question).headers["x-cache"] == "hit":
            return first
        time.sleep(0.2)
    raise AssertionError("the answer was not stored")


def test_a_paraphrase_is_served_at_its_tier_metered_to_its_entry(world, make_api_key):
    from django.contrib.auth import get_user_model
    from django.test import Client

    key = make_api_key(rate_limit_rpm=10_000)
    warm(world, key)
    first = stored(world, key, QUESTION)

    hit = ask(world, key, PARAPHRASE)

    assert hit.status_code == 200, hit.text
    assert (hit.headers["x-cache"], hit.headers["x-cache-tier"]) == ("semantic-hit", "paraphrase")
    assert 0 < float(hit.headers["x-cache-score"]) <= 1
    assert hit.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    request_id = hit.headers["x-request-id"]
    record = persisted([request_id])[request_id]
    assert (record.cache, record.cache_tier) == ("semantic-hit", "paraphrase")
    assert record.cache_entry is not None
    assert record.cached_tokens == record.prompt_tokens  # priced as a hit

    browser = Client()
    browser.force_login(get_user_model().objects.create_superuser(username="paraphrase-admin", password="pw-1234567"))
    page = browser.get("/console/requests/", {"id": request_id}).content.decode()
    assert "tier <strong>paraphrase</strong>" in page
    assert f"entry <code>{record.cache_entry}</code>" in page


def test_a_trap_and_another_tenant_are_misses(world, make_api_key):
    key, other = make_api_key(rate_limit_rpm=10_000), make_api_key(rate_limit_rpm=10_000)
    warm(world, key)
    stored(world, key, "How do I enable two-factor authentication on my account?")
    assert ask(world, key, "How do I disable two-factor authentication on my account?").headers["x-cache"] == "miss"
    assert other.organization_id != key.organization_id
    stored(world, key, "Where can I download my invoices?")
    theirs = ask(world, other, "How can I get a copy of my invoices?")
    assert theirs.headers["x-cache"] == "miss"  # another organisation's scope: never found
