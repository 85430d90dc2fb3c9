"""Prefix-aware routing: chained block hashes, the pick by prefix bounded by load, and a real
gateway keeping conversations on the replica that holds their prefix (two fake engines with
prefix caches of their own)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest

from core import keys
from core.redis import sync_redis
from serving.gateway import prefixes
from serving.gateway.prefixes import (
    PrefixMemory,
    prefer_by_prefix,
    prefix_memory,
    text_block_hashes,
    token_block_hashes,
)
from serving.gateway.routing import ReplicaRoute, Router, VersionRoute
from serving.llm.prompts import count_prompts, prompt_blocks
from serving.llm.schemas import ChatCompletionRequest
from serving.llm.tokens import PromptCount, PromptCounter
from tests.support.gateway import committed, engine_counter, replica_in_flight, start_fake_engine
from tests.support.processes import Gateway, stop_process

# --- the blocks --------------------------------------------------------------------------


class TestBlockHashes:
    def test_the_same_prefix_gives_the_same_leading_hashes_and_a_divergence_changes_the_rest(self):
        ids = list(range(100, 164))  # 4 blocks of 16
        changed = [*ids[:40], 9, *ids[41:]]  # differs in block 2
        a, b = token_block_hashes(ids, 16), token_block_hashes(changed, 16)
        assert len(a) == len(b) == 4
        assert a[:2] == b[:2]
        assert a[2] != b[2]
        assert a[3] != b[3]  # block 3 is the same ids, but chained after block 2
        assert len(set(a)) == 4

    def test_a_change_in_the_first_block_changes_every_hash(self):
        ids = list(range(64))
        assert not set(token_block_hashes(ids, 16)) & set(token_block_hashes([1, *ids[1:]], 16))

    def test_only_full_blocks_are_hashed(self):
        assert token_block_hashes(list(range(15)), 16) == ()
        assert len(token_block_hashes(list(range(47)), 16)) == 2
        assert len(text_block_hashes(b"x" * 130, 16)) == 2  # 64 bytes a block
        assert len(token_block_hashes(list(range(10_000)), 16)) == prefixes.BLOCKS_HASHED

    def test_ids_no_engine_has_are_not_hashed(self):
        assert token_block_hashes([2**70] * 32, 16) == ()

    def test_a_conversations_next_turn_starts_with_its_earlier_blocks(self, settings):
        settings.ROUTING_PREFIX_BLOCK_TOKENS = 16
        system = {"role": "system", "content": "You answer questions about the platform. " * 20}
        turn1 = [system, {"role": "user", "content": "How do I deploy a model? " * 5}]
        turn2 = [*turn1, {"role": "assistant", "content": "Like this. " * 10}, {"role": "user", "content": "And?"}]
        other = [system, {"role": "user", "content": "Something else entirely. " * 5}]

        def blocks(messages: list[dict[str, Any]]) -> tuple[bytes, ...]:
            data = {"model": "m", "messages": messages}
            return prompt_blocks(ChatCompletionRequest.model_validate(data), data, [PromptCount(1, False)])

        first, second, third = blocks(turn1), blocks(turn2), blocks(other)
        assert len(second) > len(first) > 0
        assert second[: len(first)] == first
        shared = next(i for i, (x, y) in enumerate(zip(first, third, strict=False)) if x != y)
        assert 0 < shared < len(first)  # the system prompt's blocks, then they part

    def test_token_ids_are_preferred_to_text(self, settings):
        settings.ROUTING_PREFIX_BLOCK_TOKENS = 16
        data = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        counted = PromptCount(40, True, list(range(40)))
        assert prompt_blocks(ChatCompletionRequest.model_validate(data), data, [counted]) == token_block_hashes(
            list(range(40)), 16
        )


def test_a_counted_chat_is_hashed_by_its_token_ids(tmp_path, settings):
    """With the model's tokenizer and chat template (here a tiny word-level one), the blocks are
    the rendered conversation's token ids, and a next turn starts with the earlier turn's blocks."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<system>", "<user>", "<assistant>", "you", "answer", "about", "the", "platform", "how", "do",
             "i", "deploy", "it"]  # fmt: skip
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    counter = PromptCounter(str(tmp_path))
    settings.ROUTING_PREFIX_BLOCK_TOKENS = 16
    turn1 = [
        {"role": "system", "content": "you answer about the platform " * 8},
        {"role": "user", "content": "how do i deploy it " * 5},
    ]
    turn2 = [*turn1, {"role": "assistant", "content": "deploy it " * 10}, {"role": "user", "content": "how " * 20}]

    def blocks(messages: list[dict[str, Any]]) -> tuple[tuple[bytes, ...], PromptCount]:
        data = {"model": "m", "messages": messages}
        body = ChatCompletionRequest.model_validate(data)
        counts = count_prompts(counter, body, data)
        return prompt_blocks(body, data, counts), counts[0]

    (first, count1), (second, _) = blocks(turn1), blocks(turn2)
    assert count1.exact
    assert count1.ids is not None
    assert len(count1.ids) == count1.tokens
    assert first == token_block_hashes(count1.ids, 16)
    assert len(first) == count1.tokens // 16 >= 4
    assert second[: len(first)] == first
    assert len(second) > len(first)


