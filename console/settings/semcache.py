"""The semantic cache (serving/semcache) and the embeddings' exact-match cache."""

from __future__ import annotations

import os

from core import embedded

from .env import envbool, envfloat, envint

#: Whether chat and completion answers may be served from the semantic cache (a bool).
SEMANTIC_CACHE_ENABLED = envbool("SEMANTIC_CACHE_ENABLED", "true")
# 384 dimensions: serving.models.CacheEntry.
#: The model that embeds prompts for the cache (a model name).
SEMANTIC_CACHE_EMBEDDING_MODEL = os.environ.get("SEMANTIC_CACHE_EMBEDDING_MODEL", "all-minilm-l6-v2")
#: Embedding + search + verification must finish within this, or the request is a miss (seconds).
SEMANTIC_CACHE_LOOKUP_TIMEOUT = envfloat("SEMANTIC_CACHE_LOOKUP_TIMEOUT", 0.5)
# A guard: docs/architecture.md, "Verification".
#: Candidates below this cosine similarity are never verified (a cosine, 0 to 1).
SEMANTIC_CACHE_MIN_SIMILARITY = envfloat("SEMANTIC_CACHE_MIN_SIMILARITY", 0.60)
#: The share of wrong hits the verifier is calibrated to stay under (a fraction).
SEMANTIC_CACHE_WRONG_HIT_BUDGET = envfloat("SEMANTIC_CACHE_WRONG_HIT_BUDGET", 0.01)
# The error budget's prior (serving.semcache.budget): the verifier on held-out sources,
# 585 semantic hits served of which 1 was a trap (bench/semantic_cache_sources.py, 2026-11-26).
#: The error budget's prior: semantic hits served (a count).
SEMANTIC_CACHE_PRIOR_SERVED = envfloat("SEMANTIC_CACHE_PRIOR_SERVED", 585)
#: The error budget's prior: of those, wrong hits (a count).
SEMANTIC_CACHE_PRIOR_WRONG = envfloat("SEMANTIC_CACHE_PRIOR_WRONG", 1)
#: The share of would-be hits of an open tier answered by the engine and compared (a fraction).
SEMANTIC_CACHE_AUDIT_RATE = envfloat("SEMANTIC_CACHE_AUDIT_RATE", 0.02)
# And whose numbers match.
#: Two answers whose embeddings' cosine reaches this agree in an audit (a cosine, 0 to 1).
SEMANTIC_CACHE_AUDIT_AGREEMENT = envfloat("SEMANTIC_CACHE_AUDIT_AGREEMENT", 0.90)
#: How long a served cache answer can be reported wrong through POST /v1/cache/feedback (seconds).
SEMANTIC_CACHE_FEEDBACK_WINDOW_SECONDS = envint("SEMANTIC_CACHE_FEEDBACK_WINDOW_SECONDS", 7 * 86400)
#: Feedback tightens the reported entry and those of its scope at least this similar to it (a cosine).
SEMANTIC_CACHE_FEEDBACK_NEIGHBOUR_SIMILARITY = envfloat("SEMANTIC_CACHE_FEEDBACK_NEIGHBOUR_SIMILARITY", 0.90)
# Defaults for models without a CachePolicy row.
#: The highest sampling temperature a request may have to use the cache (a temperature).
SEMANTIC_CACHE_MAX_TEMPERATURE = envfloat("SEMANTIC_CACHE_MAX_TEMPERATURE", 0.5)
#: The longest prompt the cache handles (tokens).
SEMANTIC_CACHE_MAX_PROMPT_TOKENS = envint("SEMANTIC_CACHE_MAX_PROMPT_TOKENS", 2000)
#: How long a cache entry lives (seconds).
SEMANTIC_CACHE_TTL_SECONDS = envint("SEMANTIC_CACHE_TTL_SECONDS", 3600)
# The store's search (serving/semcache/store.py; figures in docs/performance.md): scopes of up
# to this many entries are searched exactly, larger ones through the HNSW index with
# pgvector's iterative scan (this many candidates per step, this order, at most this many
# tuples visited).
#: Scopes of up to this many entries are searched exactly, not through HNSW (a count).
SEMANTIC_CACHE_EXACT_MAX_ENTRIES = envint("SEMANTIC_CACHE_EXACT_MAX_ENTRIES", 5000)
#: pgvector's hnsw.ef_search: candidates per step (a count).
SEMANTIC_CACHE_HNSW_EF_SEARCH = envint("SEMANTIC_CACHE_HNSW_EF_SEARCH", 40)
#: pgvector's hnsw.iterative_scan: "relaxed_order", "strict_order" or "off".
SEMANTIC_CACHE_HNSW_ITERATIVE_SCAN = os.environ.get("SEMANTIC_CACHE_HNSW_ITERATIVE_SCAN", "relaxed_order")
#: pgvector's hnsw.max_scan_tuples: the most tuples one search visits (a count).
SEMANTIC_CACHE_HNSW_MAX_SCAN_TUPLES = envint("SEMANTIC_CACHE_HNSW_MAX_SCAN_TUPLES", 20_000)
# A search statement is cancelled after this long (a miss); at most this many cache calls per
# process wait on the database at once, and after a failure none is tried for this long.
#: A search statement is cancelled after this long, and is a miss (milliseconds).
SEMANTIC_CACHE_SEARCH_TIMEOUT_MS = envint("SEMANTIC_CACHE_SEARCH_TIMEOUT_MS", 250)
#: Cache calls per process that may wait on the database at once (a count).
SEMANTIC_CACHE_MAX_DB_CALLS = envint("SEMANTIC_CACHE_MAX_DB_CALLS", 4)
#: After a database failure, no cache call is tried for this long (seconds).
SEMANTIC_CACHE_RETRY_AFTER = envfloat("SEMANTIC_CACHE_RETRY_AFTER", 5.0)
# Built by `manage.py build_cache_verifier` (bootstrap runs it) from MiniLM and the shipped tuned
# weights: serving/semcache/paraphrase.py, verifier_build.py.
#: Where the paraphrase tier's local models (embedder, cross-encoder, calibration) are built (a folder).
SEMANTIC_CACHE_VERIFIER_DIR = os.environ.get("SEMANTIC_CACHE_VERIFIER_DIR", str(embedded.VAR_DIR / "semcache-verifier"))
#: How long embeddings requests' answers stay in their exact-match cache in Redis (seconds).
EMBEDDINGS_CACHE_TTL_SECONDS = envint("EMBEDDINGS_CACHE_TTL_SECONDS", 3600)

