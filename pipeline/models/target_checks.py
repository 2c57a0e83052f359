"""A policy checkpoint checked before loading allocates anything, and the errors that refuse it.

The model class comes from config.json's `model_type` through transformers' Auto classes,
limited to the families in FAMILIES, whose decoders share the layout the forward relies on
(model.model.embed_tokens, model.model.layers, model.model.norm, model.lm_head) and whose
layer ids are tested against a plain transformers forward.

The checkpoint is written by an untrusted RL trainer, so loading checks before it allocates:
config sizes within bounds, then every safetensors header (never tensor data) against the
state dict the config implies, built on the meta device. Every refusal is a
TargetCheckpointError subclass whose message names the checkpoint (URI without credentials)
and the file, tensor or key.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit, urlunsplit

import fsspec
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from pipeline.data.local_files import LocalPathError, open_regular
from pipeline.data.store import ObjectStore
from pipeline.models.memory import available_memory
from pipeline.models.rope import UnsupportedRopeError, check_scaling, rope_of
from pipeline.models.weights import (
    FLOAT_DTYPES,
    INDEX_FILE,
    MAX_INDEX_BYTES,
    SINGLE_FILE,
    TargetCheckpointError,
    WeightsLayout,
    WeightsLayoutError,
    join_shards,
    layout_file,
    parse_index,
    read_header,
)

CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 2**20

# model_type -> the causal-LM class transformers builds for it. Each follows the decoder layout
# above and is covered by tests/unit/models/test_target.py (Qwen2: q/k/v biases; Qwen3: q/k norms).
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Families whose forward differs in a way `forward` would silently get wrong.
REFUSED_FAMILIES = {
    "gemma": "scales embeddings by sqrt(hidden_size)", "gemma2": "soft-caps logits", "gemma3": "soft-caps logits",
    "granite": "scales embeddings, residuals and logits", "cohere": "scales logits",
    "mixtral": "mixture-of-experts layers",
    "qwen2_moe": "mixture-of-experts layers", "qwen3_moe": "mixture-of-experts layers",
}

# Generous bounds: the largest open models are well inside; a config beyond them is an attack or a bug.
CONFIG_BOUNDS = {
    "vocab_size": 4_194_304,
    "hidden_size": 65_536,
    "intermediate_size": 1_048_576,
    "num_hidden_layers": 1_024,
    "num_attention_heads": 1_024,
    "num_key_value_heads": 1_024,
    "max_position_embeddings": 16_777_216,
}
OPTIONAL_BOUNDS = {"head_dim": 4_096}
MAX_PARAMETERS = 2 * 10**12

# Keys that ask transformers to import code or to read non-float weights.
REFUSED_KEYS = {
    "auto_map": "asks transformers to import code shipped with the checkpoint",
    "trust_remote_code": "asks transformers to import code shipped with the checkpoint",
    "quantization_config": "names quantized weights; a policy checkpoint holds float weights",
}
STORED_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


class UnsupportedFamilyError(TargetCheckpointError):
    """A model_type outside FAMILIES."""


class RemoteCodeError(TargetCheckpointError):
    """A config that asks transformers to run code shipped with the checkpoint."""


class TargetConfigError(TargetCheckpointError):
    """config.json missing, unreadable, or with sizes out of bounds."""


class MissingTensorError(TargetCheckpointError):
    """A parameter the config implies is in no weights file."""


class UnexpectedTensorError(TargetCheckpointError):
    """A tensor that is no parameter of the model the config implies."""


class TensorShapeError(TargetCheckpointError):
    """A tensor whose shape differs from the parameter's."""


class TensorDtypeError(TargetCheckpointError):
    """A tensor that is not floating point."""


class TiedWeightsError(TargetCheckpointError):
    """A config that ties lm_head to embed_tokens with a checkpoint whose lm_head differs."""


class TargetMemoryError(TargetCheckpointError):
    """A checkpoint whose weights need more memory than this process may allocate."""


def redact(uri: str) -> str:
    """A URI fit for messages and logs: no user:password@, no query (presigned signatures)."""
    parts = urlsplit(uri)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass(frozen=True)
class CheckpointListing:
    """What one listing of a checkpoint directory says: its files and its content identity."""

    uri: str  # redacted
    fs: fsspec.AbstractFileSystem
    path: str
    sizes: dict[str, int]
    identity: str  # hex digest of the URI and each file's (size, ETag or mtime)

    @property
    def local(self) -> bool:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return protocol in ("file", "local")


