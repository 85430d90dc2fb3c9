"""Prefix-aware replica choice: which replica most likely holds a prompt's leading blocks in its KV cache.

vLLM keeps the KV cache of the prompts it served, block by block (``--enable-prefix-caching``,
on by default in vLLM V1), and a request whose prompt starts with blocks a replica still holds
skips their prefill. So among the replicas of the version a request was routed to (its version,
canary arm and pin chosen first, unchanged), the router prefers the one that was sent the
longest run of the prompt's leading blocks, bounded by load (``prefer_by_prefix``).

**Blocks.** A prompt is cut into blocks of ROUTING_PREFIX_BLOCK_TOKENS tokens, the engine's
block size, and each block's hash covers the block and the hash before it (as vLLM chains its
own), so equal hashes at position i mean equal prompts up to the end of block i: a match is a
true prefix. Where the gateway counted the prompt with the model's tokenizer and chat template
(``serving.llm.tokens``) the blocks are its real token ids; where it could not (no tokenizer,
parts that are not text), they are chunks of the prompt's text, ``TEXT_BYTES_PER_TOKEN`` bytes
per token, of the messages serialised canonically (``serving.llm.prompts.prompt_blocks``): a
stand-in that keeps the prefix property, not the engine's own blocks. Only the first
``BLOCKS_HASHED`` blocks are hashed; a partial last block is not (vLLM caches full blocks only).

**Memory.** Which replica was sent which block hashes is kept in Redis, shared by every gateway
process and host: one sorted set per replica's engine process (``ReplicaRoute.kv_cache``: a
restarted replica starts with an empty cache, and so is remembered; ``core.keys.prefix_blocks``),
block hash → when, capped at ROUTING_PREFIX_BLOCKS_PER_REPLICA newest, forgotten
ROUTING_PREFIX_TTL_SECONDS after its last use. A lookup is one pipelined round trip (a ZMSCORE per replica of at most
``LOOKUP_PROBES`` of the blocks, evenly spread: ``probes``), bounded by ``LOOKUP_TIMEOUT``;
records are written after the replica accepted the request, off the request's path,
coalesced into one pipeline per ``FLUSH_INTERVAL``. This process also keeps what it
recorded itself (``LOCAL_BLOCKS`` hashes, newest kept): a record not yet written is seen, and
with Redis down (no lookup for ``REDIS_RETRY_SECONDS`` after a failure) routing still knows
what this process sent where. A Redis failure never fails a request: the pick is then by what
this process knows, else by load.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

from django.conf import settings

from core import keys
from core.lifecycle import Worker
from core.redis import async_redis

logger = logging.getLogger(__name__)

# The leading blocks hashed: 256 blocks of 16 tokens tell replicas apart for any prompt of up
# to 4,096 tokens, and a longer one by its first 4,096 (hashing costs ~1.5-2.5 µs a block on this
# project's 2-core machine under load: 0.4-0.6 ms for all 256).
BLOCKS_HASHED = 256
# A token is about 4 bytes of English text: the text stand-in's block is this many bytes a token.
TEXT_BYTES_PER_TOKEN = 4
# A lookup waits at most this long for Redis (then the pick is by what this process knows).
LOOKUP_TIMEOUT = 0.1
# After a Redis failure, neither lookups nor writes are tried for this long.
REDIS_RETRY_SECONDS = 5.0
# Records wait this long to be written together (one pipeline for every request meanwhile).
FLUSH_INTERVAL = 0.02
# Block hashes this process remembers itself, with the replicas it sent them to.
LOCAL_BLOCKS = 32768
# A lookup asks Redis about at most this many of the prompt's blocks, spread evenly from the first
# to the last (``probes``): every recorded prompt records all its leading blocks, so the last of
# them present tells how far a replica's prefix goes, within one stride (8 blocks, 128 tokens, for
# a prompt of 256 blocks). Measured on the project's loaded 2-core machine, 2 replicas, a prompt of
# 256 blocks: asking about all of them, 2.6 ms p50 and 9 ms p99 a lookup; 32 probes, 1.0 and 2.5 ms.
LOOKUP_PROBES = 32

_MAX_TOKEN_ID = 2**63 - 1


def _chained(chunks: Iterable[bytes]) -> tuple[bytes, ...]:
    """Each chunk's hash over the previous hash and the chunk (8 bytes of BLAKE2b)."""
    hashes: list[bytes] = []
    previous = b""
    for chunk in chunks:
        previous = hashlib.blake2b(previous + chunk, digest_size=8).digest()
        hashes.append(previous)
    return tuple(hashes)


