"""The Files API (serving.batches.files), batch jobs (serving.batches) and webhooks (serving.batches.webhooks)."""

from __future__ import annotations

import os

from .env import envbool, envfloat, envint

# --- Files API (/v1/files, serving.batches.files) --------------------------------------------------
#: The largest file upload (bytes).
FILES_MAX_BYTES = envint("FILES_MAX_BYTES", 100 * 1024 * 1024)
#: The most requests in one uploaded batch input file (a count of lines).
FILES_MAX_LINES = envint("FILES_MAX_LINES", 50_000)
# OpenAI keeps them 30 days.
#: How long batch output and error files are kept before they are deleted (days).
FILES_OUTPUT_RETENTION_DAYS = envint("FILES_OUTPUT_RETENTION_DAYS", 30)
# Unless a batch that has not finished still reads them (then once it has).
#: How long after its upload a batch input file is deleted (days).
FILES_INPUT_RETENTION_DAYS = envint("FILES_INPUT_RETENTION_DAYS", 30)
# What one organisation may keep in the Files API, every purpose together (its batches' output
# and error files count; only uploads are refused past it: 403 storage_quota_exceeded).
#: The most one organisation may keep in the Files API (bytes).
FILES_ORG_MAX_BYTES = envint("FILES_ORG_MAX_BYTES", 10 * 1024**3)
#: The most files one organisation may keep in the Files API (a count).
FILES_ORG_MAX_FILES = envint("FILES_ORG_MAX_FILES", 10_000)

# --- Batch jobs (serving.batches) ----------------------------------------------------------
# OpenAI's is "24h"; more may be offered as "<n>h".
#: The completion windows a batch may ask for (a comma-separated list such as "24h").
BATCH_COMPLETION_WINDOWS = tuple(os.environ.get("BATCH_COMPLETION_WINDOWS", "24h").split(","))
#: Lines an organisation may have waiting or running in its unfinished batches, all together (a count).
BATCH_MAX_ENQUEUED_LINES = envint("BATCH_MAX_ENQUEUED_LINES", 200_000)
# Each interactive request in flight on the model takes a replica's share back.
#: A worker's lines in flight per routable replica of a model no interactive request holds (a count).
BATCH_SLOTS_PER_REPLICA = envint("BATCH_SLOTS_PER_REPLICA", 4)
# After a model's interactive requests were last seen in flight, batch lines wait this long
# before taking its replicas again (the gap between two requests is not idle capacity).
#: How long batch lines keep off a model after its last interactive request (seconds).
BATCH_YIELD_SECONDS = envfloat("BATCH_YIELD_SECONDS", 2.0)
# 0 (the default) lets a batch wait out interactive traffic (within its completion window);
# 1 keeps it moving, slowly.
#: Lines of a model kept in flight whatever the interactive load (a count).
BATCH_MIN_SLOTS = envint("BATCH_MIN_SLOTS", 0)
# Lines beyond the share when interactive requests arrive stop at once (their engine request
# is cancelled, vLLM aborts it) and run again later, uncounted as a failure. A model's first
# interactive request is published at its admission (serving.batches.worker.listen_for_arrivals);
# the poll below is the fallback.
#: Whether batch lines beyond their share are preempted for interactive requests (a bool).
BATCH_PREEMPT = envbool("BATCH_PREEMPT", "true")
#: How often a worker with lines in flight looks for interactive requests on their models (seconds).
BATCH_YIELD_POLL_SECONDS = envfloat("BATCH_YIELD_POLL_SECONDS", 0.05)
# Renewed while the line runs. A line whose claim ran out (its worker died) is given back and
# run again.
#: How long a worker's claim on a running line lasts (seconds).
BATCH_LEASE_SECONDS = envfloat("BATCH_LEASE_SECONDS", 30.0)
#: How many times a line is tried when its engine fails (5xx, gone) before it fails (a count).
BATCH_MAX_ATTEMPTS = envint("BATCH_MAX_ATTEMPTS", 5)
#: How long one batch_work run goes on before it hands over to the next tick (seconds).
BATCH_WORK_SECONDS = envfloat("BATCH_WORK_SECONDS", 50.0)
# Interactive requests have 0; lower runs first. Sent only while the engines run with
# --scheduling-policy priority (ENGINE_SCHEDULING_POLICY).
#: vLLM's request priority for batch lines (an integer).
BATCH_ENGINE_PRIORITY = envint("BATCH_ENGINE_PRIORITY", 10)

# --- Webhooks (serving.batches.webhooks) -----------------------------------------------------------
# E.g. an internal receiver.
#: Host names webhooks may go to whatever they resolve to (a comma-separated list).
WEBHOOK_ALLOWED_HOSTS = tuple(h for h in os.environ.get("WEBHOOK_ALLOWED_HOSTS", "").split(",") if h)
#: Whether webhooks may go to private, loopback or link-local addresses (a bool; never by default).
WEBHOOK_ALLOW_PRIVATE_ADDRESSES = envbool("WEBHOOK_ALLOW_PRIVATE_ADDRESSES", "false")
#: How long one webhook delivery may take (seconds).
WEBHOOK_TIMEOUT = envfloat("WEBHOOK_TIMEOUT", 10.0)
# Retries: BACKOFF * 2**(attempt-1) seconds apart, at most an hour, until MAX_ATTEMPTS.
#: The first retry's delay; each later one doubles it (seconds).
WEBHOOK_BACKOFF_SECONDS = envfloat("WEBHOOK_BACKOFF_SECONDS", 10.0)
#: Deliveries tried before a webhook is given up (a count).
WEBHOOK_MAX_ATTEMPTS = envint("WEBHOOK_MAX_ATTEMPTS", 8)
# What docs/webhooks.md tells receivers.
#: A receiver refuses a signature older than this (seconds).
WEBHOOK_TOLERANCE_SECONDS = envint("WEBHOOK_TOLERANCE_SECONDS", 300)