def list_checkpoint(uri: str, store: ObjectStore | None = None) -> CheckpointListing:
    """One listing of the directory; `store` lends its options (an S3 endpoint) to URIs of its protocol."""
    fs, path = store.filesystem(uri) if store else fsspec.core.url_to_fs(uri)
    where = redact(uri)
    path = path.rstrip("/")
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    files = [e for e in entries if e.get("type") == "file"]
    if not files:
        raise TargetConfigError(f"{where}: no checkpoint directory (nothing listed)")
    _refuse_links(entries, where)
    sizes, stamps = {}, []
    for e in files:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        sizes[name] = int(e.get("size") or 0)
        stamp = e.get("ETag") or e.get("etag") or e.get("mtime") or e.get("LastModified") or e.get("created")
        stamps.append((name, sizes[name], str(stamp), str(e.get("ino", ""))))
    identity = hashlib.sha256(json.dumps([uri, sorted(stamps)]).encode()).hexdigest()[:32]
    return CheckpointListing(where, fs, path, sizes, identity)


def _refuse_links(entries: list[dict], where: str) -> None:
    """A local checkpoint's files are its own: a symlink could lead to any file of the machine."""
    links = sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("islink"))
    if links:
        raise TargetConfigError(f"{where}/{links[0]}: a symlink (not followed); a checkpoint's files must be "
                                "regular files in its directory")


def open_file(directory: Path, name: str, where: str) -> BinaryIO:
    """A file of a local checkpoint, opened as a regular file and never through a symlink."""
    try:
        return open_regular(directory / name, f"{where}/{name}")
    except LocalPathError as exc:
        raise TargetConfigError(str(exc)) from None


