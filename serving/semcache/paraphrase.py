"""The paraphrase tier's local models: an in-process embedder and a learned verifier.

``local_models()`` loads, once per process and lazily, the artifact that
``manage.py build_cache_verifier`` builds into ``settings.SEMANTIC_CACHE_VERIFIER_DIR``
(``serving.semcache.verifier_build``): ``embed`` gives all-MiniLM-L6-v2's unit vectors (as
the embedding replica does, cosine ≥ 0.999), ``score`` the cross-encoder's probability that
a cached prompt's answer also answers a query, and ``threshold_for`` the score a wrong-hit
bound needs, from the build's leave-one-source-out calibration. Without a built artifact it
is None and the tier is off. ONNX Runtime with one thread per call; the sessions are safe to
share between threads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from django.conf import settings

from core.stats import wilson

logger = logging.getLogger("serving.semcache.paraphrase")

FORMAT = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
CROSS_ENCODER = "cross_encoder.onnx"
EMBEDDER = "embedder.onnx"
# A pair is cut to this many tokens (the longer side first); a text to the replica's 256.
MAX_PAIR_TOKENS = 128
MAX_TEXT_TOKENS = 256
# int8 is kept only while no tuning pair's probability moves more than this.
QUANTISATION_TOLERANCE = 0.05
CALIBRATION_RULE = "smallest threshold whose left-out sources' traps served, pooled, Wilson 95 % upper end, is ≤ delta"

_NUMBER = re.compile(r"#?\d+(?:\.\d+)?")


def pair_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(MAX_PAIR_TOKENS, strategy="longest_first")
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the batch's longest
    return tokenizer


def text_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(MAX_TEXT_TOKENS)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    return tokenizer


def encode_pairs(tokenizer: Any, pairs: Sequence[tuple[str, str]]) -> tuple[Any, Any, Any]:
    encoded = tokenizer.encode_batch(list(pairs))
    return (
        np.array([e.ids for e in encoded], dtype=np.int64),
        np.array([e.attention_mask for e in encoded], dtype=np.int64),
        np.array([e.type_ids for e in encoded], dtype=np.int64),
    )


def session(path: Path, onnxruntime: Any) -> Any:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_cross_encoder(cross_encoder: Any, tokenizer: Any, pairs: Sequence[tuple[str, str]]) -> np.ndarray[Any, Any]:
    """The cross-encoder's logits for (cached, query) pairs."""
    if not pairs:
        return np.zeros(0, dtype=np.float32)
    ids, mask, types = encode_pairs(tokenizer, pairs)
    feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    return np.asarray(cross_encoder.run(["logit"], feed)[0], dtype=np.float64).reshape(-1)


def numbers(text: str) -> Counter[str]:
    """The numbers a prompt says once the word verifier has normalised it ("five" / 5, "1st" /
    "first", "$5" / "5 dollars")."""
    from serving.semcache.verify import analyse

    return Counter(word.key for word in analyse(text) if _NUMBER.fullmatch(word.key))


def combine(logits: Any, pairs: Sequence[tuple[str, str]]) -> np.ndarray[Any, Any]:
    """The score served: the cross-encoder's probability, but 0 where the two prompts say
    different numbers (a cross-encoder reads "400 mg" and "600 mg" nearly alike; a question
    about another quantity is another question). Used at build (calibration) and at run time."""
    probability = 1 / (1 + np.exp(-np.asarray(logits, dtype=np.float64)))
    same = np.array([numbers(cached) == numbers(query) for cached, query in pairs], dtype=bool)
    return np.where(same, probability, 0.0)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def curve_points(calibration: dict[str, Any]) -> list[tuple[float, float]]:
    """``(threshold, share of traps served)`` for each threshold of the calibration grid: the
    traps of every left-out source pooled, the upper end of the Wilson 95 % interval (what
    ``serving.semcache.bound`` takes as the verifier's wrong-hit rate before any evidence)."""
    sources = (calibration.get("sources") or {}).values()
    traps = sum(s["traps"] for s in sources)
    if not traps:
        return []
    return [
        (float(threshold), wilson(sum(s["traps_served"][i] for s in sources), traps)[1])
        for i, threshold in enumerate(calibration["grid"])
    ]


def threshold_for(calibration: dict[str, Any], delta: float) -> float:
    """The smallest threshold of the calibration grid whose left-out sources together serve traps
    at a rate whose Wilson 95 % upper end is at most ``delta``; ``math.inf`` (serve nothing)
    when none does."""
    for threshold, wrong in curve_points(calibration):
        if wrong <= delta:
            return threshold
    return math.inf


