"""Building the paraphrase tier's local models at install time (``manage.py build_cache_verifier``).

Two ONNX graphs from the bundled all-MiniLM-L6-v2 (``registry.small_models._minilm_dir``),
nothing downloaded:

- ``embedder.onnx``: the bi-encoder as the embedding replica runs it (mean pooling over the
  tokens, L2-normalised; 256 tokens as sentence-transformers cuts), so a gateway embeds a
  short query in-process;
- ``cross_encoder.onnx``: a cross-encoder fine-tuned here, "[CLS] cached [SEP] query [SEP]"
  → one logit, P(the cached answer also answers the query). The embedding layers and the
  lower ``Recipe.frozen_layers`` transformer layers keep MiniLM's weights (their output is
  computed once per pair, which is what keeps the build within a few minutes on two cores);
  the upper layers and a head are trained on the tuning sources' pairs. The head reads each
  side's mean token, their difference and product, and how well each side's tokens align
  with the other's. Exported with int8 dynamic quantisation where that keeps the scores
  (checked at build), else float32.

Calibration is honest by construction: leave one fold out over the tuning sources (a fold is
one author pass, or two of the later ones: train on the others, score the left-out fold);
per left-out fold and threshold of a fixed grid, the hits and the traps served, per kind
too. ``paraphrase.LocalModels.threshold_for`` reads that table. The model served is then
trained on every tuning source with the same recipe.

Training (the folds and the final model: about 7 minutes on two cores) is done once, by
``manage.py build_cache_verifier --train``, which writes what it learned into the
repository: ``serving/semcache/data/verifier_trained.npz`` (the tuned layers as float16
differences from MiniLM's weights, the head as float32) and ``verifier_trained.json`` (the
digest of the inputs it was trained from, the file's SHA-256, the calibration). Every
install then assembles the ONNX graphs from MiniLM's weights and those (under a minute). A
checkout whose training inputs differ from the shipped weights' (a tuning file or the
recipe edited without ``--train``) trains in place instead, and says so; a test fails
until the weights are trained again.

The artifact's folder holds a ``manifest.json``: each file's SHA-256, the digest of the
inputs (the training's inputs and the shipped weights' checksum) and the calibration. A
build whose inputs digest matches and whose files verify is skipped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from serving.semcache import paraphrase

BASE_DIR = Path(__file__).resolve().parents[2]
# Bump with any change to this module or to paraphrase.combine that changes what is built:
# the source itself is not hashed, so that an edit that changes nothing (a comment, a
# reformat) does not cost every installation a rebuild.
BUILDER_VERSION = "2"
SEED = 20261201


@dataclass(frozen=True)
class Source:
    name: str
    path: Path
    # Sources of one fold are left out together in the calibration (one training per fold).
    fold: str = ""

    @property
    def fold_name(self) -> str:
        return self.fold or self.name


_EXTRA_AUTHORS = (("b", "train_bc"), ("c", "train_bc"), ("d", "train_de"), ("e", "train_de"), ("f", "train_fg"),
                  ("g", "train_fg"))  # fmt: skip
# The tuning sources (each an author pass of its own). Held-out sources are never read here.
TUNING_SOURCES = (
    Source("bench_v1", BASE_DIR / "bench" / "data" / "semantic_cache_pairs.jsonl"),
    Source("templated", BASE_DIR / "bench" / "data" / "semcache_corpus" / "templated.jsonl"),
    Source("train_pairs", BASE_DIR / "serving" / "semcache" / "data" / "train_pairs.jsonl"),
    # Six more author passes (issue 39, second round), each on four domains of its own; left out
    # two at a time, so the calibration costs six trainings, not nine.
    *(
        Source(f"train_{letter}", BASE_DIR / "serving" / "semcache" / "data" / f"train_pairs_{letter}.jsonl", fold)
        for letter, fold in _EXTRA_AUTHORS
    ),
)


@dataclass(frozen=True)
class Recipe:
    """How the cross-encoder is trained (part of the inputs digest)."""

    frozen_layers: int = 4
    epochs: int = 2
    batch_size: int = 32
    learning_rate: float = 1e-4
    head_learning_rate: float = 1e-3
    warmup: float = 0.1
    both_orders: bool = False
    # "mean": the head reads the mean of every token; "sides": the means of the cached and the
    # query's tokens, their difference and product (the two sides compared explicitly).
    pooling: str = "sides"
    # The head also reads how well each side's tokens align with the other's (per token, its
    # best cosine to the other side; the least and the mean of those, both ways): a word
    # with no counterpart, diluted in a mean, stands out in a minimum.
    alignment: bool = True
    # For tests: at most this many pairs per source and no leave-one-source-out (0: all, with it).
    max_pairs_per_source: int = 0
    calibrate: bool = True


FULL = Recipe()
# What ``--train`` learned with the full recipe, shipped in the repository (see the docstring).
TRAINED = BASE_DIR / "serving" / "semcache" / "data" / "verifier_trained.npz"
TRAINED_RECORD = TRAINED.with_suffix(".json")
# Threshold grid of the calibration table (a score at or above a threshold is served).
GRID = (
    0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.96, 0.97, 0.975, 0.98, 0.985, 0.99,
    0.9925, 0.995, 0.9965, 0.998, 0.9985, 0.999, 0.9995, 0.9998, 0.9999,
)  # fmt: skip


@dataclass(frozen=True)
class Pair:
    cached: str
    query: str
    hit: bool
    kind: str
    source: str


def load_pairs(source: Source, limit: int = 0) -> list[Pair]:
    """A source's labelled pairs: ``a`` plays the cached prompt, ``b`` the query; ``hit`` when
    a's answer may be served for b (``miss`` and ``trap`` are both not)."""
    pairs = []
    for line in source.path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        kind = str(row.get("kind") or row.get("category") or "")
        pairs.append(Pair(row["a"], row["b"], row["label"] == "hit", kind, source.name))
    if limit:
        rng = random.Random(SEED)
        pairs = rng.sample(pairs, min(limit, len(pairs)))
    return pairs


