"""The target model (the RL policy): checked loading of its checkpoints and its forward pass.

A policy checkpoint is a transformers directory at a URI: config.json plus safetensors
weights (`model.safetensors`, or shards named by `model.safetensors.index.json`). The model
class comes from config.json's `model_type` through transformers' Auto classes, limited to
the families in FAMILIES, whose decoders share the layout the forward relies on
(model.model.embed_tokens, model.model.layers, model.model.norm, model.lm_head) and whose
layer ids are tested against a plain transformers forward. Nothing is fetched from a hub and
no code named by a config runs.

The checkpoint is written by an untrusted RL trainer, so loading checks before it allocates:
config sizes within bounds, then every safetensors header (never tensor data) against the
state dict the config implies, built on the meta device. Every refusal is a
TargetCheckpointError subclass whose message names the checkpoint (URI without credentials)
and the file, tensor or key.

Local checkpoints are memory-mapped in place; object-storage ones go through a bounded
local cache (checkpoint_cache). `load_policy` keeps the last policy per process, so the
assets of one step (extraction, evaluation, deploy) load it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlsplit, urlunsplit

import fsspec
import torch
import transformers
from transformers import AutoModelForCausalLM, Cache, LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from pipeline.data.local_files import LocalPathError, open_regular
from pipeline.data.store import ObjectStore
from pipeline.models.checkpoint_cache import CheckpointCache, RemoteFile
from pipeline.models.memory import available_memory
from pipeline.models.rope import UnsupportedRopeError, check_scaling, rope_of
from pipeline.models.weights import (
    FLOAT_DTYPES,
    INDEX_FILE,
    MAX_INDEX_BYTES,
    SINGLE_FILE,
    TargetCheckpointError,
    TensorEntry,
    WeightsLayout,
    WeightsLayoutError,
    join_shards,
    layout_file,
    parse_index,
    read_header,
)

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

try:  # transformers 5
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4
    from transformers.modeling_utils import no_init_weights

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
# Families whose decoder reads one attention mask per layer type (full or sliding-window attention).
MASKS_PER_LAYER_TYPE = {"qwen2", "qwen3"}
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
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STORED_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}

# A checkpoint per RL step: per-load progress bars are noise in run logs.
transformers.utils.logging.disable_progress_bar()


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


@dataclass(frozen=True)
class TargetOutput:
    features: torch.Tensor  # (B, T, H) last hidden state after the final norm
    logits: torch.Tensor  # (B, T, V); (B, 1, V) with `logits_at`
    layers: torch.Tensor | None = None  # (B, T, len(layer_ids), H) requested layers, vLLM ids


@dataclass(frozen=True)
class LoadSettings:
    """How policies load: weights dtype ("auto": bfloat16 on CUDA, float32 elsewhere), the local cache
    of object-storage checkpoints, and how many loaded policies a process keeps."""

    dtype: str = "auto"
    cache_dir: Path | None = None  # a directory under the system temp dir when None
    cache_max_bytes: int = 64 * 2**30
    cached_policies: int = 1

    def torch_dtype(self, device: str | torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def cache(self) -> CheckpointCache:
        root = self.cache_dir or Path(tempfile.gettempdir()) / "drafter-target-cache"
        return CheckpointCache(root, self.cache_max_bytes)


def load_settings(cfg: PipelineConfig) -> LoadSettings:
    """The settings of a PipelineConfig's `target` section."""
    t = cfg.target
    cache_dir = Path(t.cache_dir) if t.cache_dir else cfg.data_path / "target-cache"
    return LoadSettings(t.dtype, cache_dir, int(t.cache_max_gb * 2**30), t.cached_policies)


# -- building (tests and the simulated RL source)

