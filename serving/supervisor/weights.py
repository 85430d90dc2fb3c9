"""A host's model weights, fetched beside the supervisor's loop and held while its engines use them.

An artifact in an object store is downloaded into this host's cache on first use
(``registry.s3_store``): minutes for a large model. The supervisor's pass writes every
replica's heartbeat, so it never waits for a download: ``Weights.prepare`` starts one in a
thread and answers False until it has finished; the supervisor claims a replica of the
deployment only then. It fetches only for a deployment that wants another replica, on a host
with a free slot, and a failed fetch is tried again after ``FETCH_RETRY_SECONDS`` (the
reason reported once per try).

While an engine of this host uses an artifact, this process holds it (the store's use lock on
its cache entry: a cache that evicts to make room never evicts it); ``release_unused`` lets go
of the rest at the end of each pass. One store object for the supervisor's life: the lock
lives as long as that object.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from registry.artifacts import ArtifactStore, get_artifact_store

# After a failed download (store unreachable, checksum mismatch, no such artifact).
FETCH_RETRY_SECONDS = 30.0


class Weights:
    def __init__(self, report: Callable[[str], None], store: ArtifactStore | None = None, workers: int = 2) -> None:
        self.report = report
        self.store = store or get_artifact_store()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weights-fetch")
        self._fetching: dict[str, tuple[Future[Path], float]] = {}  # uri -> (download, started at)
        self._held: dict[str, Path] = {}  # uri -> its local folder, held for this host's engines
        self._retry_at: dict[str, float] = {}

    def prepare(self, uri: str, now: float, *, needed: Callable[[], bool]) -> bool:
        """Whether ``uri``'s files are on this host now (held from here on). If not, and
        ``needed()`` says a replica waits for them, their download starts beside the loop."""
        if uri in self._held:
            return True
        if uri in self._fetching:
            return self._settle(uri, now)
        if self.store.has_local_copy(uri):
            self._held[uri] = self.store.local_path(uri)  # a cache hit: no download, no wait
            return True
        if now < self._retry_at.get(uri, float("-inf")) or not needed():
            return False
        self._fetching[uri] = (self._pool.submit(self.store.local_path, uri), now)
        self.report(f"fetching {uri} into this host's cache before starting a replica of it")
        return False

    def path(self, uri: str) -> Path:
        """The local folder of an artifact ``prepare`` found here (an engine's restart included:
        its artifact is held while the engine is this supervisor's)."""
        held = self._held.get(uri)
        if held is None:  # never when claimed through prepare; a safe answer all the same
            held = self._held[uri] = self.store.local_path(uri)
        return held

    def release_unused(self, in_use: Iterable[str], now: float) -> None:
        """Let go of every artifact no engine of this host uses (their files stay in the
        cache, to be found at once by the next ``prepare``), and settle finished downloads
        no pass asked about again."""
        keep = set(in_use)
        for uri in [u for u, (future, _) in self._fetching.items() if future.done()]:
            self._settle(uri, now)
        for uri in [u for u in self._held if u not in keep]:
            del self._held[uri]
            self.store.release(uri)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for uri in list(self._held):
            with contextlib.suppress(Exception):
                self.store.release(uri)
        self._held.clear()

    def _settle(self, uri: str, now: float) -> bool:
        future, started = self._fetching[uri]
        if not future.done():
            return False
        del self._fetching[uri]
        try:
            self._held[uri] = future.result()
        except Exception as exc:  # noqa: BLE001 (any failure of a download: reported, tried again)
            self._retry_at[uri] = now + FETCH_RETRY_SECONDS
            self.report(
                f"could not fetch {uri} ({type(exc).__name__}: {exc}); no replica of it starts here; "
                f"trying again in {FETCH_RETRY_SECONDS:.0f} s"
            )
            return False
        self._retry_at.pop(uri, None)
        self.report(f"fetched {uri} in {time.monotonic() - started:.1f} s")
        return True
