"""The router: public model name → version (weighted, sticky) → replica (least busy, healthy).

Gateways route from an in-process snapshot of the registry (and of the prices of what it
serves), reloaded every ROUTING_REFRESH_SECONDS and at once when a change is published on
the routing channel, so the hot path makes no database query. A replica is eligible only
while it is ready, its heartbeat is fresher than REPLICA_STALE_AFTER and its circuit is
not open (a half-open circuit lets one probe request through).

Versions are chosen by weighted rendezvous hashing of the request's sticky key: a caller
keeps its version across requests, and a weight change or a version going away moves only
the keys it must (see ``Router.choose_version``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import DatabaseError

from billing.pricing import PriceQuote, price_in_effect
from billing.selectors import prices_in_effect_or_later
from core import keys
from core.db import run_db
from core.errors import InvalidInput
from core.lifecycle import Worker, unobserved
from core.redis import async_redis
from registry.adapters import is_adapter_framework
from registry.artifacts import ArtifactUnavailable, get_artifact_store
from registry.models import ModelVersion
from registry.selectors import (
    adapter_replicas,
    bases_of_adapters,
    ready_replicas,
    serving_deployments,
    upstream_targets,
)
from registry.signatures import Signature
from registry.upstreams import UpstreamTarget
from serving.gateway import metrics
from serving.gateway.engine_kinds import EXTERNAL, PREDICT, kind_of
from serving.gateway.errors import EngineUnavailable, ModelNotFound
from serving.gateway.models import CachePolicy, ShadowPolicy
from serving.gateway.prefixes import prefer_by_prefix, prefix_memory

logger = logging.getLogger(__name__)


class RoutingUnavailable(Exception):
    """The registry could not be read and the routing table is older than ROUTING_MAX_STALENESS."""


@dataclass(frozen=True)
class CacheRules:
    """One model's cache rules, as the gateway holds them (from the routing snapshot)."""

    enabled: bool
    max_temperature: float
    max_prompt_tokens: int
    ttl_seconds: int
    shared_scope: bool
    wrong_hit_budget: float = 0.0  # the share of wrong semantic hits accepted (serving.semcache.budget)
    paraphrases: bool = False  # the paraphrase tier serves prompts worded otherwise (serving.semcache.bound)

    @property
    def wrong_hit_budget_percent(self) -> str:
        return f"{self.wrong_hit_budget * 100:g}"

    @classmethod
    def defaults(cls) -> CacheRules:
        return cls(
            enabled=True,
            max_temperature=settings.SEMANTIC_CACHE_MAX_TEMPERATURE,
            max_prompt_tokens=settings.SEMANTIC_CACHE_MAX_PROMPT_TOKENS,
            ttl_seconds=settings.SEMANTIC_CACHE_TTL_SECONDS,
            shared_scope=False,
            wrong_hit_budget=settings.SEMANTIC_CACHE_WRONG_HIT_BUDGET,
            paraphrases=settings.SEMANTIC_CACHE_PARAPHRASES,
        )

    @classmethod
    def of(cls, policy: CachePolicy | None) -> CacheRules:
        """The rules of a model with this policy row (None: the defaults)."""
        if policy is None:
            return cls.defaults()
        return cls(
            enabled=policy.enabled,
            max_temperature=float(policy.max_temperature),
            max_prompt_tokens=policy.max_prompt_tokens,
            ttl_seconds=policy.ttl_seconds,
            shared_scope=policy.shared_scope,
            wrong_hit_budget=(
                float(policy.wrong_hit_budget) / 100
                if policy.wrong_hit_budget is not None
                else settings.SEMANTIC_CACHE_WRONG_HIT_BUDGET
            ),
            paraphrases=settings.SEMANTIC_CACHE_PARAPHRASES if policy.paraphrases is None else policy.paraphrases,
        )


@dataclass(frozen=True)
class ReplicaRoute:
    id: int
    endpoint: str
    heartbeat_at: float  # unix time
    # An external upstream's replica: the key it takes instead of a replica key, and the name
    # it serves the model under (serving.gateway.engine sends both). None: the platform's own.
    upstream: UpstreamTarget | None = None
    pid: int | None = None  # its engine process; a restart starts another, with an empty KV cache
    # A LoRA adapter's route: the name the base replica's engine knows the adapter by, sent as
    # the request's model (serving.gateway.engine). None: the replica's own model.
    lora: str | None = None

    @property
    def kv_cache(self) -> str:
        """Names what its engine process holds in its KV cache (``serving.gateway.prefixes``):
        a restarted replica (a new process) is remembered as holding nothing, and an adapter's
        blocks apart from its base's (the engine keys them by adapter too)."""
        own = f"{self.id}.{self.pid or 0}"
        return own if self.lora is None else f"{own}.{self.lora}"