# --- the pick ----------------------------------------------------------------------------


def version(replicas: int = 3) -> VersionRoute:
    now = time.time()
    return VersionRoute(
        id=1, version="1", deployment_id=1, weight=100, max_model_len=4096, artifact_uri="local://x",
        replicas=tuple(ReplicaRoute(id=900_000 + i, endpoint=f"http://r{i}", heartbeat_at=now)
                       for i in range(replicas)),
    )  # fmt: skip


BLOCKS = token_block_hashes(list(range(16 * 8)), 16)  # 8 blocks


def cache(v: VersionRoute, replica_id: int) -> str:
    """The KV cache (``ReplicaRoute.kv_cache``) of one of ``v``'s replicas."""
    return next(r.kv_cache for r in v.replicas if r.id == replica_id)


def busy(router: Router, v: VersionRoute, loads: dict[int, int]) -> None:
    by_id = {r.id: r for r in v.replicas}
    for replica_id, n in loads.items():
        for _ in range(n):
            router.lease(by_id[replica_id])


@pytest.fixture
def memory(settings, monkeypatch) -> Iterator[PrefixMemory]:
    """The process's prefix memory, empty, with its Redis keys of the test replicas gone (and a
    lookup timeout no busy test machine reaches)."""
    monkeypatch.setattr(prefixes, "LOOKUP_TIMEOUT", 5.0)
    settings.ROUTING_PREFIX_AWARE = True
    settings.ROUTING_PREFIX_MAX_IMBALANCE = 1.5
    caches = [r.kv_cache for r in version(4).replicas]
    sync_redis().delete(*(keys.prefix_blocks(c) for c in caches))
    prefix_memory.forget()
    yield prefix_memory
    prefix_memory.forget()
    sync_redis().delete(*(keys.prefix_blocks(c) for c in caches))


async def written(memory: PrefixMemory) -> None:
    """Wait for the memory's records to reach Redis."""
    task = memory._writer.task
    if task is not None:
        await task


def pick(order: list[int], held: dict[int, int], loads: dict[int, int]) -> tuple[list[int], bool]:
    """prefer_by_prefix over replica ids, with what each holds and runs given by id."""
    return prefer_by_prefix(order, [held.get(r, 0) for r in order], [loads[r] for r in order], max_imbalance=1.5)


