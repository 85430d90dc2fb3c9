"""The data plane's gateway (serving): engine client, request bodies, routing, circuit
breakers, backpressure, limits, API keys, /metrics, /readyz and the gateways' heartbeat."""

from __future__ import annotations

import os

from .env import envbool, envfloat, envint, envlist

# --- Engine client -------------------------------------------------------------------------
#: How long connecting to an engine replica may take (seconds).
ENGINE_CONNECT_TIMEOUT = envfloat("ENGINE_CONNECT_TIMEOUT", 2.0)
#: How long an engine may take to send its first token (seconds).
ENGINE_FIRST_TOKEN_TIMEOUT = envfloat("ENGINE_FIRST_TOKEN_TIMEOUT", 30.0)
#: How long one engine request may take in all (seconds).
ENGINE_REQUEST_TIMEOUT = envfloat("ENGINE_REQUEST_TIMEOUT", 600.0)
#: Further tries of an engine connection that failed (a count).
ENGINE_CONNECT_RETRIES = envint("ENGINE_CONNECT_RETRIES", 2)
# A request whose engine fails before its first byte reaches the client is retried once, on
# another replica of its version or the model's base version (serving.llm.call).
#: Whether a request whose engine failed before answering is retried once elsewhere (a bool).
ENGINE_FALLBACK = envbool("ENGINE_FALLBACK", "true")

# --- Requests and clients ------------------------------------------------------------------
# Larger ones get 413 before they are read.
#: The largest /v1 request body accepted (bytes).
API_MAX_BODY_BYTES = envint("API_MAX_BODY_BYTES", 4 * 1024 * 1024)
# Each a gateway of its own (console.servers).
#: uvicorn processes serving the one port (a count, at least 1).
GATEWAY_PROCESSES = max(1, envint("GATEWAY_PROCESSES", 1))
# Behind a load balancer: on SIGTERM the gateway first answers /readyz with 503 ("draining")
# for this long while it keeps serving, so the balancer's health checks take it out before it
# closes its socket; then it stops as usual (requests in flight finish). Set it to the
# balancer's check interval times its fall count, plus a margin. 0: stop at once.
#: How long a stopping gateway stays up, failing /readyz, before it stops (seconds).
GATEWAY_DRAIN_SECONDS = envfloat("GATEWAY_DRAIN_SECONDS", 0.0)
# The data plane reads bodies itself.
#: Django's own body limit for the console and admin (bytes; = API_MAX_BODY_BYTES).
DATA_UPLOAD_MAX_MEMORY_SIZE = API_MAX_BODY_BYTES
# Bodies larger than this have their prompt counted in one of PROMPT_COUNT_THREADS worker
# threads, off the event loop, after paying their place in the key's per-minute request bucket.
#: Bodies up to this size have their prompt counted on the event loop (bytes).
PROMPT_COUNT_INLINE_BYTES = envint("PROMPT_COUNT_INLINE_BYTES", 32 * 1024)
#: Worker threads that count larger bodies' prompts (a count).
PROMPT_COUNT_THREADS = envint("PROMPT_COUNT_THREADS", 2)
# /metrics answers clients on these networks (the monitoring network), and anyone presenting
# "Authorization: Bearer <METRICS_TOKEN>" when a token is set; everyone else gets 403.
#: Networks /metrics answers without a token (a comma-separated list of CIDRs).
METRICS_ALLOWED_NETWORKS = envlist("METRICS_ALLOWED_NETWORKS", "127.0.0.0/8,::1/128")
#: The bearer token that opens /metrics from anywhere (a string; empty: none).
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "")
# The client stopped reading: the request ends as the client going away (499), so it never
# holds its place in flight for long.
#: How long a write to a client may wait (seconds).
CLIENT_SEND_TIMEOUT = envfloat("CLIENT_SEND_TIMEOUT", 30.0)
# Each is still charged to its key's limits.
#: Requests that may run at once on one WebSocket (a count).
WS_MAX_REQUESTS_PER_SOCKET = envint("WS_MAX_REQUESTS_PER_SOCKET", 256)