def available_sources() -> list[Source]:
    return [source for source in TUNING_SOURCES if source.path.exists()]


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def training_digest(recipe: Recipe = FULL) -> str:
    """What a training learns from: the tuning files, ``BUILDER_VERSION``, the recipe and the
    base weights."""
    from registry.small_models import _minilm_dir

    digest = hashlib.sha256()
    parts: list[tuple[str, str]] = [("builder_version", BUILDER_VERSION), ("recipe", json.dumps(asdict(recipe)))]
    parts += [(f"source:{s.name}", _sha256_file(s.path)) for s in available_sources()]
    weights = _minilm_dir()
    parts += [(f"base:{name}", _sha256_file(weights / name)) for name in ("model.safetensors", "tokenizer.json")]
    for key, value in parts:
        digest.update(f"{key}={value}\n".encode())
    return digest.hexdigest()


def shipped_training(recipe: Recipe = FULL) -> tuple[dict[str, Any] | None, str]:
    """The shipped weights' record when they were trained from these inputs (and the file
    verifies), else None and why not. Only the full recipe's training is shipped."""
    _, record, why = _shipped(recipe)
    return record, why


def inputs_digest(recipe: Recipe = FULL) -> str:
    """What the artifact folder is built from: the training's inputs and, where they are
    current, the shipped weights (else the build trains). A change to any of them rebuilds."""
    training, record, _ = _shipped(recipe)
    return _folder_digest(training, record)


def _shipped(recipe: Recipe) -> tuple[str, dict[str, Any] | None, str]:
    """The training digest, and the shipped record for it (else None and why not)."""
    training = training_digest(recipe)
    if recipe != FULL:
        return training, None, "a recipe of its own"
    if not TRAINED_RECORD.is_file() or not TRAINED.is_file():
        return training, None, f"no trained weights in {TRAINED.parent}"
    record = json.loads(TRAINED_RECORD.read_text())
    if record.get("training_digest") != training:
        return training, None, "the shipped weights were trained from other inputs (run build_cache_verifier --train)"
    if _sha256_file(TRAINED) != record.get("weights_sha256"):
        return training, None, f"{TRAINED.name} does not match its checksum"
    return training, record, ""


