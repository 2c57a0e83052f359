"""A GGUF file as a plain transformers checkpoint: de-quantized once, then loaded like any policy.

transformers reads GGUF through the `gguf` package and de-quantizes every tensor to float32, but
it marks the model so loaded as quantized (`quantization_config.quant_method = "gguf"`) and
refuses `save_pretrained`. The conversion builds a plain model from the same config without the
quantization record, moves the de-quantized state dict into it and saves that: the checkpoint
holds the GGUF's quantized values in float32 (Q4_1 de-quantized), not the original
full-precision weights.

    <out>/
    ├── config.json
    ├── model.safetensors        float32, the de-quantized weights
    ├── tokenizer.json           the GGUF's tokenizer, with its chat template
    ├── tokenizer_config.json
    └── gguf_import.json         written last: the source file, its size and SHA-256, the quantization,
                                 and the SHA-256 of every other file of the folder

A converted folder is loaded as the GGUF's model only when `verify` finds it so: the folder and its files this
user's alone to write (no symlink, no other owner, no write for others), every file the one the conversion wrote
(its SHA-256 as recorded), and the checkpoint the GGUF's model: config.json's architecture the GGUF's, and every
tensor of model.safetensors the shape that architecture gives. A manifest alone proves nothing: anyone who can
write one can copy the public file's size and SHA-256 into it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pipeline.launch.rendezvous import owned_tree
from pipeline.models.target_checks import CONFIG_FILE

MANIFEST = "gguf_import.json"
SCHEMA_VERSION = 2
WEIGHTS = "model.safetensors"
# The config.json fields that make the checkpoint the GGUF's model: another value is another model.
ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                "max_position_embeddings", "rms_norm_eps", "rope_parameters", "hidden_act")


class ConversionError(ValueError):
    """A converted folder that is not what its manifest says: the message names the file and the field."""


@dataclass(frozen=True)
class GGUFImport:
    """Where a converted checkpoint came from; its presence marks the conversion complete."""

    source: str  # the GGUF file's name
    source_bytes: int
    source_sha256: str
    file_type: str  # the GGUF's file type, e.g. "Q4_1"
    tensor_types: dict[str, int]  # how many tensors the file stores in each type ("Q4_1", "Q8_0", "F32")
    parameters: int
    files: dict[str, str]  # every other file the conversion wrote: its SHA-256
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> GGUFImport:
        doc = json.loads(text)
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"{MANIFEST}: schema_version {doc.get('schema_version')!r}, expected {SCHEMA_VERSION}")
        return cls(**doc)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _quantization(gguf_file: Path) -> tuple[str, dict[str, int]]:
    """The file type and the count of tensors per stored type."""
    from gguf import GGUFReader
    from gguf.constants import LlamaFileType

    reader = GGUFReader(gguf_file)
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    field = reader.fields.get("general.file_type")
    file_type = "unknown" if field is None else LlamaFileType(int(field.parts[field.data[0]][0])).name
    return file_type.removeprefix("MOSTLY_"), dict(sorted(counts.items()))


def read_import(directory: Path) -> GGUFImport | None:
    """The manifest of a complete conversion in `directory`, None when there is none."""
    path = directory / MANIFEST
    return GGUFImport.from_json(path.read_text()) if path.is_file() else None


def convert(gguf_file: Path, out: Path) -> GGUFImport:
    """Write the de-quantized checkpoint and tokenizer of `gguf_file` to `out` (replaced whole, the
    manifest last, through a sibling temporary directory renamed into place)."""
    directory, name = gguf_file.parent, gguf_file.name
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf_file}: state dict does not match its config (missing {missing}, "
                         f"unexpected {unexpected})")
    model.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp's 0700 is for the staging only
        for path in staging.iterdir():  # this user's alone to write, whatever the umask: `verify` requires it
            path.chmod(path.stat().st_mode & ~0o022)
        record = GGUFImport(name, gguf_file.stat().st_size, sha256_of(gguf_file), *_quantization(gguf_file),
                            sum(p.numel() for p in model.parameters()),
                            {path.name: sha256_of(path) for path in sorted(staging.iterdir())})
        manifest = os.open(staging / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(manifest, "w") as f:
            f.write(record.to_json())
        if out.exists():
            shutil.rmtree(out)
        staging.replace(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not (out / CONFIG_FILE).is_file():
        raise RuntimeError(f"{out}: conversion wrote no {CONFIG_FILE}")
    return record


def verify(directory: Path, gguf_file: Path) -> GGUFImport | None:
    """The manifest of `directory` when it holds this very file's conversion and is what it says; None when it
    holds no conversion of `gguf_file` (no manifest, an older schema's, another file's): convert it again.
    RendezvousError when the folder or a file in it is not this user's alone to write; ConversionError, naming
    the file and the field, when a file is not the one the conversion wrote or the checkpoint is not the GGUF's
    model."""
    owned_tree(directory)
    path = directory / MANIFEST
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION:
        return None
    record = GGUFImport.from_json(path.read_text())
    if record.source_bytes != gguf_file.stat().st_size or record.source_sha256 != sha256_of(gguf_file):
        return None
    found = sorted(p.name for p in directory.iterdir() if p.name != MANIFEST)
    if found != sorted(record.files):
        raise ConversionError(f"{directory}: its files {found} are not the ones {MANIFEST} records "
                              f"({sorted(record.files)})")
    for name, digest in record.files.items():
        if sha256_of(directory / name) != digest:
            raise ConversionError(f"{directory / name}: its SHA-256 is not the one {MANIFEST} records (files.{name}):"
                                  " changed since the conversion")
    _same_model(directory, gguf_file)
    return record


def _same_model(directory: Path, gguf_file: Path) -> None:
    """config.json's architecture is the GGUF's, and every tensor of the weights has the shape it gives."""
    from safetensors import safe_open

    expected = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    config = json.loads((directory / CONFIG_FILE).read_text())
    for field in ARCHITECTURE:
        if config.get(field) != getattr(expected, field, None):
            raise ConversionError(f"{directory / CONFIG_FILE}: {field} is {config.get(field)!r}, the GGUF's "
                                  f"{getattr(expected, field, None)!r}: not a conversion of {gguf_file.name}")
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(expected).state_dict().items()}
    tied = {"lm_head.weight"} if expected.tie_word_embeddings else set()
    with safe_open(directory / WEIGHTS, "pt") as weights:
        stored = {k: tuple(weights.get_slice(k).get_shape()) for k in weights.keys()}  # noqa: SIM118
    for name in sorted(stored.keys() | (shapes.keys() - tied)):
        if stored.get(name) != shapes.get(name):
            raise ConversionError(f"{directory / WEIGHTS}: tensor {name} has shape {stored.get(name)}, the GGUF's "
                                  f"model {shapes.get(name)}: not a conversion of {gguf_file.name}")