def tiny_llama_config(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_target(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def save_checkpoint(model: PreTrainedModel, store: ObjectStore, prefix: str) -> str:
    """Write config.json and the safetensors weights (one file, or shards + index for a large
    model) under `prefix`; returns the directory URI."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        names = sorted(p.name for p in Path(tmp).iterdir() if p.name == CONFIG_FILE or ".safetensors" in p.name)
        # The index (or the single file) goes last: a reader that sees it finds every shard in place.
        names.sort(key=lambda n: n in (INDEX_FILE, SINGLE_FILE))
        for name in names:
            store.write_bytes(f"{prefix}/{name}", (Path(tmp) / name).read_bytes())
    return store.uri(prefix)


# -- locating

def resolve_uri(store: ObjectStore, uri_or_key: str) -> str:
    """A pointer may hold a key relative to the store root or a URI the store's policy allows (uris.py)."""
    return store.resolve(uri_or_key)


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


# -- checking

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


def _tied(model: PreTrainedModel) -> bool:
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
    optional = {"lm_head.weight"} if _tied(model) else set()
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
        with _open_file(directory, INDEX_FILE, where) as f:
            weight_map = parse_index(f.read(MAX_INDEX_BYTES + 1), where)
        files = list(dict.fromkeys(weight_map.values()))
    shards = {}
    for file in files:
        path = directory / file
        if not path.is_file():
            raise WeightsLayoutError(f"{where}: {INDEX_FILE} names {file}, which is not in the checkpoint")
        with _open_file(directory, file, where) as f:
            shards[file] = read_header(f, os.fstat(f.fileno()).st_size, f"{where}/{file}")
    if weight_map is None:
        return WeightsLayout((SINGLE_FILE,), shards[SINGLE_FILE])
    return join_shards(weight_map, shards, where)


# -- loading

def _local_directory(listing: CheckpointListing, settings: LoadSettings) -> Path:
    """The directory to read: the checkpoint itself when local, its cache entry otherwise. Only
    config.json and weight files are copied; config.json is checked before anything is."""
    if listing.local:
        return Path(listing.path)
    if CONFIG_FILE not in listing.sizes:
        raise TargetConfigError(f"{listing.uri}: no {CONFIG_FILE}")
    if listing.sizes[CONFIG_FILE] > MAX_CONFIG_BYTES:
        raise TargetConfigError(f"{listing.uri}/{CONFIG_FILE}: {listing.sizes[CONFIG_FILE]} bytes")
    check_config(listing.fs.cat_file(f"{listing.path}/{CONFIG_FILE}"), listing.uri)
    first = layout_file(list(listing.sizes), listing.uri)
    names = [CONFIG_FILE, first]
    if first == INDEX_FILE:
        if listing.sizes[INDEX_FILE] > MAX_INDEX_BYTES:
            raise WeightsLayoutError(f"{listing.uri}/{INDEX_FILE}: {listing.sizes[INDEX_FILE]} bytes")
        weight_map = parse_index(listing.fs.cat_file(f"{listing.path}/{INDEX_FILE}"), listing.uri)
        shards = list(dict.fromkeys(weight_map.values()))
        absent = [s for s in shards if s not in listing.sizes]
        if absent:
            raise WeightsLayoutError(f"{listing.uri}: {INDEX_FILE} names {absent[0]}, not in the checkpoint")
        names += shards
    files = [RemoteFile(n, listing.sizes[n]) for n in names]
    return settings.cache().fetch(listing.fs, listing.path, files, listing.identity, listing.uri)


def _open_file(directory: Path, name: str, where: str) -> BinaryIO:
    """A file of a local checkpoint, opened as a regular file and never through a symlink."""
    try:
        return open_regular(directory / name, f"{where}/{name}")
    except LocalPathError as exc:
        raise TargetConfigError(str(exc)) from None


def _read_config(directory: Path, where: str) -> PretrainedConfig:
    path = directory / CONFIG_FILE
    if not path.is_file() and not path.is_symlink():
        raise TargetConfigError(f"{where}: no {CONFIG_FILE}")
    with _open_file(directory, CONFIG_FILE, where) as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_CONFIG_BYTES:
            raise TargetConfigError(f"{where}/{CONFIG_FILE}: {size} bytes, more than a config needs")
        return check_config(f.read(MAX_CONFIG_BYTES + 1), where)


def _materialize(config: PretrainedConfig, directory: Path, layout: WeightsLayout, where: str,
                 device: str, dtype: torch.dtype) -> PreTrainedModel:
    """Allocate the model uninitialised on `device` and read each tensor's bytes from the offsets its
    checked header gave: straight into the parameter when it is on the CPU in the file's dtype, else
    through a staging tensor (peak memory: the model plus its largest tensor). A file changed since
    its header was checked can then change values, never shapes or sizes."""
    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # skipped with initialisation
    state = model.state_dict(keep_vars=True)
    tied_head = "lm_head.weight" if _tied(model) else None
    own_head = None
    for file in layout.files:
        with _open_file(directory, file, where) as f:
            for entry in sorted((e for e in layout.tensors.values() if e.file == file), key=lambda e: e.offset):
                param = None if entry.name == tied_head else state[entry.name]
                source = STORED_DTYPES[entry.dtype]
                direct = param is not None and param.device.type == "cpu" and param.dtype == source
                staging = param.data if direct else torch.empty(entry.shape, dtype=source)
                _read_into(f, entry, staging, where)
                if param is None:
                    own_head = staging
                elif not direct:
                    with torch.no_grad():
                        param.copy_(staging)
    if own_head is not None and not torch.equal(own_head.to(device, dtype), model.get_output_embeddings().weight):
        raise TiedWeightsError(f"{where}: config.json ties lm_head to embed_tokens, but the checkpoint's "
                               "lm_head.weight differs from embed_tokens.weight")
    return model.eval()


def _read_into(f: Any, entry: TensorEntry, out: torch.Tensor, where: str) -> None:
    """entry's bytes into the contiguous CPU tensor `out`, whose size its checked header fixes."""
    view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
    f.seek(entry.offset)
    done = 0
    while done < entry.nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise WeightsLayoutError(f"{where}/{entry.file}: tensor {entry.name} cut short while loading")
        done += n


def load_checkpoint(uri: str, device: str = "cpu", store: ObjectStore | None = None,
                    settings: LoadSettings | None = None) -> PreTrainedModel:
    """A fresh model of its own (callers may train it) from a checkpoint directory at any fsspec URI;
    `store` lends its options (an S3 endpoint, say) to URIs of its protocol."""
    settings = settings or LoadSettings()
    listing = list_checkpoint(uri, store)
    return _load(listing, device, settings)


def _load(listing: CheckpointListing, device: str, settings: LoadSettings) -> PreTrainedModel:
    directory = _local_directory(listing, settings)
    config = _read_config(directory, listing.uri)
    layout = read_layout(directory, listing.uri)
    check_layout(config, layout, listing.uri)
    check_memory(layout, listing.uri, device, settings.torch_dtype(device))
    return _materialize(config, directory, layout, listing.uri, device, settings.torch_dtype(device))


def memory_needed(layout: WeightsLayout, dtype: torch.dtype) -> int:
    """Bytes `_materialize` allocates: every stored tensor in `dtype` (a tied lm_head that is stored is kept
    to compare), plus the largest staging tensor when the file's dtype is not `dtype`."""
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


class _PolicyCache:
    """The last loaded policies of this process, by (checkpoint identity, device, dtype)."""

    def __init__(self) -> None:
        self._models: OrderedDict[tuple, PreTrainedModel] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, listing: CheckpointListing, device: str, settings: LoadSettings) -> PreTrainedModel:
        key = (listing.identity, str(torch.device(device)), settings.torch_dtype(device))
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            # Drop the oldest before loading: two policies of one size need not fit at once.
            while self._models and len(self._models) >= settings.cached_policies:
                self._models.popitem(last=False)
            model = _load(listing, device, settings).requires_grad_(False)
            if settings.cached_policies > 0:
                self._models[key] = model
            return model

    def clear(self) -> None:
        with self._lock:
            self._models.clear()


POLICIES = _PolicyCache()


def load_policy(store: ObjectStore, checkpoint_uri: str, device: str = "cpu",
                settings: LoadSettings | None = None) -> PreTrainedModel:
    """The policy a step's pointer names (a full URI or a key under the store root), frozen and
    shared: a second call for the same checkpoint content in this process returns the same model."""
    listing = list_checkpoint(resolve_uri(store, checkpoint_uri), store)
    return POLICIES.get(listing, device, settings or LoadSettings())


# -- running

@torch.no_grad()
def forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    layer_ids: list[int] | None = None,
    *,
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: Cache | None = None,
    logits_at: torch.Tensor | None = None,
) -> TargetOutput:
    """input_ids (B, T) -> post-norm features (B, T, H), logits (B, T, V) and the requested layers.

    Decoding passes its cache (`past_key_values`, extended in place), the mask over every
    cached and new column (`decoding_mask`) and the new columns' positions (B, T). `logits_at`
    (B,) asks for one column's logits per row, (B, 1, V): a prefill needs only each prompt's last,
    and all of them would be B * T * V floats (gigabytes at a 128k vocabulary).

    Layer ids follow vLLM: id k is the residual stream entering decoder layer k (transformers'
    hidden_states[k] for k < L); id L is the last layer's output BEFORE the final norm. For every
    family in FAMILIES transformers' last hidden_states entry is AFTER the final norm (the same
    tensor as last_hidden_state), so id L is caught on its way into the norm instead.
    """
    decoding = {"attention_mask": attention_mask, "position_ids": position_ids, "past_key_values": past_key_values,
                "use_cache": past_key_values is not None}

    def logits(features: torch.Tensor) -> torch.Tensor:
        if logits_at is None:
            return model.lm_head(features)  # (B, T, V)
        return model.lm_head(features[torch.arange(features.shape[0], device=features.device), logits_at, None])

    if not layer_ids:
        features = model.model(input_ids=input_ids, **decoding).last_hidden_state  # (B, T, H)
        return TargetOutput(features=features, logits=logits(features))
    num_layers = model.config.num_hidden_layers
    bad = [i for i in layer_ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} outside [0, {num_layers}] of the target")
    caught: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: caught.append(args[0]))
    try:
        out = model.model(input_ids=input_ids, output_hidden_states=True, **decoding)
    finally:
        hook.remove()
    states = [*out.hidden_states[:num_layers], caught[0]]  # L + 1 entries, all before the final norm
    features = out.last_hidden_state  # (B, T, H)
    return TargetOutput(features, logits(features), torch.stack([states[i] for i in layer_ids], dim=2))