# --- Routing, circuit breakers, backpressure -----------------------------------------------
# Three missed beats of WORKER_HEARTBEAT_SECONDS (3 s), so a replica whose supervisor died
# leaves routing within 9 s. It is also how long a database outage the supervisors'
# heartbeats may ride out.
#: A replica is routed to only while its heartbeat is younger than this (seconds).
REPLICA_STALE_AFTER = envfloat("REPLICA_STALE_AFTER", 9.0)
#: How often a gateway reloads its routing table (seconds).
ROUTING_REFRESH_SECONDS = envfloat("ROUTING_REFRESH_SECONDS", 1.0)
#: The oldest routing table a gateway routes by without waiting for a reload (seconds).
ROUTING_MAX_STALENESS = envfloat("ROUTING_MAX_STALENESS", 10.0)
#: How long a gateway caches an API key's lookup (seconds).
API_KEY_CACHE_SECONDS = envfloat("API_KEY_CACHE_SECONDS", 1.0)
#: Consecutive failures that open a replica's circuit breaker (a count).
CIRCUIT_FAILURE_THRESHOLD = envint("CIRCUIT_FAILURE_THRESHOLD", 3)
#: How long an open circuit stays open before a trial request (seconds).
CIRCUIT_OPEN_SECONDS = envfloat("CIRCUIT_OPEN_SECONDS", 10.0)
# Prefix-aware routing (serving.gateway.prefixes): among the replicas of the version a chat or
# completion request was routed to, prefer the one most likely to hold its prompt's leading
# blocks in its KV cache, unless that replica has more than its share of this gateway's requests
# in flight: ceil(ROUTING_PREFIX_MAX_IMBALANCE x (in flight + 1) / replicas), the bounded-load
# rule. Off by default (bench/prefix_routing.py on two real replicas, docs/performance.md:
# TTFT p50 1.05-1.25x better and more prefix-cache hits, but a worse p99 in one of two runs): the
# least busy replica, as before.
#: Whether chat and completion requests prefer the replica holding their prompt's prefix (a bool).
ROUTING_PREFIX_AWARE = envbool("ROUTING_PREFIX_AWARE", "false")
#: How far above its fair share of requests in flight a replica may be and still be preferred (a factor).
ROUTING_PREFIX_MAX_IMBALANCE = envfloat("ROUTING_PREFIX_MAX_IMBALANCE", 1.5)
# vLLM's default on GPUs (its CPU backend uses 128: a finer block here still finds the prefix).
#: Tokens per hashed prompt block, as the engines' KV cache blocks (a count).
ROUTING_PREFIX_BLOCK_TOKENS = envint("ROUTING_PREFIX_BLOCK_TOKENS", 16)
#: A replica's remembered block hashes are forgotten this long after it was last sent them (seconds).
ROUTING_PREFIX_TTL_SECONDS = envfloat("ROUTING_PREFIX_TTL_SECONDS", 600.0)
#: The most block hashes remembered per replica, newest kept (a count).
ROUTING_PREFIX_BLOCKS_PER_REPLICA = envint("ROUTING_PREFIX_BLOCKS_PER_REPLICA", 65536)
# Backpressure: a model refuses a tier's new requests once this many per routable replica
# are in flight across all gateways (free first, then paid); nothing queues unboundedly.
#: Free-tier requests in flight per routable replica before new ones are refused (a count).
BACKPRESSURE_FREE_PER_REPLICA = envint("BACKPRESSURE_FREE_PER_REPLICA", 48)
#: Paid-tier requests in flight per routable replica before new ones are refused (a count).
BACKPRESSURE_PAID_PER_REPLICA = envint("BACKPRESSURE_PAID_PER_REPLICA", 128)
# Month boundaries in tests; never in production.
#: Whether the limiter's clock may be moved through a Redis key (a bool; tests only).
LIMITS_TEST_CLOCK = envbool("LIMITS_TEST_CLOCK", "false")
#: Models /readyz waits for a routable replica of (a comma-separated list of model names).
READY_MODELS = envlist("READY_MODELS", "smollm2-135m-instruct,all-minilm-l6-v2")

# --- Gateways' heartbeat -------------------------------------------------------------------
# An in-flight request whose gateway stopped heart-beating GATEWAY_LOST_AFTER ago is closed
# by the sweeper.
#: How often a gateway heart-beats (seconds).
GATEWAY_HEARTBEAT_SECONDS = envfloat("GATEWAY_HEARTBEAT_SECONDS", 5.0)
#: A gateway silent this long is lost, and its requests in flight are closed (seconds).
GATEWAY_LOST_AFTER = envfloat("GATEWAY_LOST_AFTER", 20.0)