def _folder_digest(training: str, record: dict[str, Any] | None) -> str:
    weights = record["weights_sha256"] if record else "trained at build"
    return hashlib.sha256(f"{training}\nweights={weights}\n".encode()).hexdigest()


# -- the cross-encoder --------------------------------------------------------------------------


def _seed_everything() -> None:
    import torch

    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)


class _Trainer:
    """MiniLM's lower layers run once per pair (frozen); the upper ones are fine-tuned."""

    def __init__(self, recipe: Recipe) -> None:
        import torch
        from transformers import AutoModel

        from registry.small_models import _minilm_dir

        self.recipe = recipe
        self.base_dir = _minilm_dir()
        self.tokenizer = paraphrase.pair_tokenizer(self.base_dir / "tokenizer.json")
        self.base = AutoModel.from_pretrained(self.base_dir, attn_implementation="eager").eval()
        self.frozen: dict[tuple[str, str], Any] = {}
        self.torch = torch

    def _frozen_states(self, keys: Sequence[tuple[str, str]]) -> None:
        """The frozen layers' output for each (cached, query) not yet seen, kept in float16."""
        torch = self.torch
        todo = [key for key in dict.fromkeys(keys) if key not in self.frozen]
        todo.sort(key=lambda key: len(key[0]) + len(key[1]))
        with torch.inference_mode():
            for start in range(0, len(todo), 64):
                chunk = todo[start : start + 64]
                ids, mask, types = paraphrase.encode_pairs(self.tokenizer, chunk)
                hidden = self.base.embeddings(input_ids=torch.from_numpy(ids), token_type_ids=torch.from_numpy(types))
                additive = _additive(torch, torch.from_numpy(mask))
                for layer in self.base.encoder.layer[: self.recipe.frozen_layers]:
                    hidden = layer(hidden, additive)
                lengths = mask.sum(1)
                for row, key in enumerate(chunk):
                    state = hidden[row, : lengths[row]].to(torch.float16).clone()
                    self.frozen[key] = (state, torch.from_numpy(types[row, : lengths[row]].copy()))

    def _batch(self, keys: Sequence[tuple[str, str]]) -> tuple[Any, Any, Any]:
        torch = self.torch
        longest = max(self.frozen[key][0].shape[0] for key in keys)
        hidden = torch.zeros(len(keys), longest, self.base.config.hidden_size)
        mask = torch.zeros(len(keys), longest, dtype=torch.int64)
        types = torch.zeros(len(keys), longest, dtype=torch.int64)
        for row, key in enumerate(keys):
            state, type_ids = self.frozen[key]
            hidden[row, : state.shape[0]] = state.float()
            mask[row, : state.shape[0]] = 1
            types[row, : state.shape[0]] = type_ids
        return hidden, mask, types

    def model(self) -> Any:
        """A fresh copy: MiniLM's weights and a new head, the same for each fold (seeded)."""
        import copy

        torch = self.torch
        _seed_everything()
        top = copy.deepcopy(self.base.encoder.layer[self.recipe.frozen_layers :])
        width = self.base.config.hidden_size * (4 if self.recipe.pooling == "sides" else 1)
        width += 4 if self.recipe.alignment else 0
        head = torch.nn.Linear(width, 1)
        return torch.nn.ModuleDict({"top": top, "head": head})

    def forward(self, model: Any, hidden: Any, mask: Any, types: Any) -> Any:
        torch = self.torch
        additive = _additive(torch, mask)
        for layer in model["top"]:
            hidden = layer(hidden, additive)
        if self.recipe.pooling == "sides":
            cached = _mean_pool(torch, hidden, mask * (1 - types))
            query = _mean_pool(torch, hidden, mask * types)
            pooled = torch.cat([cached, query, (cached - query).abs(), cached * query], dim=-1)
        else:
            pooled = _mean_pool(torch, hidden, mask)
        if self.recipe.alignment:
            pooled = torch.cat([pooled, _alignment(torch, hidden, mask, types)], dim=-1)
        return model["head"](pooled).squeeze(-1)

    def train(self, pairs: Sequence[Pair], progress: Callable[[str], None], label: str) -> Any:
        torch = self.torch
        recipe = self.recipe
        examples = [((p.cached, p.query), float(p.hit)) for p in pairs]
        if recipe.both_orders:
            examples += [((p.query, p.cached), float(p.hit)) for p in pairs]
        self._frozen_states([key for key, _ in examples])
        model = self.model()
        model.train()
        optimiser = torch.optim.AdamW(
            [
                {"params": model["top"].parameters(), "lr": recipe.learning_rate},
                {"params": model["head"].parameters(), "lr": recipe.head_learning_rate},
            ],
            weight_decay=0.01,
        )
        rng = random.Random(SEED)
        steps_per_epoch = math.ceil(len(examples) / recipe.batch_size)
        total = steps_per_epoch * recipe.epochs
        warmup = max(1, int(total * recipe.warmup))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimiser, lambda step: min((step + 1) / warmup, max(0.0, (total - step) / max(1, total - warmup)))
        )
        started = time.monotonic()
        for epoch in range(recipe.epochs):
            losses = []
            for batch in _length_batches(examples, recipe.batch_size, rng, lambda key: self.frozen[key][0].shape[0]):
                hidden, mask, types = self._batch([key for key, _ in batch])
                target = torch.tensor([y for _, y in batch])
                logits = self.forward(model, hidden, mask, types)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimiser.step()
                schedule.step()
                optimiser.zero_grad()
                losses.append(float(loss.detach()))
            progress(
                f"  {label}: epoch {epoch + 1}/{recipe.epochs}, {len(examples)} examples, "
                f"loss {np.mean(losses):.4f} ({time.monotonic() - started:.0f} s)"
            )
        return model.eval()

    def logits(self, model: Any, keys: Sequence[tuple[str, str]]) -> np.ndarray[Any, Any]:
        torch = self.torch
        self._frozen_states(keys)
        out = []
        with torch.inference_mode():
            for start in range(0, len(keys), 64):
                hidden, mask, types = self._batch(keys[start : start + 64])
                out.append(self.forward(model, hidden, mask, types).numpy())
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)

    def save(self, model: Any, path: Path) -> None:
        """The tuned layers as float16 differences from MiniLM's (small numbers: little is lost
        in float16), the head as float32. About 7 MB where the float32 layers are 14."""
        fresh = self.model().state_dict()
        arrays: dict[str, np.ndarray[Any, Any]] = {}
        for name, value in model.state_dict().items():
            if name.startswith("top."):
                arrays[name] = (value - fresh[name]).detach().to(self.torch.float16).numpy()
            else:
                arrays[name] = value.detach().numpy()
        with open(path, "wb") as handle:
            np.savez_compressed(handle, **arrays)  # type: ignore[arg-type]  # (numpy types its names as bool)

    def load(self, path: Path) -> Any:
        torch = self.torch
        model = self.model()
        state = model.state_dict()
        with np.load(path) as arrays:
            if set(arrays.files) != set(state):
                raise RuntimeError(f"{path.name} does not hold this recipe's weights")
            for name in arrays.files:
                value = torch.from_numpy(arrays[name])
                state[name] = state[name] + value.float() if name.startswith("top.") else value
        model.load_state_dict(state)
        return model.eval()

    def export(self, model: Any, path: Path) -> None:
        """The whole graph (embeddings, frozen and tuned layers, head) as one ONNX model."""
        import torch

        base, frozen, forward = self.base, self.recipe.frozen_layers, self.forward

        class CrossEncoder(torch.nn.Module):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.embeddings = base.embeddings
                self.bottom = base.encoder.layer[:frozen]
                self.tuned = model

            def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
                hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
                additive = _additive(torch, attention_mask)
                for layer in self.bottom:
                    hidden = layer(hidden, additive)
                return forward(self.tuned, hidden, attention_mask, token_type_ids)

        _export(torch, CrossEncoder().eval(), path, ["input_ids", "attention_mask", "token_type_ids"], "logit")