def decoding_mask(
    config: PretrainedConfig, key_positions: torch.Tensor, key_valid: torch.Tensor, query_positions: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask of a decoding step over a cache with gaps (padding, rejected drafts).

    key_positions, key_valid: (B, S) every cached column, the new ones last
    query_positions:          (B, N) the new columns
    returns:                  key_valid (B, S) when no layer has a sliding window; else (B, 1, N, S)
                              additive, or one per layer type for families that mix full and sliding layers

    transformers derives causality and sliding windows from column indices. Within a row, columns are
    in position order, so causality by index is causality by position and a padding mask suffices;
    a window by index is not a window by position once a row has gaps, so it is built here from the
    positions: a window of W keeps the keys at positions p - W < key <= p, as transformers' masks do.
    """
    window = sliding_window(config)
    if window is None:
        return key_valid.long()
    q, k = query_positions[:, :, None], key_positions[:, None, :]  # (B, N, 1), (B, 1, S)
    causal = key_valid[:, None, :] & (k <= q)  # (B, N, S)

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)[:, None]  # (B, 1, N, S)

    windowed = additive(causal & (q - k < window))
    if config.model_type in MASKS_PER_LAYER_TYPE:
        return {"full_attention": additive(causal), "sliding_attention": windowed}
    return windowed


def sliding_window(config: PretrainedConfig) -> int | None:
    """The window of the target's sliding-window layers; None when no layer has one."""
    window = getattr(config, "sliding_window", None)
    if config.model_type in MASKS_PER_LAYER_TYPE and "sliding_attention" not in (config.layer_types or []):
        return None
    return window or None


def model_id(model: PreTrainedModel) -> str:
    c = model.config
    prefix = "tiny-llama" if c.model_type == "llama" else c.model_type
    return f"{prefix}-v{c.vocab_size}-h{c.hidden_size}-l{c.num_hidden_layers}"


@dataclass(frozen=True)
class TargetMetadata:
    """What a serving engine needs to know of the target to run a drafter next to it."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None: plain RoPE

    @classmethod
    def of(cls, config: PretrainedConfig) -> TargetMetadata:
        """From a transformers config of either major version (rope_parameters in 5, rope_theta /
        rope_scaling in 4)."""
        theta, scaling = rope_of(config)
        return cls(config.model_type, config.hidden_size, config.vocab_size, config.num_hidden_layers,
                   config.max_position_embeddings, theta, scaling)


@torch.no_grad()
def layer_states(model: PreTrainedModel, input_ids: torch.Tensor, layer_ids: list[int] | None) -> list[torch.Tensor]:
    """input_ids (B, T) -> one (B, T, H) tensor per requested layer (vLLM ids, as in `forward`), or
    [post-norm last layer] when `layer_ids` is None.

    What extraction runs: no logits (at a 128k vocabulary the lm_head is a quarter of a 1B
    target's forward) and no KV cache; only the requested layers are kept, each caught on
    its way into the module that reads it (decoder layer k, or the final norm for id L).
    """
    inner = model.model
    if not layer_ids:
        return [inner(input_ids=input_ids, use_cache=False).last_hidden_state]
    num_layers = model.config.num_hidden_layers
    bad = [i for i in layer_ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} outside [0, {num_layers}] of the target")
    caught: dict[int, torch.Tensor] = {}

    def catch(layer_id: int):
        def hook(_module, args, kwargs):
            caught[layer_id] = args[0] if args else kwargs["hidden_states"]
        return hook

    modules = [*inner.layers[:num_layers], inner.norm]  # module k reads the residual stream of vLLM id k
    hooks = [modules[i].register_forward_pre_hook(catch(i), with_kwargs=True) for i in sorted(set(layer_ids))]
    try:
        inner(input_ids=input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [caught[i] for i in layer_ids]
