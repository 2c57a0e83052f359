"""The target model (the RL policy): its checkpoints loaded, and kept per process.

A policy checkpoint is a transformers directory at a URI: config.json plus safetensors
weights (`model.safetensors`, or shards named by `model.safetensors.index.json`). It is
written by an untrusted RL trainer: `target_checks` checks its config and every tensor
header before anything is allocated, and loading reads only what passed. Nothing is fetched
from a hub and no code named by a config runs.

Local checkpoints are memory-mapped in place; object-storage ones go through a bounded
local cache (checkpoint_cache). `load_policy` keeps the last policy per process, so the
assets of one step (extraction, evaluation, deploy) load it once. A policy larger than the
process's device has its layers split across the devices beside it (`target.split`, layer_split).
The forward pass and the features drafters read are `target_forward`'s.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from pipeline.data.store import ObjectStore
from pipeline.launch.rendezvous import private_dir
from pipeline.models import layer_split
from pipeline.models.checkpoint_cache import CheckpointCache, RemoteFile
from pipeline.models.target_checks import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    STORED_DTYPES,
    CheckpointListing,
    TargetConfigError,
    TiedWeightsError,
    check_config,
    check_layout,
    list_checkpoint,
    open_file,
    read_layout,
    ties_lm_head,
)
from pipeline.models.weights import (
    INDEX_FILE,
    MAX_INDEX_BYTES,
    SINGLE_FILE,
    TensorEntry,
    WeightsLayout,
    WeightsLayoutError,
    layout_file,
    parse_index,
)

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

try:  # transformers 5
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4
    from transformers.modeling_utils import no_init_weights

log = logging.getLogger(__name__)

# A checkpoint per RL step: per-load progress bars are noise in run logs.
transformers.utils.logging.disable_progress_bar()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadSettings:
    """How policies load: weights dtype ("auto": bfloat16 on CUDA, float32 elsewhere), the local cache
    of object-storage checkpoints, how many loaded policies a process keeps, and whether a policy's
    layers are split across the devices from the process's own (layer_split)."""

    dtype: str = "auto"
    cache_dir: Path | None = None  # this user's cache directory (XDG's) when None: never a shared temp dir
    cache_max_bytes: int = 64 * 2**30
    cached_policies: int = 1
    split: layer_split.SplitMode = "auto"
    split_devices: int = 0  # GPUs a split spans from the process's own; 0: its share of the node's (gpu_block)

    def torch_dtype(self, device: str | torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def cache(self) -> CheckpointCache:
        # Policies are loaded from these copies: a folder another local user could create or write first
        # would hand this process their weights, so it is this user's alone (rendezvous.private_dir).
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return CheckpointCache(private_dir(self.cache_dir or home / "drafter-target-cache"), self.cache_max_bytes)


def load_settings(cfg: PipelineConfig) -> LoadSettings:
    """The settings of a PipelineConfig's `target` section."""
    t = cfg.target
    cache_dir = Path(t.cache_dir) if t.cache_dir else cfg.data_path / "target-cache"
    return LoadSettings(t.dtype, cache_dir, int(t.cache_max_gb * 2**30), t.cached_policies, t.split, t.split_devices)


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


def save_checkpoint(model: PreTrainedModel, store: ObjectStore, prefix: str,
                    tokenizer: PreTrainedTokenizerBase | None = None) -> str:
    """Write config.json and the safetensors weights (one file, or shards + index for a large
    model) under `prefix`, after the tokenizer's files when given (vLLM serves a policy with its
    tokenizer); returns the directory URI."""
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        names = sorted(p.name for p in Path(tmp).iterdir() if p.is_file())
        # The index (or the single file) goes last: a reader that sees it finds every shard in place.
        names.sort(key=lambda n: n in (INDEX_FILE, SINGLE_FILE))
        for name in names:
            store.write_bytes(f"{prefix}/{name}", (Path(tmp) / name).read_bytes())
    return store.uri(prefix)


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


def _read_config(directory: Path, where: str) -> PretrainedConfig:
    path = directory / CONFIG_FILE
    if not path.is_file() and not path.is_symlink():
        raise TargetConfigError(f"{where}: no {CONFIG_FILE}")
    with open_file(directory, CONFIG_FILE, where) as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_CONFIG_BYTES:
            raise TargetConfigError(f"{where}/{CONFIG_FILE}: {size} bytes, more than a config needs")
        return check_config(f.read(MAX_CONFIG_BYTES + 1), where)


def _materialize(config: PretrainedConfig, directory: Path, layout: WeightsLayout, where: str,
                 placement: layer_split.Placement, dtype: torch.dtype) -> PreTrainedModel:
    """Allocate the model uninitialised where `placement` puts each part and read each tensor's bytes
    from the offsets its checked header gave: straight into the parameter when it is on the CPU in the
    file's dtype, else through a staging tensor (peak memory: the model plus its largest tensor). A
    file changed since its header was checked can then change values, never shapes or sizes."""
    device = placement.home
    if not placement.split:
        with no_init_weights(), torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:  # built as on one device, its parameters then allocated on their own devices
        with no_init_weights(), torch.device(device), layer_split.parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        layer_split.allocate(model, placement)
    model.tie_weights()  # skipped with initialisation
    state = model.state_dict(keep_vars=True)
    tied_head = "lm_head.weight" if ties_lm_head(model) else None
    own_head = None
    for file in layout.files:
        with open_file(directory, file, where) as f:
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
    layer_split.connect(model, placement)
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
    dtype = settings.torch_dtype(device)
    placement = layer_split.plan(config, layout, listing.uri, device, dtype, settings.split, settings.split_devices)
    if placement.split:
        log.info("%s: split across %d devices (%s)", listing.uri, len(placement.devices), placement.describe())
    return _materialize(config, directory, layout, listing.uri, placement, dtype)


def policy_directory(store: ObjectStore, checkpoint_uri: str, settings: LoadSettings | None = None) -> Path:
    """The local directory of the policy a step's pointer names, for another process to load (a vLLM replica): the
    checkpoint itself when local, its cache copy (config.json and weights only) otherwise."""
    return _local_directory(list_checkpoint(store.resolve(checkpoint_uri), store), settings or LoadSettings())


class _PolicyCache:
    """The last loaded policies of this process, by (checkpoint identity, device, dtype, split)."""

    def __init__(self) -> None:
        self._models: OrderedDict[tuple, PreTrainedModel] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, listing: CheckpointListing, device: str, settings: LoadSettings) -> PreTrainedModel:
        key = (listing.identity, str(torch.device(device)), settings.torch_dtype(device), settings.split,
               settings.split_devices)
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
    listing = list_checkpoint(store.resolve(checkpoint_uri), store)
    return POLICIES.get(listing, device, settings or LoadSettings())