def _additive(torch: Any, mask: Any) -> Any:
    """BERT's additive attention mask: 0 where a token is, the float minimum at padding."""
    return (1.0 - mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min


def _alignment(torch: Any, hidden: Any, mask: Any, types: Any) -> Any:
    """Per token, its best cosine to a token of the other side; of those, the least and the
    mean on each side: [batch, 4]."""
    unit = torch.nn.functional.normalize(hidden, dim=-1)
    similarity = unit @ unit.transpose(1, 2)
    cached, query = mask * (1 - types), mask * types
    features = []
    for side, other in ((cached, query), (query, cached)):
        best = similarity.masked_fill(other[:, None, :] == 0, -2.0).amax(-1)
        features.append(best.masked_fill(side == 0, 2.0).amin(-1))
        weights = side.to(best.dtype)
        features.append((best * weights).sum(-1) / weights.sum(-1).clamp(min=1.0))
    return torch.stack(features, dim=-1)


def _mean_pool(torch: Any, hidden: Any, mask: Any) -> Any:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def _length_batches(
    examples: list[Any], size: int, rng: random.Random, length: Callable[[Any], int]
) -> Iterable[list[Any]]:
    """Shuffled, then sorted by length within windows of 16 batches (less padding), the
    batches shuffled again: deterministic for a seed."""
    order = examples[:]
    rng.shuffle(order)
    batches = []
    window = size * 16
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda example: length(example[0]))
        batches += [chunk[i : i + size] for i in range(0, len(chunk), size)]
    rng.shuffle(batches)
    return batches