@dataclass(frozen=True)
class VersionRoute:
    id: int
    version: str
    deployment_id: int
    weight: int
    max_model_len: int
    artifact_uri: str
    replicas: tuple[ReplicaRoute, ...]
    tokenizer_dir: str | None = None  # where the gateway finds tokenizer.json, if local
    prices: tuple[PriceQuote, ...] = ()  # this version's and its model's, current and scheduled
    default_temperature: float = 1.0  # what the engine samples at when a request sets none
    # A small model's (served by a predict worker): the tensors it takes and gives, and the
    # class names of its label output by index. None for a model vLLM serves.
    predict: bool = False
    signature: Signature | None = None
    labels: tuple[str, ...] = ()

    def price_at(self, when: float) -> PriceQuote | None:
        """The price a request admitted at ``when`` pays (None: the model is not priced)."""
        return price_in_effect(self.prices, version_id=self.id, when=when)


@dataclass(frozen=True)
class ShadowRoute:
    """A model's shadow policy (serving.ShadowPolicy), enabled and above 0 %."""

    version_id: int  # the candidate version's id (VersionRoute.id)
    version: str
    basis_points: int  # of 10,000 requests, how many are copied (percent x 100)


@dataclass(frozen=True)
class ModelRoute:
    name: str
    task: str
    owner: str
    created: int
    versions: tuple[VersionRoute, ...]
    cache_rules: CacheRules = field(default_factory=CacheRules.defaults)
    shadow: ShadowRoute | None = None


@dataclass(frozen=True)
class RoutingTable:
    models: dict[str, ModelRoute]
    loaded_at: float


def _epoch(value: datetime | None) -> float:
    return value.timestamp() if value is not None else 0.0


def load_routing_table() -> RoutingTable:
    """Read the registry into a snapshot (sync: runs in a thread)."""
    deployments = list(serving_deployments())
    external = {d.id: d.version_id for d in deployments if kind_of(d.version.framework) is EXTERNAL}
    targets = upstream_targets(version_ids=list(external.values())) if external else {}
    replicas_by_deployment: dict[int, list[ReplicaRoute]] = defaultdict(list)
    adapters = {d.id: d.version_id for d in deployments if is_adapter_framework(d.version.framework)}
    bases: dict[int, ModelVersion] = {}
    if adapters:
        bases = bases_of_adapters(version_ids=list(set(adapters.values())))
        # An adapter's replicas: its base's ready replicas whose engine holds it, under its lora name.
        held = adapter_replicas(version_ids=list(set(adapters.values())))
        for deployment_id, version_id in adapters.items():
            replicas_by_deployment[deployment_id] = [
                ReplicaRoute(
                    id=replica.id,
                    endpoint=replica.endpoint,
                    heartbeat_at=_epoch(replica.last_heartbeat),
                    pid=replica.pid,
                    lora=lora,
                )
                for replica, lora in held.get(version_id, ())
            ]
    for replica in ready_replicas(deployment_ids=[d.id for d in deployments if d.id not in adapters]):
        upstream = None
        if replica.deployment_id in external:
            upstream = targets.get(external[replica.deployment_id])
            if upstream is None:
                continue  # its key cannot be read (logged): never called with another key
        replicas_by_deployment[replica.deployment_id].append(
            ReplicaRoute(
                id=replica.id,
                endpoint=replica.endpoint,
                heartbeat_at=_epoch(replica.last_heartbeat),
                upstream=upstream,
                pid=replica.pid,
            )
        )
    model_ids = {d.version.model_id for d in deployments}
    policies = {p.model_id: p for p in CachePolicy.objects.filter(model_id__in=model_ids)}
    shadows = {
        p.model_id: ShadowRoute(
            version_id=p.candidate_id, version=p.candidate.version, basis_points=int(p.percent * 100)
        )
        for p in ShadowPolicy.objects.filter(model_id__in=model_ids, enabled=True, percent__gt=0).select_related(
            "candidate"
        )
    }
    prices_by_model: dict[int, list[PriceQuote]] = defaultdict(list)
    for price in prices_in_effect_or_later(model_ids=list(model_ids)):
        prices_by_model[price.model_id].append(PriceQuote.of(price))
    versions_by_model: dict[str, list[VersionRoute]] = defaultdict(list)
    models: dict[str, ModelRoute] = {}
    for deployment in deployments:
        version = deployment.version
        model = version.model
        # An adapter is served by its base's engines: their context, tokenizer and defaults.
        engine_version = bases.get(version.id, version)
        versions_by_model[model.name].append(
            VersionRoute(
                id=version.id,
                version=version.version,
                deployment_id=deployment.id,
                weight=deployment.traffic_weight,
                max_model_len=kind_of(engine_version.framework).context_length(engine_version.config),
                artifact_uri=version.artifact_uri,
                replicas=tuple(replicas_by_deployment.get(deployment.id, ())),
                tokenizer_dir=(tokenizer := _tokenizer_dir(engine_version.artifact_uri)),
                prices=tuple(q for q in prices_by_model[model.id] if q.version_id in (None, version.id)),
                default_temperature=_default_temperature(tokenizer),
                **_predict_fields(version.framework, version.config),
            )
        )
        policy = policies.get(model.id)
        models[model.name] = ModelRoute(
            name=model.name,
            task=model.task,
            owner=model.owner or "platform",
            created=int(model.created_at.timestamp()),
            versions=(),
            cache_rules=CacheRules.of(policy),
            shadow=shadows.get(model.id),
        )
    return RoutingTable(
        models={name: replace(m, versions=tuple(versions_by_model[name])) for name, m in models.items()},
        loaded_at=time.monotonic(),
    )