class TestPick:
    def test_the_longest_match_wins_the_less_busy_on_a_tie(self):
        order = [1, 2, 3]
        loads = {1: 0, 2: 1, 3: 1}
        assert pick(order, {2: 3, 3: 5}, loads) == ([3, 1, 2], True)
        assert pick(order, {2: 5, 3: 5}, loads) == ([2, 1, 3], True)

    def test_the_bound_is_ceil_of_the_factor_times_the_fair_share_after_placing(self):
        held = {1: 4}
        # 2 replicas, 3 in flight: ceil(1.5 * 4 / 2) = 3, so a replica with 2 may take one more, with 3 not.
        assert pick([2, 1], held, {1: 2, 2: 1})[0][0] == 1
        assert pick([2, 1], held, {1: 3, 2: 0}) == ([2, 1], False)
        # At low load the preferred replica may be busier than the idle one: (1, 0) → ceil(1.5) = 2.
        assert pick([2, 1], held, {1: 1, 2: 0})[0][0] == 1

    async def test_the_router_prefers_the_replica_that_holds_the_longest_prefix(self, memory):
        router, v = Router(), version()
        a, b, c = (r.id for r in v.replicas)
        memory.note(cache(v, a), BLOCKS[:2])
        memory.note(cache(v, b), BLOCKS[:6])
        await written(memory)
        memory.forget()  # from Redis alone, as another gateway would see it
        busy(router, v, {b: 1, c: 1})  # busier than a, under the bound: ceil(1.5 * 3 / 3) = 2
        assert (await router.prefix_order("m", v, BLOCKS))[0].id == b
        assert (await router.prefix_order("m", v, BLOCKS[:2]))[0].id == a  # a tie: the less busy
        assert (await router.prefix_order("m", v, token_block_hashes(list(range(1, 200)), 16)))[0].id == a

    async def test_a_restarted_replica_holds_nothing(self, memory):
        """A new engine process (its pid) starts with an empty KV cache: what the old one was
        sent does not count for it."""
        router, v = Router(), version(2)
        a, b = (r.id for r in v.replicas)
        memory.note(cache(v, b), BLOCKS)
        busy(router, v, {b: 1})  # busier than a, under the bound: ceil(1.5 * 2 / 2) = 2
        assert (await router.prefix_order("m", v, BLOCKS))[0].id == b
        restarted = replace(v, replicas=tuple(replace(r, pid=4242) if r.id == b else r for r in v.replicas))
        assert (await router.prefix_order("m", restarted, BLOCKS))[0].id == a

    async def test_an_overloaded_replica_is_skipped_for_the_next_longest_match(self, memory):
        router, v = Router(), version()
        a, b, _ = (r.id for r in v.replicas)
        memory.note(cache(v, a), BLOCKS[:2])
        memory.note(cache(v, b), BLOCKS)
        busy(router, v, {b: 4})  # ceil(1.5 * 5 / 3) = 3: 4 is too many
        assert (await router.prefix_order("m", v, BLOCKS))[0].id == a

    async def test_no_match_is_least_busy(self, memory):
        router, v = Router(), version()
        a, b, c = (r.id for r in v.replicas)
        busy(router, v, {a: 2, b: 1})
        memory.note(cache(v, a), BLOCKS)
        assert (await router.prefix_order("m", v, token_block_hashes(list(range(5, 200)), 16)))[0].id == c

    async def test_turned_off_it_is_least_busy(self, memory, settings):
        router, v = Router(), version()
        a, b, c = (r.id for r in v.replicas)
        busy(router, v, {a: 1, b: 1})
        memory.note(cache(v, a), BLOCKS)
        assert (await router.prefix_order("m", v, BLOCKS))[0].id == a
        settings.ROUTING_PREFIX_AWARE = False
        assert (await router.prefix_order("m", v, BLOCKS))[0].id == c

    async def test_redis_down_is_least_busy_and_asks_redis_no_more_for_a_while(self, memory, monkeypatch):
        """A Redis that refuses connections: the lookup fails at once, the request is routed
        (by load, this process knowing nothing), and Redis is left alone for REDIS_RETRY_SECONDS."""
        import redis.asyncio as aioredis

        router, v = Router(), version()
        a, b, c = (r.id for r in v.replicas)
        memory.note(cache(v, b), BLOCKS)
        await written(memory)
        memory.forget()
        busy(router, v, {a: 1, b: 1})
        asked: list[int] = []

        def down() -> aioredis.Redis:
            asked.append(1)
            return aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)

        monkeypatch.setattr(prefixes, "async_redis", down)
        monkeypatch.setattr(prefixes, "LOOKUP_TIMEOUT", 0.1)  # the real one (redis-py retries connecting)
        started = time.monotonic()
        assert (await router.prefix_order("m", v, BLOCKS))[0].id == c
        assert (await router.prefix_order("m", v, BLOCKS))[0].id == c
        assert time.monotonic() - started < 0.5
        assert len(asked) == 1
        # What this process itself sent where still counts while Redis is away.
        memory.note(cache(v, a), BLOCKS)
        assert (await router.prefix_order("m", v, BLOCKS))[0].id == a

    async def test_a_slow_redis_is_not_waited_for(self, memory, monkeypatch):
        router, v = Router(), version()

        class Hanging:
            def pipeline(self, **options: Any) -> Hanging:
                return self

            def zmscore(self, *args: Any) -> None:
                pass

            async def execute(self) -> None:
                await asyncio.sleep(10)

        monkeypatch.setattr(prefixes, "async_redis", Hanging)
        monkeypatch.setattr(prefixes, "LOOKUP_TIMEOUT", 0.1)
        started = time.monotonic()
        await router.prefix_order("m", v, BLOCKS)
        assert time.monotonic() - started < 0.5

    async def test_a_long_prompts_prefix_is_found_from_a_few_probes_within_a_stride(self, memory):
        assert prefixes.probes(10) == list(range(10))
        spread = prefixes.probes(256)
        assert len(spread) == prefixes.LOOKUP_PROBES
        assert (spread[0], spread[-1]) == (0, 255)
        stride = max(b - a for a, b in itertools.pairwise(spread))
        long = token_block_hashes(list(range(16 * 256)), 16)
        replica = version().replicas[0].kv_cache
        memory.note(replica, long[:200])
        await written(memory)
        memory.forget()
        held = (await memory.held([replica], long))[replica]
        assert 200 - stride < held <= 200
        assert (await memory.held([replica], long[:100]))[replica] == 100  # the last block is always a probe

    async def test_memory_is_bounded_per_replica_and_forgotten_after_the_ttl(self, memory, settings):
        settings.ROUTING_PREFIX_BLOCKS_PER_REPLICA = 5
        replica = version().replicas[0].kv_cache
        memory.note(replica, BLOCKS[:3])
        await written(memory)
        await asyncio.sleep(0.01)
        memory.note(replica, BLOCKS[3:])
        await written(memory)
        key = keys.prefix_blocks(replica)
        assert sync_redis().zcard(key) == 5
        assert 0 < sync_redis().ttl(key) <= settings.ROUTING_PREFIX_TTL_SECONDS
        memory.forget()
        # The newest five are kept, the prompt's last: without its leading blocks, no match.
        assert (await memory.held([replica], BLOCKS))[replica] == 0
        settings.ROUTING_PREFIX_BLOCKS_PER_REPLICA = 100
        memory.note(replica, BLOCKS)
        await written(memory)
        memory.forget()
        assert (await memory.held([replica], BLOCKS))[replica] == 8
        settings.ROUTING_PREFIX_TTL_SECONDS = 0.5
        await asyncio.sleep(0.6)
        assert (await memory.held([replica], BLOCKS))[replica] == 0