def _export(torch: Any, module: Any, path: Path, inputs: list[str], output: str) -> None:
    sample = tuple(torch.ones(2, 8, dtype=torch.int64) for _ in inputs)
    dynamic = {name: {0: "batch", 1: "tokens"} for name in inputs}
    torch.onnx.export(
        module, sample, str(path), input_names=inputs, output_names=[output],
        dynamic_axes={**dynamic, output: {0: "batch"}}, opset_version=17, dynamo=False,
    )  # fmt: skip


def _quantise(source: Path, target: Path) -> None:
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)  # the quantiser logs every tensor it leaves alone at INFO
    try:
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)
    finally:
        root.setLevel(level)


# -- the bi-encoder ---------------------------------------------------------------------------


def export_embedder(path: Path) -> None:
    """all-MiniLM-L6-v2 as sentence-transformers runs it: mean pooling, L2 normalisation."""
    import torch
    from transformers import AutoModel

    from registry.small_models import _minilm_dir

    encoder = AutoModel.from_pretrained(_minilm_dir(), attn_implementation="eager").eval()

    class Embedder(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            # Layer by layer with BERT's additive mask: transformers' own mask builder does
            # not trace with dynamic shapes.
            hidden = self.encoder.embeddings(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids))
            additive = _additive(torch, attention_mask)
            for layer in self.encoder.encoder.layer:
                hidden = layer(hidden, additive)
            return torch.nn.functional.normalize(_mean_pool(torch, hidden, attention_mask), dim=-1)

    _export(torch, Embedder().eval(), path, ["input_ids", "attention_mask"], "embedding")


def reference_embeddings(texts: Sequence[str]) -> np.ndarray[Any, Any]:
    """The torch reference the exported embedder is checked against (same weights, same pooling)."""
    import torch
    from transformers import AutoModel

    from registry.small_models import _minilm_dir

    encoder = AutoModel.from_pretrained(_minilm_dir()).eval()
    tokenizer = paraphrase.text_tokenizer(_minilm_dir() / "tokenizer.json")
    out = []
    with torch.inference_mode():
        for text in texts:  # one at a time: no padding in the reference
            encoded = tokenizer.encode(text)
            ids = torch.tensor([encoded.ids])
            mask = torch.tensor([encoded.attention_mask])
            hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            out.append(torch.nn.functional.normalize(_mean_pool(torch, hidden, mask), dim=-1)[0].numpy())
    return np.stack(out)


# -- calibration ------------------------------------------------------------------------------


