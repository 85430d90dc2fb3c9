"""LoRA adapters put into the running engines of their base, on this host (``AdapterLoads``).

A deployment whose ``max_adapters`` is above 0 starts its vLLM engines with LoRA enabled
(``serving.gateway.engine_kinds``). Each database pass, for every ready engine of such a
deployment, the supervisor compares the adapters of its version that a serving deployment wants
(``registry.selectors.adapters_wanted``) with those the engine holds (``LoadedAdapter`` rows
of its replica, written for its present process), then, beside the loop:

- fetches a missing adapter's files into this host's cache (``Weights``: held while an engine
  of the host holds the adapter) and asks the engine to load it (vLLM's
  ``/v1/load_lora_adapter``, with the replica's key); once the engine said yes the row is
  written (``registry.services.adapter_loaded``) and gateways route the adapter's requests
  there under its ``lora_name``;
- asks the engine to unload an adapter no serving deployment wants any more, then deletes the row.

Never a restart: the engine keeps serving its base and its other adapters meanwhile. A row
names the engine process it was loaded into (its pid), so an engine that restarted (empty) is
never routed an adapter it no longer holds; the next pass loads it again. A load the engine
refuses (a rank above its limit, files it cannot read) is reported and tried again after
``RETRY_SECONDS``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from registry.replica_keys import replica_api_key
from registry.selectors import AdapterWanted, adapters_loaded, adapters_wanted
from registry.services import adapter_loaded, adapter_unloaded
from serving.supervisor.engines import EngineProcess
from serving.supervisor.weights import Weights

# After a load the engine refused or could not be asked.
RETRY_SECONDS = 30.0
# Loading reads the adapter's weights into the engine: seconds on a busy CPU host.
CALL_TIMEOUT = 60.0


@dataclass(frozen=True)
class _Call:
    replica_id: int
    pid: int
    version_id: int
    lora_name: str
    load: bool  # False: unload


class AdapterLoads:
    def __init__(self, report: Callable[[str], None], weights: Weights) -> None:
        self.report = report
        self.weights = weights
        self._http = httpx.Client(timeout=CALL_TIMEOUT)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="adapter-load")
        self._calls: dict[_Call, Future[str | None]] = {}
        self._retry_at: dict[tuple[int, int, int], float] = {}  # (replica, pid, version) -> when
        self._held: dict[int, set[str]] = {}  # replica id -> artifact URIs its engine holds

    def step(self, engines: Iterable[EngineProcess], now: float) -> bool:
        """One pass (database reads and writes; the engine calls run beside the loop). True
        when a row was written or deleted: gateways should reload their routing."""
        carriers = {
            e.replica_id: e for e in engines if e.max_adapters > 0 and e.phase == "ready" and e.recorded and e.pid
        }
        changed = self._settle(carriers, now)
        self._held = {replica_id: uris for replica_id, uris in self._held.items() if replica_id in carriers}
        # Retries of engines gone or restarted (another pid) are moot: the new engine is asked afresh.
        self._retry_at = {
            key: at for key, at in self._retry_at.items() if key[0] in carriers and carriers[key[0]].pid == key[1]
        }
        if not carriers:
            return changed
        wanted_by_base: dict[int, list[AdapterWanted]] = {}
        for adapter in adapters_wanted(base_ids=list({e.version_id for e in carriers.values()})):
            wanted_by_base.setdefault(adapter.base_id, []).append(adapter)
        loaded = adapters_loaded(replica_ids=list(carriers))
        busy = {(c.replica_id, c.version_id) for c in self._calls}
        for replica_id, engine in carriers.items():
            pid = engine.pid
            assert pid is not None
            rows = loaded.get(replica_id, {})
            holds = {version_id for version_id, row in rows.items() if row.pid == pid}
            wanted = wanted_by_base.get(engine.version_id, [])
            self._held[replica_id] = {w.artifact_uri for w in wanted if w.version_id in holds}
            for adapter in wanted:
                if adapter.version_id in holds or (replica_id, adapter.version_id) in busy:
                    continue
                if now < self._retry_at.get((replica_id, pid, adapter.version_id), float("-inf")):
                    continue
                if not self.weights.prepare(adapter.artifact_uri, now, needed=lambda: True):
                    continue  # fetching beside the loop; a later pass loads it
                path = str(self.weights.path(adapter.artifact_uri))
                self._submit(engine, _Call(replica_id, pid, adapter.version_id, adapter.lora_name, True), path)
            for version_id in set(rows) - {w.version_id for w in wanted}:
                if (replica_id, version_id) in busy:
                    continue
                if rows[version_id].pid != pid:  # loaded into an engine long gone: only the row is left
                    changed |= adapter_unloaded(replica_id=replica_id, version_id=version_id)
                    continue
                self._submit(engine, _Call(replica_id, pid, version_id, rows[version_id].lora_name, False), "")
        return changed

    def in_use(self) -> set[str]:
        """The adapter artifacts this host's engines hold: kept out of ``Weights.release_unused``."""
        return set().union(*self._held.values()) if self._held else set()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    # --- beside the loop -----------------------------------------------------------

    def _submit(self, engine: EngineProcess, call: _Call, path: str) -> None:
        self._calls[call] = self._pool.submit(self._ask, engine.endpoint, call, path)

    def _ask(self, endpoint: str, call: _Call, path: str) -> str | None:
        """Ask the engine; None when it did what was asked (or had it so already), else why not."""
        headers = {"Authorization": f"Bearer {replica_api_key(call.replica_id)}"}
        if call.load:
            url, body = f"{endpoint}/v1/load_lora_adapter", {"lora_name": call.lora_name, "lora_path": path}
        else:
            url, body = f"{endpoint}/v1/unload_lora_adapter", {"lora_name": call.lora_name}
        try:
            response = self._http.post(url, json=body, headers=headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if response.status_code == 200:
            return None
        text = response.text[:300]
        if call.load and "already been loaded" in text:
            return None
        if not call.load and response.status_code in (400, 404) and "not found" in text.lower():
            return None
        return f"HTTP {response.status_code}: {text}"

    def _settle(self, carriers: dict[int, EngineProcess], now: float) -> bool:
        changed = False
        for call, future in list(self._calls.items()):
            if not future.done():
                continue
            del self._calls[call]
            failure = future.result()
            engine = carriers.get(call.replica_id)
            current = engine is not None and engine.pid == call.pid
            if failure is not None:
                self._retry_at[(call.replica_id, call.pid, call.version_id)] = now + RETRY_SECONDS
                what = "load" if call.load else "unload"
                self.report(
                    f"replica {call.replica_id}: could not {what} adapter {call.lora_name} ({failure}); "
                    f"trying again in {RETRY_SECONDS:.0f} s"
                )
            elif call.load and current:
                changed |= adapter_loaded(replica_id=call.replica_id, version_id=call.version_id, pid=call.pid)
                self.report(f"replica {call.replica_id}: adapter {call.lora_name} loaded")
            elif not call.load:
                changed |= adapter_unloaded(replica_id=call.replica_id, version_id=call.version_id)
                self.report(f"replica {call.replica_id}: adapter {call.lora_name} unloaded")
        return changed