def _predict_fields(framework: str, config: dict[str, Any]) -> dict[str, Any]:
    if kind_of(framework) is not PREDICT:
        return {}
    try:
        signature = Signature.from_json(config.get("signature"))
    except InvalidInput:
        logger.error("a %s version has no usable signature in its config; it is not served", framework)
        return {"predict": True}
    labels = config.get("labels")
    names = tuple(str(x) for x in labels) if isinstance(labels, list) else ()
    return {"predict": True, "signature": signature, "labels": names}


def _default_temperature(artifact_dir: str | None) -> float:
    """The temperature vLLM samples at when a request sets none: the model's generation
    config's, else vLLM's own default of 1.0."""
    if artifact_dir is not None:
        path = Path(artifact_dir) / "generation_config.json"
        with contextlib.suppress(OSError, ValueError, TypeError):
            value = json.loads(path.read_text()).get("temperature")
            if isinstance(value, int | float):
                return float(value)
    return 1.0


# What a gateway reads of a model's artifact: its tokenizer and generation config. With a store
# that downloads (S3), a gateway fetches only these, never the weights.
TOKENIZER_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json",
})  # fmt: skip
# An artifact whose store failed is asked again only after this long: the routing table is
# rebuilt every second, and a store that is down must not slow each rebuild.
TOKENIZER_RETRY_SECONDS = 60.0
_tokenizer_failed: dict[str, float] = {}


def _tokenizer_dir(artifact_uri: str) -> str | None:
    failed_at = _tokenizer_failed.get(artifact_uri)
    if failed_at is not None and time.monotonic() - failed_at < TOKENIZER_RETRY_SECONDS:
        return None
    try:
        path = str(get_artifact_store().metadata_path(artifact_uri, TOKENIZER_FILES))
    except ArtifactUnavailable as exc:
        if str(exc).startswith("there is no artifact"):  # a model with no files of its own (a fake one)
            return None
        logger.warning("the tokenizer of %s cannot be read now: %s", artifact_uri, exc)  # its store is down
        _tokenizer_failed[artifact_uri] = time.monotonic()
        return None
    except (ValueError, OSError):  # not a URI of this store
        return None
    _tokenizer_failed.pop(artifact_uri, None)
    return path


# A circuit whose probes keep failing rests at most this many times CIRCUIT_OPEN_SECONDS.
CIRCUIT_MAX_BACKOFF = 8