@dataclass
class Calibration:
    """Per left-out source: how many hits and traps it has, and per threshold of ``GRID`` how
    many of each were served (a score ≥ the threshold); the same per kind."""

    grid: list[float] = field(default_factory=lambda: list(GRID))
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, source: str, pairs: Sequence[Pair], scores: np.ndarray[Any, Any]) -> None:
        hit = np.array([p.hit for p in pairs])
        kinds: dict[str, dict[str, Any]] = {}
        for kind in sorted({p.kind for p in pairs}):
            rows = np.array([p.kind == kind for p in pairs])
            kinds[kind] = {
                "label": "hit" if hit[rows].all() else "trap" if not hit[rows].any() else "mixed",
                "pairs": int(rows.sum()),
                "served": [int(((scores >= t) & rows).sum()) for t in self.grid],
            }
        self.sources[source] = {
            "hits": int(hit.sum()),
            "traps": int((~hit).sum()),
            "hits_served": [int(((scores >= t) & hit).sum()) for t in self.grid],
            "traps_served": [int(((scores >= t) & ~hit).sum()) for t in self.grid],
            "kinds": kinds,
        }

    def as_json(self) -> dict[str, Any]:
        return {"grid": self.grid, "sources": self.sources, "rule": paraphrase.CALIBRATION_RULE}

    def lines(self) -> list[str]:
        """The table as text: per threshold and left-out source, hits and traps served."""
        names = list(self.sources)
        header = "threshold " + "".join(f"| {name:<28}" for name in names)
        out = [header, "          " + "| hits served   traps served   " * len(names)]
        for i, threshold in enumerate(self.grid):
            cells = []
            for name in names:
                s = self.sources[name]
                hits, traps, served = s["hits_served"][i] / max(1, s["hits"]), s["traps"], s["traps_served"][i]
                cells.append(f"| {hits:6.1%} {served:4d}/{traps:<4d} {served / max(1, traps):5.1%}   ")
            out.append(f"{threshold:<10g}" + "".join(cells))
        return out


# -- the build ----------------------------------------------------------------------------------


def is_current(folder: Path, digest: str) -> str:
    """Empty when the folder holds an artifact built from these inputs whose files verify, else
    why not (missing, other inputs, a file's checksum)."""
    manifest = paraphrase.read_manifest(folder)
    if manifest is None:
        return "no manifest"
    if manifest.get("inputs_digest") != digest:
        return "inputs changed"
    for name, checksum in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file() or _sha256_file(path) != checksum:
            return f"{name} does not match its checksum"
    return ""