# The paraphrase tier (serving/semcache/paraphrase.py, bound.py): prompts worded otherwise,
# found by their embedding's nearest neighbours and judged by the learned verifier.
#: Whether models without a cache policy row serve paraphrases (a bool; a policy row says per model).
SEMANTIC_CACHE_PARAPHRASES = envbool("SEMANTIC_CACHE_PARAPHRASES", "false")
#: Nearest entries of the scope the verifier judges per lookup (a count).
SEMANTIC_CACHE_PARAPHRASE_CANDIDATES = envint("SEMANTIC_CACHE_PARAPHRASE_CANDIDATES", 2)
#: Entries less similar than this (embedding cosine) are not judged at all (0-1).
SEMANTIC_CACHE_PARAPHRASE_MIN_SIMILARITY = envfloat("SEMANTIC_CACHE_PARAPHRASE_MIN_SIMILARITY", 0.5)
#: The share of would-be paraphrase hits the engine answers instead, to test the entry's threshold (0-1).
SEMANTIC_CACHE_PARAPHRASE_EXPLORE_RATE = envfloat("SEMANTIC_CACHE_PARAPHRASE_EXPLORE_RATE", 0.05)
#: How many observations the offline calibration counts for in an entry's estimate (serving.semcache.bound).
SEMANTIC_CACHE_PARAPHRASE_PRIOR_WEIGHT = envfloat("SEMANTIC_CACHE_PARAPHRASE_PRIOR_WEIGHT", 20)
# The paraphrase tier alone on the three held-out sources at δ 1 % (bench/semantic_cache_paraphrase.py
# --held-out, 2026-11-29): 71 pairs served that the word tiers had not, 2 of them traps. At a
# 1 % budget that prior keeps the tier closed (every would-be hit audited) until its own audits
# show otherwise.
#: The paraphrase tier's prior in the error budget: would-be hits judged offline (a count) …
SEMANTIC_CACHE_PARAPHRASE_PRIOR_SERVED = envfloat("SEMANTIC_CACHE_PARAPHRASE_PRIOR_SERVED", 71)
#: … and of those, how many were wrong (a count).
SEMANTIC_CACHE_PARAPHRASE_PRIOR_WRONG = envfloat("SEMANTIC_CACHE_PARAPHRASE_PRIOR_WRONG", 2)
