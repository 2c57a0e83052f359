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
    └── gguf_import.json         written last: the source file, its size and SHA-256, the quantization
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pipeline.models.target_checks import CONFIG_FILE

MANIFEST = "gguf_import.json"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class GGUFImport:
    """Where a converted checkpoint came from; its presence marks the conversion complete."""

    source: str  # the GGUF file's name
    source_bytes: int
    source_sha256: str
    file_type: str  # the GGUF's file type, e.g. "Q4_1"
    tensor_types: dict[str, int]  # how many tensors the file stores in each type ("Q4_1", "Q8_0", "F32")
    parameters: int
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
    record = GGUFImport(name, gguf_file.stat().st_size, sha256_of(gguf_file), *_quantization(gguf_file),
                        sum(p.numel() for p in model.parameters()))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)  # mkdtemp's 0700 is for the staging only
        (staging / MANIFEST).write_text(record.to_json())
        if out.exists():
            shutil.rmtree(out)
        staging.replace(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not (out / CONFIG_FILE).is_file():
        raise RuntimeError(f"{out}: conversion wrote no {CONFIG_FILE}")
    return record