# --- through a real gateway ------------------------------------------------------------


@dataclass
class TwoReplicas:
    name: str
    endpoints: list[str]
    replica_ids: list[int]

    def control(self, **state: Any) -> None:
        for endpoint in self.endpoints:
            httpx.post(f"{endpoint}/_control", json=state, timeout=5).raise_for_status()

    def cached_share(self) -> float:
        hits = sum(engine_counter(e, "vllm:prefix_cache_hits_total") for e in self.endpoints)
        queries = sum(engine_counter(e, "vllm:prefix_cache_queries_total") for e in self.endpoints)
        return hits / queries

    def requests(self) -> list[int]:
        return [int(httpx.get(f"{e}/_stats", timeout=5).json()["requests"]) for e in self.endpoints]

    def kept(self, salt: str) -> float:
        """The share of the conversations' turns after the first served by the engine that served
        the turn before (``user`` is ``<salt>:<conversation>:<turn>``)."""
        served: dict[tuple[str, int], int] = {}
        for index, endpoint in enumerate(self.endpoints):
            for user in httpx.get(f"{endpoint}/_stats", timeout=5).json()["users"]:
                tag, conversation, turn = (user or "::0").rsplit(":", 2)
                if tag == salt:
                    served[conversation, int(turn)] = index
        later = [(c, t) for c, t in served if t > 0]
        return sum(served[c, t] == served.get((c, t - 1)) for c, t in later) / len(later)