def check_config(raw_bytes: bytes, where: str) -> PretrainedConfig:
    """config.json -> the transformers config, or a refusal naming the key. Nothing big is allocated."""
    if len(raw_bytes) > MAX_CONFIG_BYTES:
        raise TargetConfigError(f"{where}/{CONFIG_FILE}: {len(raw_bytes)} bytes, more than a config needs")
    try:
        raw = json.loads(raw_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TargetConfigError(f"{where}/{CONFIG_FILE}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise TargetConfigError(f"{where}/{CONFIG_FILE}: not a mapping")
    for key, why in REFUSED_KEYS.items():
        if key in raw and raw[key] not in (None, False, {}):
            cls = RemoteCodeError if key != "quantization_config" else TargetConfigError
            raise cls(f"{where}/{CONFIG_FILE}: refused: `{key}` {why}")
    family = raw.get("model_type")
    if family not in FAMILIES:
        reason = f" ({REFUSED_FAMILIES[family]})" if family in REFUSED_FAMILIES else ""
        raise UnsupportedFamilyError(
            f"{where}/{CONFIG_FILE}: model_type {family!r} is not a supported target family{reason}; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    architectures = raw.get("architectures")
    if architectures is not None and architectures != [FAMILIES[family]]:
        raise TargetConfigError(
            f"{where}/{CONFIG_FILE}: architectures {architectures!r}, model_type {family!r} means "
            f"[{FAMILIES[family]!r}]"
        )
    for key, bound in {**CONFIG_BOUNDS, **OPTIONAL_BOUNDS}.items():
        value = raw.get(key)
        if value is None and key in OPTIONAL_BOUNDS:
            continue
        if type(value) is not int or not 1 <= value <= bound:
            raise TargetConfigError(f"{where}/{CONFIG_FILE}: {key} is {value!r}, expected an integer in [1, {bound}]")
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    if heads % kv_heads:
        raise TargetConfigError(f"{where}/{CONFIG_FILE}: num_attention_heads {heads} is not a multiple of "
                                f"num_key_value_heads {kv_heads}")
    if raw.get("head_dim") is None and raw["hidden_size"] % heads:
        raise TargetConfigError(f"{where}/{CONFIG_FILE}: hidden_size {raw['hidden_size']} is not a multiple of "
                                f"num_attention_heads {heads} (and no head_dim)")
    if "tie_word_embeddings" in raw and not isinstance(raw["tie_word_embeddings"], bool):
        raise TargetConfigError(f"{where}/{CONFIG_FILE}: tie_word_embeddings is {raw['tie_word_embeddings']!r}")
    try:
        config = CONFIG_MAPPING[family].from_dict(raw)
    except Exception as exc:  # noqa: BLE001 - untrusted JSON: whatever transformers' validators raise refuses it
        raise TargetConfigError(f"{where}/{CONFIG_FILE}: {exc}") from None
    try:
        check_scaling(rope_of(config)[1])
    except UnsupportedRopeError as exc:
        raise TargetConfigError(f"{where}/{CONFIG_FILE}: {exc}") from None
    return config


def _meta_model(config: PretrainedConfig) -> PreTrainedModel:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def ties_lm_head(model: PreTrainedModel) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def check_layout(config: PretrainedConfig, layout: WeightsLayout, where: str) -> None:
    """Every parameter the config implies present with its exact shape and a float dtype, nothing
    else; a tied lm_head may be absent. Checked on the meta device: no weight is allocated."""
    try:
        model = _meta_model(config)
    except Exception as exc:  # noqa: BLE001
        # A value transformers cannot build from (an unknown hidden_act, a malformed rope_scaling...).
        raise TargetConfigError(f"{where}/{CONFIG_FILE}: no {FAMILIES[config.model_type]} can be built from it "
                                f"({type(exc).__name__}: {exc})") from None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    optional = {"lm_head.weight"} if ties_lm_head(model) else set()
    implied = sum(p.numel() for p in model.parameters())
    if implied > MAX_PARAMETERS:
        raise TargetConfigError(f"{where}/{CONFIG_FILE}: implies {implied} parameters (limit {MAX_PARAMETERS})")
    missing = sorted(set(expected) - set(layout.tensors) - optional)
    if missing:
        raise MissingTensorError(
            f"{where}: tensor {missing[0]} {expected[missing[0]]} is in no weights file"
            + (f" (and {len(missing) - 1} more: {', '.join(missing[1:4])}...)" if len(missing) > 1 else "")
        )
    unexpected = sorted(set(layout.tensors) - set(expected))
    if unexpected:
        entry = layout.tensors[unexpected[0]]
        raise UnexpectedTensorError(
            f"{where}/{entry.file}: tensor {entry.name} is not a parameter of {FAMILIES[config.model_type]} "
            f"with this config" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )
    stored = sum(e.numel for n, e in layout.tensors.items() if n not in optional)  # a tied lm_head repeats
    for name in sorted(layout.tensors):
        entry = layout.tensors[name]
        if entry.shape != expected[name]:
            raise TensorShapeError(f"{where}/{entry.file}: tensor {name} has shape {entry.shape}, "
                                   f"config.json implies {expected[name]} (the headers hold {stored} parameters, "
                                   f"config.json implies {implied})")
        if entry.dtype not in FLOAT_DTYPES:
            raise TensorDtypeError(f"{where}/{entry.file}: tensor {name} is {entry.dtype}, "
                                   f"expected one of {', '.join(sorted(FLOAT_DTYPES))}")
    if stored != implied:
        raise TargetConfigError(f"{where}: weights hold {stored} parameters, config.json implies {implied}")


def read_layout(directory: Path, where: str) -> WeightsLayout:
    """Headers of the weight files in a local directory (tensor data is not read)."""
    names = sorted(p.name for p in directory.iterdir())
    first = layout_file(names, where)
    if first == SINGLE_FILE:
        weight_map = None
        files = [SINGLE_FILE]
    else:
        with open_file(directory, INDEX_FILE, where) as f:
            weight_map = parse_index(f.read(MAX_INDEX_BYTES + 1), where)
        files = list(dict.fromkeys(weight_map.values()))
    shards = {}
    for file in files:
        path = directory / file
        if not path.is_file():
            raise WeightsLayoutError(f"{where}: {INDEX_FILE} names {file}, which is not in the checkpoint")
        with open_file(directory, file, where) as f:
            shards[file] = read_header(f, os.fstat(f.fileno()).st_size, f"{where}/{file}")
    if weight_map is None:
        return WeightsLayout((SINGLE_FILE,), shards[SINGLE_FILE])
    return join_shards(weight_map, shards, where)


def memory_needed(layout: WeightsLayout, dtype: torch.dtype) -> int:
    """Bytes loading allocates: every stored tensor in `dtype` (a tied lm_head that is stored is kept to
    compare), plus the largest staging tensor when the file's dtype is not `dtype`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    weights = sum(e.numel for e in layout.tensors.values()) * itemsize
    staging = max((e.nbytes for e in layout.tensors.values() if STORED_DTYPES[e.dtype] != dtype), default=0)
    return weights + staging


def check_memory(layout: WeightsLayout, where: str, device: str, dtype: torch.dtype) -> None:
    """TargetMemoryError, naming the checkpoint and both figures, when the weights need more memory than
    the process may allocate: the headers' sizes, not the files' (a sparse file passes every header check)."""
    needed, bound = memory_needed(layout, dtype), available_memory(device)
    if bound is not None and needed > bound.bytes:
        raise TargetMemoryError(
            f"{where}: loading needs {needed} bytes ({needed / 2**30:.1f} GiB) for its weights in {dtype} on "
            f"{device}, more than the {bound.bytes} bytes ({bound.bytes / 2**30:.1f} GiB) this process may use "
            f"({bound.source}); load it where there is more memory, or in a smaller target.dtype"
        )