def token_block_hashes(token_ids: Sequence[int], block_tokens: int) -> tuple[bytes, ...]:
    """Chained hashes of the full blocks of ``block_tokens`` token ids that start the prompt."""
    blocks = min(len(token_ids) // block_tokens, BLOCKS_HASHED)
    if blocks == 0:
        return ()
    try:
        packed = array("q", token_ids[: blocks * block_tokens]).tobytes()
    except (OverflowError, TypeError):  # not token ids a tokenizer gives (a client's own prompt)
        return ()
    size = block_tokens * 8  # bytes of one block of "q" (int64) ids
    return _chained(packed[i : i + size] for i in range(0, len(packed), size))


def probes(blocks: int) -> list[int]:
    """The positions of the blocks a lookup asks about: all of them up to LOOKUP_PROBES, else
    LOOKUP_PROBES spread evenly from the first to the last."""
    if blocks <= LOOKUP_PROBES:
        return list(range(blocks))
    return sorted({round(j * (blocks - 1) / (LOOKUP_PROBES - 1)) for j in range(LOOKUP_PROBES)})


def text_block_hashes(text: bytes, block_tokens: int) -> tuple[bytes, ...]:
    """Chained hashes of the full chunks of ``block_tokens x TEXT_BYTES_PER_TOKEN`` bytes that
    start ``text``: the stand-in for token blocks when the gateway has no token ids."""
    size = block_tokens * TEXT_BYTES_PER_TOKEN
    blocks = min(len(text) // size, BLOCKS_HASHED)
    return _chained(text[i * size : (i + 1) * size] for i in range(blocks))


R = TypeVar("R")


def prefer_by_prefix(
    order: Sequence[R], held: Sequence[int], loads: Sequence[int], *, max_imbalance: float
) -> tuple[list[R], bool]:
    """``order`` (least busy first) with the replica to prefer first, and whether a prefix decided;
    ``held`` and ``loads`` are each replica's leading blocks held and requests in flight, in
    ``order``'s order.

    The preferred replica holds the most leading blocks among those under the bound, the less
    busy on a tie. The bound is consistent hashing's with bounded loads (Mirrokni, Thorup and
    Zadimoghaddam, 2018; HAProxy's ``hash-balance-factor``): a replica is preferred only while
    its requests in flight are fewer than ceil(max_imbalance x (all in flight + 1) / replicas),
    so once it is sent this request it holds at most that many: never more than max_imbalance
    times its fair share, rounded up. No replica under the bound holding a block: ``order`` as
    it is (least busy first).
    """
    if len(order) < 2:
        return list(order), False
    capacity = math.ceil(max_imbalance * (sum(loads) + 1) / len(order))
    best: int | None = None
    for i, blocks in enumerate(held):
        if blocks > 0 and loads[i] < capacity and (best is None or blocks > held[best]):
            best = i
    if best is None:
        return list(order), False
    return [order[best], *order[:best], *order[best + 1 :]], True


class PrefixMemory:
    """Which replica was sent which block hashes: Redis, shared, and what this process recorded.

    ``held`` is the lookup (at most one Redis round trip), ``note`` the record (written later,
    coalesced). ``clock`` is unix seconds (the scores every gateway compares)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._local: OrderedDict[bytes, dict[str, float]] = OrderedDict()  # block → KV cache → when
        self._pending: dict[str, dict[bytes, float]] = {}
        self._redis_down_until = 0.0  # monotonic
        self._writer = Worker(self._write_pending, name="prefix-memory")

    @property
    def redis_up(self) -> bool:
        return time.monotonic() >= self._redis_down_until

    def _redis_failed(self, what: str, exc: BaseException) -> None:
        if self.redis_up:
            logger.warning("prefix routing: Redis %s failed (%s: %s); routing by what this gateway knows for %g s",
                           what, type(exc).__name__, exc, REDIS_RETRY_SECONDS)  # fmt: skip
        self._redis_down_until = time.monotonic() + REDIS_RETRY_SECONDS

    def forget(self) -> None:
        """Forget what this process knows (tests)."""
        self._local.clear()
        self._pending.clear()
        self._redis_down_until = 0.0

    async def held(self, caches: Sequence[str], hashes: Sequence[bytes]) -> dict[str, int]:
        """How many of ``hashes``' leading blocks each of these KV caches (``ReplicaRoute.kv_cache``)
        was sent within the TTL."""
        fresh_after = self._clock() - settings.ROUTING_PREFIX_TTL_SECONDS
        held = {cache: self._held_locally(cache, hashes, fresh_after) for cache in caches}
        if not hashes or not self.redis_up:
            return held
        positions = probes(len(hashes))
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT):
                pipe = async_redis().pipeline(transaction=False)
                members: list[Any] = [hashes[i] for i in positions]
                for cache in caches:
                    pipe.zmscore(keys.prefix_blocks(cache), members)
                answers = await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - any failure, a timeout too: routed without it, never failed
            self._redis_failed("lookup", exc)
            return held
        for cache, scores in zip(caches, answers, strict=True):
            blocks = 0
            for position, score in zip(positions, scores or (), strict=False):
                if score is None or float(score) < fresh_after:
                    break
                blocks = position + 1
            held[cache] = max(held[cache], blocks)
        return held

    def _held_locally(self, cache: str, hashes: Sequence[bytes], fresh_after: float) -> int:
        blocks = 0
        for digest in hashes:
            sent = self._local.get(digest)
            if sent is None or sent.get(cache, 0.0) < fresh_after:
                break
            blocks += 1
        return blocks

    def note(self, cache: str, hashes: Sequence[bytes]) -> None:
        """The replica whose KV cache is ``cache`` (``ReplicaRoute.kv_cache``) was sent a prompt
        starting with these blocks (call on the event loop)."""
        if not hashes:
            return
        now = self._clock()
        local = self._local
        for digest in hashes:
            sent = local.get(digest)
            if sent is None:
                local[digest] = {cache: now}
            else:
                sent[cache] = now
                local.move_to_end(digest)
        while len(local) > LOCAL_BLOCKS:
            local.popitem(last=False)
        if not self.redis_up:
            return
        pending = self._pending.setdefault(cache, {})
        pending.update(dict.fromkeys(hashes, now))
        self._writer.ensure()

    async def _write_pending(self) -> None:
        """Write what was noted, one pipeline per FLUSH_INTERVAL while there is some; then end
        (the next ``note`` starts it again)."""
        while self._pending:
            await asyncio.sleep(FLUSH_INTERVAL)
            pending, self._pending = self._pending, {}
            ttl = max(1, int(settings.ROUTING_PREFIX_TTL_SECONDS))
            cap = settings.ROUTING_PREFIX_BLOCKS_PER_REPLICA
            try:
                pipe = async_redis().pipeline(transaction=False)
                for cache, scores in pending.items():
                    key = keys.prefix_blocks(cache)
                    pipe.zadd(key, cast(dict[Any, float], scores))
                    pipe.zremrangebyrank(key, 0, -cap - 1)  # the oldest beyond the cap
                    pipe.expire(key, ttl)
                await pipe.execute()
            except Exception as exc:  # noqa: BLE001 - what was not written is lost: routed by what is known
                self._redis_failed("write", exc)
                self._pending.clear()
                return


prefix_memory = PrefixMemory()