@pytest.fixture
def two_replicas(django_db_setup, django_db_blocker) -> Iterator[TwoReplicas]:
    """One model version served by two fake engines with prefix caches."""
    engines = [start_fake_engine() for _ in range(2)]
    name = f"prefix-{uuid.uuid4().hex[:8]}"

    def register() -> list[int]:
        from django.utils import timezone

        from registry.models import Deployment, Model, ModelVersion, Replica

        model = Model.objects.create(name=name, task="chat")
        model_version = ModelVersion.objects.create(
            model=model, version="1", framework="fake", artifact_uri=f"local://fake/{name}", artifact_sha256="0" * 64,
            artifact_size=0, config={"max_seq_len": 100_000}, status="active",
        )  # fmt: skip
        deployment = Deployment.objects.create(version=model_version, status="running", traffic_weight=100)
        return [
            Replica.objects.create(
                deployment=deployment, host="fake", endpoint=endpoint, state="ready", last_heartbeat=timezone.now()
            ).pk
            for _, endpoint in engines
        ]

    replica_ids = committed(django_db_blocker, register)
    pair = TwoReplicas(name, [endpoint for _, endpoint in engines], replica_ids)
    pair.control(prefix_cache=True, tokens=4, delay=0.02, latency=0.2)
    yield pair
    for process, _ in engines:
        stop_process(process, grace=0)
    sync_redis().delete(*(keys.prefix_blocks(f"{i}.0") for i in replica_ids))  # no pid: not started by a supervisor


SYSTEM = (
    "You are the support assistant of an inference platform. Answer briefly and precisely, cite the "
    "guide a user should read, and never invent a setting that does not exist. "
)


def conversations(gateway: Gateway, secret: str, model: str, *, salt: str, count: int, turns: int) -> None:
    """``count`` conversations sharing one long system prompt, ``turns`` turns each (streamed and
    not, alternately), all at once, after one request that puts the system prompt on one replica
    only (so every first turn prefers that one: only the bound spreads them)."""
    errors: list[BaseException] = []
    system = {"role": "system", "content": f"[{salt}] {SYSTEM}"}
    warm_up = httpx.post(
        f"{gateway.base_url}/v1/chat/completions", timeout=30,
        json={"model": model, "messages": [system]}, headers={"Authorization": f"Bearer {secret}"},
    )  # fmt: skip
    assert warm_up.status_code == 200, warm_up.text
    start = threading.Barrier(count)

    def talk(i: int) -> None:
        start.wait()
        messages: list[dict[str, Any]] = [system]
        try:
            with httpx.Client(timeout=30) as client:
                for turn in range(turns):
                    question = f"Conversation {i}, question {turn}: how do I roll out version {turn} safely? " * 8
                    messages.append({"role": "user", "content": question})
                    answer = client.post(
                        f"{gateway.base_url}/v1/chat/completions",
                        json={
                            "model": model,
                            "messages": messages,
                            "stream": turn % 2 == 1,
                            "user": f"{salt}:{i}:{turn}",
                        },
                        headers={"Authorization": f"Bearer {secret}"},
                    )
                    assert answer.status_code == 200, answer.text
                    messages.append({"role": "assistant", "content": f"Answer {turn} to conversation {i}."})
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]


