"""Shadow traffic: copies of a share of a model's requests sent to a candidate version.

A model's ``ShadowPolicy`` (in the routing snapshot as ``ModelRoute.shadow``) names a
candidate version and a percentage. ``mirror`` is called by the LLM call as it hands an
admitted request that the cache did not answer to the engine client. For the chosen share
of requests (by a hash of the request id, so a retried or replayed decision is the same) it
starts a task of its own that sends the same payload to a routable replica of the
candidate through the same engine client, reads the answer and discards it, and keeps its
figures as a ``ShadowRecord``. It never waits, never raises, and touches nothing of the
customer's request: no ledger call (no limits, budget, usage record or invoice line), no
cache store. A primary that streams is mirrored as a stream (for time to first token).

Each process runs at most ``MAX_IN_FLIGHT`` copies at once; a copy beyond that is dropped,
not queued (counted as ``dropped``), so a slow or hanging candidate costs at most that many
connections and never builds a backlog. Records are written in batches off the loop; ones
still buffered when the process stops are lost (they are comparison figures, not billing).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson
from django.conf import settings
from django.db import DatabaseError

from core.db import run_db
from core.lifecycle import Background, Worker
from serving.gateway import engine, metrics
from serving.gateway.errors import APIError, EngineFailed
from serving.gateway.openai_wire import finish_reason_of, note_finish_reasons
from serving.gateway.routing import ModelRoute, ReplicaRoute, VersionRoute, router
from serving.shadow.models import ShadowRecord

logger = logging.getLogger(__name__)

# Copies in flight per process, at most; more are dropped (see the module docstring).
MAX_IN_FLIGHT = 8
# Records are written at most this long after their copy ended, in batches of up to BATCH.
FLUSH_SECONDS = 0.5
BATCH = 500
# Records waiting for the database, at most (it may be away): beyond that they are dropped.
MAX_BUFFERED = 10_000


def selected(request_id: uuid.UUID, basis_points: int) -> bool:
    """Is this request among the ``basis_points`` of 10,000 that are copied? Deterministic."""
    digest = hashlib.blake2b(request_id.bytes, digest_size=8, person=b"shadow").digest()
    return int.from_bytes(digest, "big") % 10_000 < basis_points


class Shadows:
    """This process's copies in flight and the records waiting to be written."""

    def __init__(self) -> None:
        self._running = Background()
        self._buffer: list[ShadowRecord] = []
        self._writer = Worker(self._write, name="shadow-records")

    def mirror(
        self,
        *,
        model: ModelRoute,
        primary: VersionRoute,
        request_id: uuid.UUID,
        endpoint: str,
        path: str,
        payload: dict[str, Any],
        stream: bool,
    ) -> None:
        """Copy the request to the model's shadow candidate if it is one of the chosen share.

        Returns at once and never raises: whatever happens to the copy is its own business.
        """
        try:
            self._mirror(model, primary, request_id, endpoint, path, payload, stream)
        except Exception:
            logger.exception("shadow copy of %s not started", request_id)

    def _mirror(
        self,
        model: ModelRoute,
        primary: VersionRoute,
        request_id: uuid.UUID,
        endpoint: str,
        path: str,
        payload: dict[str, Any],
        stream: bool,
    ) -> None:
        rule = model.shadow
        if rule is None or rule.version_id == primary.id or not selected(request_id, rule.basis_points):
            return
        # The candidate's replicas, over every deployment of it, least busy first.
        candidates = [v for v in model.versions if v.id == rule.version_id]
        replicas = sorted(
            (r for v in candidates for r in router.replica_order(v)), key=lambda r: router.in_flight(r.id)
        )
        if not replicas:
            metrics.SHADOW_REQUESTS.labels(model.name, rule.version, "unroutable").inc()
            return
        if len(self._running) >= MAX_IN_FLIGHT:
            metrics.SHADOW_REQUESTS.labels(model.name, rule.version, "dropped").inc()
            return
        copy = ShadowRecord(
            request_id=request_id,
            model=model.name,
            candidate_version=rule.version,
            primary_version=primary.version,
            endpoint=endpoint,
            stream=stream,
            status_code=0,
            latency_ms=0,
            created_at=datetime.now(UTC),
        )
        self._running.spawn(self._run(copy, replicas, path, dict(payload)), what=f"mirror {request_id}")

    def mirror_predict(
        self,
        *,
        model: ModelRoute,
        primary: VersionRoute,
        request_id: uuid.UUID,
        endpoint: str,
        body: engine.RawBody,
        primary_labels: Any,
    ) -> None:
        """A small model's request, copied once the primary answered: the candidate's labels
        are compared with the primary's, item by item (``ShadowRecord.agreements``)."""
        try:
            rule = model.shadow
            if rule is None or rule.version_id == primary.id or not selected(request_id, rule.basis_points):
                return
            candidate = next((v for v in model.versions if v.id == rule.version_id), None)
            if candidate is None or candidate.signature is None:
                metrics.SHADOW_REQUESTS.labels(model.name, rule.version, "unroutable").inc()
                return
            replicas = sorted(router.replica_order(candidate), key=lambda r: router.in_flight(r.id))
            if not replicas:
                metrics.SHADOW_REQUESTS.labels(model.name, rule.version, "unroutable").inc()
                return
            if len(self._running) >= MAX_IN_FLIGHT:
                metrics.SHADOW_REQUESTS.labels(model.name, rule.version, "dropped").inc()
                return
            copy = ShadowRecord(
                request_id=request_id, model=model.name, candidate_version=rule.version,
                primary_version=primary.version, endpoint=endpoint, stream=False, status_code=0, latency_ms=0,
                created_at=datetime.now(UTC),
            )  # fmt: skip
            path = f"/v2/models/{model.name}/versions/{candidate.version}/infer"
            self._running.spawn(
                self._run(copy, replicas, path, body, compare=(candidate, primary_labels)),
                what=f"mirror {request_id}",
            )
        except Exception:
            logger.exception("shadow copy of %s not started", request_id)

    async def _run(
        self,
        record: ShadowRecord,
        replicas: list[ReplicaRoute],
        path: str,
        payload: dict[str, Any] | engine.RawBody,
        *,
        compare: tuple[VersionRoute, Any] | None = None,
    ) -> None:
        started = time.perf_counter()
        try:
            async with asyncio.timeout(settings.ENGINE_REQUEST_TIMEOUT):
                if compare is not None and isinstance(payload, engine.RawBody):
                    await self._predict(record, replicas, path, payload, *compare)
                elif isinstance(payload, engine.RawBody):
                    raise TypeError("a raw body is a predict request")
                elif record.stream:
                    await self._stream(record, replicas, path, payload, started)
                else:
                    await self._json(record, replicas, path, payload)
            record.status_code, outcome = 200, "ok"
        except TimeoutError:
            record.status_code, outcome = 504, "timeout"
            record.error = f"no complete answer within {settings.ENGINE_REQUEST_TIMEOUT:g} s"
        except APIError as exc:
            record.status_code, outcome, record.error = exc.status, "error", exc.message
        except Exception as exc:  # a copy's failure is its record, never the customer's
            logger.warning("shadow copy of %s failed", record.request_id, exc_info=True)
            record.status_code, outcome, record.error = 500, "error", repr(exc)
        record.latency_ms = int((time.perf_counter() - started) * 1000)
        record.error = record.error[:1000]
        metrics.SHADOW_REQUESTS.labels(record.model, record.candidate_version, outcome).inc()
        self._keep(record)

    async def _predict(
        self,
        record: ShadowRecord,
        replicas: list[ReplicaRoute],
        path: str,
        body: engine.RawBody,
        candidate: VersionRoute,
        primary_labels: Any,
    ) -> None:
        from serving.gateway.inference_protocol import decode_outputs, read_body

        lease, answer = await engine.dispatch(router, replicas, path, body, stream=False)
        async with lease:
            assert candidate.signature is not None
            outputs = decode_outputs(candidate.signature, read_body(answer.content, answer.inference_header))
        record.inferences, record.agreements = agreement(primary_labels, outputs)

    async def _json(
        self, record: ShadowRecord, replicas: list[ReplicaRoute], path: str, payload: dict[str, Any]
    ) -> None:
        lease, response = await engine.dispatch(router, replicas, path, payload, stream=False)
        async with lease:
            data = engine.parse_json(router, lease.replica, response.content)
        _take_usage(record, data.get("usage"))
        reasons: dict[int, str] = {}
        note_finish_reasons(reasons, data.get("choices"))
        record.finish_reason = finish_reason_of(reasons)

    async def _stream(
        self, record: ShadowRecord, replicas: list[ReplicaRoute], path: str, payload: dict[str, Any], started: float
    ) -> None:
        upstream = await engine.open_stream(router, replicas, path, payload)
        reasons: dict[int, str] = {}
        try:
            async for event in upstream:
                if event is engine.DONE:
                    break
                if "error" in event:
                    raise engine.engine_error(500, orjson.dumps(event))
                _take_usage(record, event.get("usage"))
                if record.ttft_ms is None and record.completion_tokens > 0:
                    record.ttft_ms = int((time.perf_counter() - started) * 1000)
                note_finish_reasons(reasons, event.get("choices"))
            else:
                raise EngineFailed("The engine closed the stream before it finished.")
        finally:
            record.finish_reason = finish_reason_of(reasons)
            await upstream.aclose()  # releases its replica

    # --- records -------------------------------------------------------------------------

    def _keep(self, record: ShadowRecord) -> None:
        if len(self._buffer) >= MAX_BUFFERED:
            logger.warning("shadow record of %s dropped: %d already wait for the database", record.request_id,
                           len(self._buffer))  # fmt: skip
            return
        self._buffer.append(record)
        self._writer.ensure()

    async def _write(self) -> None:
        await asyncio.sleep(FLUSH_SECONDS)  # let a batch gather
        while self._buffer:
            batch, self._buffer = self._buffer[:BATCH], self._buffer[BATCH:]
            try:
                await run_db(ShadowRecord.objects.bulk_create, batch, ignore_conflicts=True)
            except DatabaseError:
                logger.warning("could not write %d shadow records", len(batch), exc_info=True)


def predicted_labels(outputs: dict[str, Any]) -> Any:
    """What a small model predicted per item: its ``label`` output, else the argmax of its
    first output (scores or probabilities)."""
    import numpy as np

    if "label" in outputs:
        return np.asarray(outputs["label"]).reshape(len(outputs["label"]), -1)
    first = np.asarray(next(iter(outputs.values())))
    return first.reshape(len(first), -1).argmax(axis=1).reshape(-1, 1)


def agreement(primary_labels: Any, candidate_outputs: dict[str, Any]) -> tuple[int, int]:
    """(items, items on which the candidate predicted what the primary did)."""
    import numpy as np

    theirs = predicted_labels(candidate_outputs)
    ours = np.asarray(primary_labels)
    if theirs.shape != ours.shape:
        return len(ours), 0
    return len(ours), int((theirs == ours).all(axis=1).sum())


def _take_usage(record: ShadowRecord, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.completion_tokens = int(usage.get("completion_tokens") or 0)


shadows = Shadows()