class CircuitBreaker:
    """Per-process, per-replica circuits: closed → open → half-open → closed (or open again).

    After CIRCUIT_FAILURE_THRESHOLD consecutive failures the replica rests (open) for
    CIRCUIT_OPEN_SECONDS. Then it is half-open: ``allow`` lets exactly one request through as
    a probe. Its success closes the circuit (and resets the rest); its failure opens it again
    for twice the previous rest, at most CIRCUIT_MAX_BACKOFF times the first. (Any success
    closes it: a late answer to a request sent before it opened shows the replica is up; a
    late failure while it rests changes nothing.) A probe that
    ends without a verdict (its client left) frees the place at once; one that hangs frees it
    after a rest's length, so a lost probe never shuts a replica out for good.

    ``clock`` is monotonic seconds (tests inject a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._failures: dict[int, int] = defaultdict(int)
        self._open_until: dict[int, float] = {}  # present: open, or half-open once the time has passed
        self._rest: dict[int, float] = {}  # the rest the circuit last opened for
        self._probe_since: dict[int, float] = {}  # half-open with a probe out, since when

    def is_open(self, replica_id: int) -> bool:
        """No request may go to the replica now: it rests, or its one probe is out."""
        until = self._open_until.get(replica_id)
        if until is None:
            return False
        now = self._clock()
        if now < until:
            return True
        probe = self._probe_since.get(replica_id)
        return probe is not None and now - probe < self._rest[replica_id]

    def allow(self, replica_id: int) -> bool:
        """May a request be sent to the replica now? When half-open, this claims the one probe."""
        if self.is_open(replica_id):
            return False
        if replica_id in self._open_until:
            self._probe_since[replica_id] = self._clock()
        return True

    def abandon(self, replica_id: int) -> None:
        """A request sent to the replica ended with no verdict on it (cancelled): if it was the
        probe, the next request may be one."""
        self._probe_since.pop(replica_id, None)

    def record_failure(self, replica_id: int) -> None:
        if replica_id in self._open_until:
            if replica_id in self._probe_since:  # half-open, and the probe failed: rest longer
                rest = min(self._rest[replica_id] * 2, settings.CIRCUIT_OPEN_SECONDS * CIRCUIT_MAX_BACKOFF)
                self._open(replica_id, rest)
            # Resting: a request sent before the circuit opened failing late tells nothing new.
            return
        self._failures[replica_id] += 1
        if self._failures[replica_id] >= settings.CIRCUIT_FAILURE_THRESHOLD:
            self._open(replica_id, settings.CIRCUIT_OPEN_SECONDS)

    def record_success(self, replica_id: int) -> None:
        self._failures.pop(replica_id, None)
        self._open_until.pop(replica_id, None)
        self._rest.pop(replica_id, None)
        self._probe_since.pop(replica_id, None)

    def _open(self, replica_id: int, rest: float) -> None:
        self._open_until[replica_id] = self._clock() + rest
        self._rest[replica_id] = rest
        self._probe_since.pop(replica_id, None)
        self._failures.pop(replica_id, None)


class Lease:
    """A replica held for one request (``Router.lease``): the one way in-flight counts change.

    ``release`` is idempotent, so every owner of a lease (the engine client on a failed
    send, a stream when it closes, the request when it ends) may release it without
    counting twice; ``async with lease:`` releases it at the end of the block.
    """

    __slots__ = ("_released", "_router", "replica")

    def __init__(self, router: Router, replica: ReplicaRoute) -> None:
        self._router = router
        self.replica = replica
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._router._release(self.replica.id)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def _rendezvous_score(model: str, key: str, salt: str, weight: int) -> float:
    """Weighted rendezvous (highest random weight): -weight / ln(u), u a uniform draw in (0, 1)
    fixed by (model, key, salt). The option with the highest score wins; each option's chance
    is its share of the total weight."""
    digest = hashlib.blake2b(f"{model}\0{key}\0{salt}".encode(), digest_size=8).digest()
    # 53 bits, the float's precision: u is never 0 (ln 0) nor 1 (ln 1 = 0).
    u = ((int.from_bytes(digest, "big") >> 11) + 1) / (2**53 + 1)
    return -weight / math.log(u)


@dataclass
class Router:
    """Holds the snapshot, the in-flight counts and the circuits of this process.

    In-flight counts change only through leases (``lease``: a replica held for one request,
    released once), circuits only through ``allow``/``abandon`` and
    ``record_success``/``record_failure``, so every path keeps them balanced.
    """

    table: RoutingTable | None = None
    _in_flight: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    circuits: CircuitBreaker = field(default_factory=CircuitBreaker)
    _loading: asyncio.Future[RoutingTable] | None = None
    _refresher: Worker = field(init=False)
    _listener: Worker = field(init=False)

    def __post_init__(self) -> None:
        self._refresher = Worker(self._refresh_forever, name="routing-refresh")
        self._listener = Worker(self._reload_when_told, name="routing-invalidations")

    def in_flight(self, replica_id: int) -> int:
        return self._in_flight.get(replica_id, 0)

    def lease(self, replica: ReplicaRoute) -> Lease:
        """Hold ``replica`` for one request of this process (counted in flight until released)."""
        self._acquire(replica.id)
        return Lease(self, replica)

    def _acquire(self, replica_id: int) -> None:
        self._in_flight[replica_id] += 1
        metrics.REPLICA_IN_FLIGHT.labels(str(replica_id)).inc()

    def _release(self, replica_id: int) -> None:
        remaining = self._in_flight[replica_id] - 1
        if remaining <= 0:
            self._in_flight.pop(replica_id, None)
        else:
            self._in_flight[replica_id] = remaining
        metrics.REPLICA_IN_FLIGHT.labels(str(replica_id)).dec()

    def record_failure(self, replica_id: int) -> None:
        self.circuits.record_failure(replica_id)

    def record_success(self, replica_id: int) -> None:
        self.circuits.record_success(replica_id)

    def allow(self, replica_id: int) -> bool:
        """May a request be sent to this replica now (its circuit's one probe, when half-open)?"""
        return self.circuits.allow(replica_id)

    def abandon(self, replica_id: int) -> None:
        """A request to this replica ended with no verdict on its health (see CircuitBreaker)."""
        self.circuits.abandon(replica_id)

    async def snapshot(self) -> RoutingTable:
        """The routing table, reloaded in the background every ROUTING_REFRESH_SECONDS.

        Requests keep using the current table while one reload runs; only a table older
        than ROUTING_MAX_STALENESS (or none yet) makes a request wait for the reload.
        Replica liveness is judged by heartbeat time at use, so a slightly old table never
        routes to a replica whose heartbeat has gone stale.
        """
        self._ensure_refresher()
        table = self.table
        if table is not None:
            age = time.monotonic() - table.loaded_at
            if age >= settings.ROUTING_REFRESH_SECONDS:
                self._reload()
            if age < settings.ROUTING_MAX_STALENESS:
                return table
        return await asyncio.shield(self._reload())

    async def fresh_snapshot(self) -> RoutingTable:
        """A table read after this call began (for the rare miss: a model deployed a moment ago).

        Concurrent callers share reads; a read already running when we were called may
        predate the change we are looking for, so we wait for the next one.
        """
        asked = time.monotonic()
        while True:
            table = await asyncio.shield(self._reload())
            if table.loaded_at >= asked:
                return table

    def _ensure_refresher(self) -> None:
        self._refresher.ensure()
        self._listener.ensure()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(settings.ROUTING_REFRESH_SECONDS)
            metrics.GATEWAY_TASKS.set(len(asyncio.all_tasks()))
            try:
                await self._reload()
            except Exception:
                logger.warning("routing table reload failed", exc_info=True)

    async def _reload_when_told(self) -> None:
        # A published change (prices, weights) is applied at once, not at the next refresh.
        while True:
            try:
                pubsub = async_redis().pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(keys.routing_invalidation_channel())
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        await self.fresh_snapshot()
            except Exception:
                logger.warning("routing invalidation subscription lost; reconnecting", exc_info=True)
                await asyncio.sleep(1)

    def _reload(self) -> asyncio.Future[RoutingTable]:
        if self._loading is not None and not self._loading.done():
            return self._loading

        async def load() -> RoutingTable:
            started = time.monotonic()
            try:
                table = replace(await run_db(load_routing_table), loaded_at=started)
            except DatabaseError as exc:
                raise RoutingUnavailable(f"the registry cannot be read: {exc}") from exc
            self.table = table
            return table

        future = unobserved(asyncio.ensure_future(load()))
        self._loading = future
        return future

    def routable(self, version: VersionRoute) -> list[ReplicaRoute]:
        fresh_after = time.time() - settings.REPLICA_STALE_AFTER
        return [r for r in version.replicas if r.heartbeat_at >= fresh_after and not self.circuits.is_open(r.id)]

    def choose_version(self, model: ModelRoute, sticky_key: str, *, version: str | None = None) -> VersionRoute | None:
        """The version to serve a request, among those with a routable replica; None: none can.

        Weighted rendezvous hashing of ``sticky_key``: every candidate version scores
        -weight / ln(u), u drawn from hash(model, key, version id), and the highest wins. A
        key keeps its version while the candidates stay the same; a weight change moves only
        the keys it must, from the versions that lose weight to the ones that gain it; a
        version that becomes unroutable moves only its own keys (and gets them back after).

        ``version`` pins the request to that version string, whatever its weight (a candidate
        under test may have 0). Unpinned, with no weighted version routable, any routable
        version serves.
        """
        if version is not None:
            candidates = [v for v in model.versions if v.version == version and self.routable(v)]
        else:
            candidates = [v for v in model.versions if v.weight > 0 and self.routable(v)]
            if not candidates:
                fallback = [v for v in model.versions if self.routable(v)]
                return fallback[0] if fallback else None
        if not candidates:
            return None
        # Hashed by version, not deployment: a version served by two deployments keeps its keys
        # whichever of them come and go; the deployment is chosen among that version's after.
        weights: dict[int, int] = defaultdict(int)
        for candidate in candidates:
            weights[candidate.id] += candidate.weight
        chosen = max(weights, key=lambda vid: _rendezvous_score(model.name, sticky_key, f"v{vid}", weights[vid]))
        deployments = [v for v in candidates if v.id == chosen]
        if len(deployments) == 1:
            return deployments[0]
        return max(
            deployments,
            key=lambda v: _rendezvous_score(model.name, sticky_key, f"d{v.deployment_id}", max(v.weight, 1)),
        )

    def fallback_version(self, model: ModelRoute, failed: VersionRoute) -> VersionRoute | None:
        """Where a request goes when ``failed`` could not answer it: the model's base version,
        the routable version (other than ``failed``'s) carrying the most traffic weight, the
        older on a tie (a canary's base, the stable arm of a split); None when there is none."""
        weights: dict[str, int] = defaultdict(int)
        for candidate in model.versions:
            weights[candidate.version] += candidate.weight
        others = [v for v in model.versions if v.version != failed.version and self.routable(v)]
        if not others:
            return None
        return max(others, key=lambda v: (weights[v.version], -v.id, len(self.routable(v))))

    def replica_order(self, version: VersionRoute) -> list[ReplicaRoute]:
        """Replicas to try, best first: fewest requests in flight from this process."""
        replicas = self.routable(version)
        random.shuffle(replicas)  # break ties without always favouring the same replica
        return sorted(replicas, key=lambda r: self.in_flight(r.id))

    async def prefix_order(self, model: str, version: VersionRoute, blocks: Sequence[bytes]) -> list[ReplicaRoute]:
        """Replicas to try for a prompt starting with ``blocks`` (``serving.gateway.prefixes``),
        best first: the one most likely to hold its longest prefix in its KV cache, unless it is
        busier than the load bound allows, then the rest least busy first. Only the replica
        changes: ``version`` was chosen before, as for any request. With ROUTING_PREFIX_AWARE
        off, no full block, one replica, or an external upstream's: ``replica_order``. Never
        fails for Redis (the lookup's failure routes by what this process knows, else by load).
        """
        how = "load"
        order = self.replica_order(version)
        if settings.ROUTING_PREFIX_AWARE and blocks and len(order) > 1 and all(r.upstream is None for r in order):
            held_by_cache = await prefix_memory.held([r.kv_cache for r in order], blocks)
            order = [r for r in self.replica_order(version) if r.kv_cache in held_by_cache]  # the loads as now
            order, by_prefix = prefer_by_prefix(
                order,
                [held_by_cache[r.kv_cache] for r in order],
                [self.in_flight(r.id) for r in order],
                max_imbalance=settings.ROUTING_PREFIX_MAX_IMBALANCE,
            )
            how = "prefix" if by_prefix else how
        metrics.PREFIX_ROUTING.labels(model, how).inc()
        return order


router = Router()


async def routing_table(*, fresh: bool = False) -> RoutingTable:
    try:
        return await (router.fresh_snapshot() if fresh else router.snapshot())
    except RoutingUnavailable as exc:
        logger.error("routing unavailable: %s", exc)
        raise EngineUnavailable(
            "The model registry cannot be read right now; try again shortly.", code="routing_unavailable"
        ) from exc


async def find_model(name: str) -> ModelRoute:
    model = (await routing_table()).models.get(name)
    if model is None:  # deployed a moment ago? one fresh read before saying no
        model = (await routing_table(fresh=True)).models.get(name)
    if model is None:
        raise ModelNotFound(name)
    return model