def sampled_peak(gateway: Gateway, replica_ids: list[int], stop: threading.Event, peaks: list[float]) -> None:
    while not stop.is_set():
        peaks.append(max(replica_in_flight(gateway, r) for r in replica_ids))
        time.sleep(0.01)


def routed(gateway: Gateway, model: str, how: str) -> float:
    """The gateway's ``inference_prefix_routing_total`` of ``model`` and ``how``."""
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inference_prefix_routing_total{") and f'how="{how}"' in line and f'model="{model}"' in line
    )


GATEWAY_ENV = {"REPLICA_STALE_AFTER": "86400", "ROUTING_REFRESH_SECONDS": "0.2"}


def test_conversations_stay_on_the_replica_that_holds_their_prefix(two_replicas, api_key, spawn_gateway):
    """The same workload through a prefix-aware gateway and a least-busy one (fresh prompts and
    emptied engine caches each): the engines find clearly more of the prompts cached with prefix
    routing, and no replica ever holds more requests than the bound allows."""
    count, turns = 8, 6
    shares: dict[str, float] = {}
    kept: dict[str, float] = {}
    for aware in ("true", "false"):
        gateway = spawn_gateway(ROUTING_PREFIX_AWARE=aware, ROUTING_PREFIX_MAX_IMBALANCE="1.5", **GATEWAY_ENV)
        two_replicas.control(prefix_cache_clear=True)
        salt = uuid.uuid4().hex
        stop, peaks = threading.Event(), []
        sampler = threading.Thread(target=sampled_peak, args=(gateway, two_replicas.replica_ids, stop, peaks))
        sampler.start()
        try:
            conversations(gateway, api_key.secret, two_replicas.name, salt=salt, count=count, turns=turns)
        finally:
            stop.set()
            sampler.join()
        shares[aware], kept[aware] = two_replicas.cached_share(), two_replicas.kept(salt)
        # At most `count` requests are in flight at once: ceil(1.5 * count / 2) on one replica at most.
        assert max(peaks) <= -(-1.5 * count // 2), peaks
        if aware == "true":
            assert routed(gateway, two_replicas.name, "prefix") >= count * (turns - 1)
            assert min(two_replicas.requests()) > 0  # both replicas serve
        else:
            assert routed(gateway, two_replicas.name, "prefix") == 0
        gateway.stop()
    # Least busy keeps about half the turns where the previous one went (0.53-0.55 seen), but on
    # a loaded machine up to 0.875 (cached share up to 0.70): the replica that just answered a
    # turn is often the one with a free place when the next turn comes. So the baseline is only
    # reported; prefix routing must keep the turns (>= 0.9) and find most of what can be cached
    # (0.72 of the prompts at best here; 0.675 on CI's loaded machine, 2026-11-29, with 0.925 of
    # the turns kept: a turn moved by the bound loses its conversation's history).
    assert kept["true"] >= 0.9, (kept, shares)
    assert kept["true"] >= kept["false"], (kept, shares)
    assert shares["true"] >= 0.64, (kept, shares)


def test_a_redis_error_never_fails_a_request(two_replicas, api_key, spawn_gateway):
    """Prefix keys Redis refuses to read or write (a wrong type): every request is answered, by load."""
    for replica_id in two_replicas.replica_ids:
        sync_redis().set(keys.prefix_blocks(f"{replica_id}.0"), "not a sorted set")  # no pid
    gateway = spawn_gateway(ROUTING_PREFIX_AWARE="true", **GATEWAY_ENV)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello " * 50}]
    for stream in (False, True, False):
        answer = httpx.post(
            f"{gateway.base_url}/v1/chat/completions", timeout=30,
            json={"model": two_replicas.name, "messages": messages, "stream": stream},
            headers={"Authorization": f"Bearer {api_key.secret}"},
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
    # The first is routed by load; the next by what this gateway itself sent where (Redis is not asked).
    assert routed(gateway, two_replicas.name, "load") + routed(gateway, two_replicas.name, "prefix") == 3
    assert "prefix routing: Redis lookup failed" in gateway.log()