def build(
    folder: Path, *, force: bool = False, recipe: Recipe = FULL, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """Build the artifact into ``folder`` unless it is current; returns its manifest. Written
    into a temporary folder beside it and moved in place, so a reader never sees half of one."""
    training, record, untrained = _shipped(recipe)  # once: it hashes the inputs and the weights
    digest = _folder_digest(training, record)
    why = "forced" if force else is_current(folder, digest)
    if not why:
        progress(f"  up to date ({folder})")
        manifest = paraphrase.read_manifest(folder)
        assert manifest is not None
        return manifest
    progress(f"  building ({why}) into {folder}")
    started = time.monotonic()
    _set_threads()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    try:
        manifest = _build_into(staging, digest, recipe, record, untrained, progress)
        manifest["build_seconds"] = round(time.monotonic() - started, 1)
        (staging / paraphrase.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    progress(f"  built in {manifest['build_seconds']:.0f} s")
    return manifest


def _set_threads() -> None:
    threads = int(os.environ.get("SEMANTIC_CACHE_VERIFIER_BUILD_THREADS", "0"))
    if threads:
        import torch

        torch.set_num_threads(threads)


def train(recipe: Recipe = FULL, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the calibration folds and the final model; write the weights and their record
    where builds read them (``TRAINED``). Returns the record."""
    started = time.monotonic()
    _set_threads()
    trainer, pairs, model, calibration = _train(recipe, progress)
    trainer.save(model, TRAINED)
    record = {
        "training_digest": training_digest(recipe),
        "builder_version": BUILDER_VERSION,
        "weights_sha256": _sha256_file(TRAINED),
        "recipe": asdict(recipe),
        "sources": {name: len(rows) for name, rows in pairs.items()},
        "calibration": calibration.as_json(),
        "train_seconds": round(time.monotonic() - started, 1),
    }
    TRAINED_RECORD.write_text(json.dumps(record, indent=1) + "\n")
    progress(f"  trained in {record['train_seconds']:.0f} s: {TRAINED} ({TRAINED.stat().st_size / 1e6:.1f} MB)")
    return record


def _train(recipe: Recipe, progress: Callable[[str], None]) -> tuple[_Trainer, dict[str, list[Pair]], Any, Calibration]:
    pairs = _tuning_pairs(recipe, progress)
    _seed_everything()
    trainer = _Trainer(recipe)
    folds: dict[str, list[Pair]] = {}
    for source in available_sources():
        folds.setdefault(source.fold_name, []).extend(pairs[source.name])
    calibration = Calibration()
    if recipe.calibrate and len(folds) > 1:
        for left_out, held in folds.items():
            train = [p for name, rows in folds.items() if name != left_out for p in rows]
            model = trainer.train(train, progress, f"without {left_out}")
            logits = trainer.logits(model, [(p.cached, p.query) for p in held])
            calibration.add(left_out, held, paraphrase.combine(logits, [(p.cached, p.query) for p in held]))
        for line in calibration.lines():
            progress("  " + line)
    every = [p for rows in pairs.values() for p in rows]
    return trainer, pairs, trainer.train(every, progress, "all sources"), calibration


def _tuning_pairs(recipe: Recipe, progress: Callable[[str], None]) -> dict[str, list[Pair]]:
    sources = available_sources()
    if not sources:
        raise RuntimeError("no tuning source found: the verifier cannot be trained")
    pairs = {s.name: load_pairs(s, recipe.max_pairs_per_source) for s in sources}
    progress("  tuning sources: " + ", ".join(f"{name} ({len(rows)} pairs)" for name, rows in pairs.items()))
    return pairs


def _build_into(
    out: Path,
    digest: str,
    recipe: Recipe,
    record: dict[str, Any] | None,
    why: str,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """``record``: the shipped training to assemble from; None: train here (``why`` says why)."""
    import onnxruntime

    if record is not None:
        pairs = _tuning_pairs(recipe, progress)
        trainer = _Trainer(recipe)
        model = trainer.load(TRAINED)
        calibration_json = record["calibration"]
        progress(f"  the shipped weights ({TRAINED.name}, trained from these inputs)")
    else:
        progress(f"  training here, not the shipped weights: {why}")
        trainer, pairs, model, calibration = _train(recipe, progress)
        calibration_json = calibration.as_json()
    shutil.copyfile(trainer.base_dir / "tokenizer.json", out / paraphrase.TOKENIZER)

    every = [p for rows in pairs.values() for p in rows]
    float_path = out / "cross_encoder.float.onnx"
    trainer.export(model, float_path)
    _quantise(float_path, out / paraphrase.CROSS_ENCODER)
    # Kept quantised only where it scores the tuning pairs as the float graph does.
    keys = [(p.cached, p.query) for p in every[:: max(1, len(every) // 400)]]
    reference = 1 / (1 + np.exp(-trainer.logits(model, keys)))
    session = paraphrase.session(out / paraphrase.CROSS_ENCODER, onnxruntime)
    quantised = 1 / (1 + np.exp(-paraphrase.run_cross_encoder(session, trainer.tokenizer, keys)))
    gap = float(np.max(np.abs(quantised - reference)))
    quantisation = {"kept": gap <= paraphrase.QUANTISATION_TOLERANCE, "max_probability_gap": round(gap, 4)}
    if not quantisation["kept"]:
        float_path.replace(out / paraphrase.CROSS_ENCODER)
    float_path.unlink(missing_ok=True)
    progress(f"  cross-encoder exported (int8 kept: {quantisation['kept']}, largest probability gap {gap:.4f})")

    export_embedder(out / paraphrase.EMBEDDER)
    progress("  embedder exported")
    names = (paraphrase.TOKENIZER, paraphrase.CROSS_ENCODER, paraphrase.EMBEDDER)
    files = {name: _sha256_file(out / name) for name in names}
    return {
        "format": paraphrase.FORMAT,
        "builder_version": BUILDER_VERSION,
        "inputs_digest": digest,
        "trained": "shipped" if record is not None else "at build",
        "files": files,
        "recipe": asdict(recipe),
        "sources": {name: len(rows) for name, rows in pairs.items()},
        "quantisation": quantisation,
        "calibration": calibration_json,
        "max_pair_tokens": paraphrase.MAX_PAIR_TOKENS,
        "max_text_tokens": paraphrase.MAX_TEXT_TOKENS,
    }