class LocalModels:
    """The built artifact, loaded: thread-safe (ONNX Runtime sessions and the tokenizers are)."""

    def __init__(self, folder: Path, manifest: dict[str, Any]) -> None:
        import onnxruntime

        self.folder = folder
        self.manifest = manifest
        self._pairs = pair_tokenizer(folder / TOKENIZER)
        self._texts = text_tokenizer(folder / TOKENIZER)
        self._cross_encoder = session(folder / CROSS_ENCODER, onnxruntime)
        self._embedder = session(folder / EMBEDDER, onnxruntime)
        # The calibration as a function of the threshold, read once (every paraphrase lookup asks).
        from serving.semcache.bound import curve_from

        self._curve = curve_from(curve_points(manifest.get("calibration") or {}))
        files = "".join(f"{name}={checksum}\n" for name, checksum in sorted(manifest["files"].items()))
        self._digest = hashlib.sha256(f"{manifest['inputs_digest']}\n{files}".encode()).hexdigest()

    @property
    def digest(self) -> str:
        """Which build this is (its inputs and files): a score is comparable only within one."""
        return self._digest

    def embed(self, texts: list[str]) -> list[list[float]]:
        """Unit vectors of 384 dimensions, as the embedding replica gives them."""
        if not texts:
            return []
        encoded = self._texts.encode_batch(texts)
        feed = {
            "input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
        }
        vectors: list[list[float]] = self._embedder.run(["embedding"], feed)[0].tolist()
        return vectors

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """(cached, query) → the probability that the cached answer also answers the query."""
        if not pairs:
            return []
        scores: list[float] = combine(run_cross_encoder(self._cross_encoder, self._pairs, pairs), pairs).tolist()
        return scores

    def threshold_for(self, delta: float) -> float:
        """The calibrated score threshold for a wrong-hit bound ``delta`` (the share of traps
        served); ``math.inf`` when no threshold of the calibration keeps it."""
        return threshold_for(self.manifest.get("calibration") or {}, delta)

    def curve(self) -> Callable[[float], float]:
        """The calibration as a function of the threshold (``serving.semcache.bound``)."""
        return self._curve


_lock = threading.Lock()
_loaded: dict[Path, LocalModels | None] = {}


def verified(folder: Path) -> tuple[dict[str, Any] | None, str]:
    """The folder's manifest when every file it names matches its checksum, else why not."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None, f"no artifact in {folder} (run manage.py build_cache_verifier)"
    for name, checksum in manifest.get("files", {}).items():
        try:
            actual = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        except OSError:
            return None, f"{folder / name} is missing (run manage.py build_cache_verifier)"
        if actual != checksum:
            return None, f"{folder / name} does not match its checksum (run manage.py build_cache_verifier --force)"
    return manifest, ""


def local_models() -> LocalModels | None:
    """The process's local models, loaded on first use; None (logged once) when the artifact is
    not built or does not verify: the paraphrase tier is then off."""
    folder = Path(settings.SEMANTIC_CACHE_VERIFIER_DIR)
    if folder in _loaded:
        return _loaded[folder]
    with _lock:
        if folder not in _loaded:
            manifest, why = verified(folder)
            models = None
            if manifest is None:
                logger.warning("semantic cache: the paraphrase tier is off: %s", why)
            else:
                try:
                    models = LocalModels(folder, manifest)
                except Exception:
                    logger.exception("semantic cache: the paraphrase tier is off: %s does not load", folder)
            _loaded[folder] = models
        return _loaded[folder]


_loading: set[Path] = set()


def ready() -> LocalModels | None:
    """What the request path asks: the local models if this process has them loaded; else
    None, having started loading them in a thread (once): a lookup never waits the ~0.7 s a
    load takes, the request that found them missing is a miss of the paraphrase tier."""
    folder = Path(settings.SEMANTIC_CACHE_VERIFIER_DIR)
    if folder in _loaded:
        return _loaded[folder]
    with _lock:
        if folder in _loading:
            return None
        _loading.add(folder)

    def load() -> None:
        try:
            local_models()
        finally:
            with _lock:
                _loading.discard(folder)

    threading.Thread(target=load, name="semcache-local-models", daemon=True).start()
    return None


def forget() -> None:
    """Load again on next use (after a build, and in tests)."""
    with _lock:
        _loaded.clear()
