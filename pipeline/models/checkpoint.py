"""Drafter checkpoints as vLLM and SGLang load them, with no conversion step.

EAGLE-1/2 (`drafter.kind: eagle`):
    <dir>/
    ├── config.json         LlamaConfig + "architectures": ["EagleLlamaForCausalLM"]; with the target
    │                       given, its vocab_size, rope_theta, rope_scaling, max_position_embeddings
    └── model.safetensors   fc.weight, layers.0.* (no embed_tokens / lm_head: vLLM
                            shares the target's, which is what we train against)
    vllm serve TARGET --speculative-config '{"method": "eagle", "model": "<dir>", "num_speculative_tokens": 4}'

EAGLE-3 (`drafter.kind: eagle3`):
    <dir>/
    ├── config.json         "architectures": ["LlamaForCausalLMEagle3"], Llama fields, draft_vocab_size,
    │                       target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids,
    │                       norm_before_residual (always written: engines differ on its default),
    │                       fc_norm / norm_output (EAGLE-3.1; written only when true: SpecForge 0.2
    │                       reads `norm_output: false` as "no final norm", vLLM always applies it);
    │                       with the target given, its rope_theta, rope_scaling, max_position_embeddings
    └── model.safetensors   midlayer.*, fc.weight, norm.weight, lm_head.weight, d2t, t2d
                            [, fc_norm.N.weight (EAGLE-3.1)] [, embed_tokens.weight if not the target's]
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "<dir>", "num_speculative_tokens": 4}'

Import also takes the published variants (`layers.0.` for `midlayer.`, a `model.` prefix)
and refuses anything that is not safetensors.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pipeline.models.drafter import Drafter
from pipeline.models.eagle import ARCHITECTURE, EagleConfig, EagleDrafter
from pipeline.models.eagle3 import ARCHITECTURE as EAGLE3_ARCHITECTURE
from pipeline.models.eagle3 import Eagle3Config, Eagle3Drafter, default_aux_layer_ids
from pipeline.models.rope import UnsupportedRopeError, check_scaling, rope_from
from pipeline.models.target_forward import TargetMetadata

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A drafter checkpoint that does not match its config or is not safetensors."""


def target_fields(model: Drafter, target: TargetMetadata) -> dict:
    """What the engines read of the target through the drafter's config: its vocabulary, and its
    position encoding (rope_theta, rope_scaling as the target has them; the draft layer attends
    over the target's positions) up to its max_position_embeddings (vLLM caps the served context
    at the draft model's). A drafter shaped after another target (vocabulary, width, position
    encoding) is refused."""
    config = model.config
    mismatched = [(name, ours, theirs) for name, ours, theirs in (
        ("vocab_size", config.vocab_size, target.vocab_size),
        ("target hidden_size", model.target_hidden_size, target.hidden_size),
        ("rope_theta", config.rope_theta, target.rope_theta),
        ("rope_scaling", config.rope_scaling, target.rope_scaling),
    ) if ours != theirs]
    if mismatched:
        raise CheckpointError("drafter does not fit the target it is exported for: " + ", ".join(
            f"{name} {ours} != target's {theirs}" for name, ours, theirs in mismatched))
    return {
        "vocab_size": target.vocab_size,
        "rope_theta": target.rope_theta,
        "rope_scaling": target.rope_scaling,
        "max_position_embeddings": max(config.max_position_embeddings, target.max_position_embeddings),
    }


def save_drafter(model: Drafter, directory: Path, target: TargetMetadata | None = None) -> Path:
    """Write the checkpoint; with `target`, its config carries what the engines need of that target."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.checkpoint_tensors().items()}
    config = model.checkpoint_config()
    if target is not None:
        config.update(target_fields(model, target))
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    share_as_umask_allows(directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return directory


_UMASK_LOCK = threading.Lock()


def process_umask() -> int:
    """The process's umask, read without changing it where the kernel says it (Linux 4.7+)."""
    try:
        found = re.search(r"^Umask:\s*([0-7]+)$", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        found = None
    if found:
        return int(found.group(1), 8)
    with _UMASK_LOCK:  # set and restored at once: the only portable way to read it
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def share_as_umask_allows(path: Path) -> None:
    """Give a file the mode a plain `open()` would have (0666 less the umask). safetensors' writer creates its
    file 0600 whatever the umask, and a vLLM server running as another user must read the weights as it
    reads config.json."""
    path.chmod(0o666 & ~process_umask())


def _read(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not weights_path.exists():
        pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        hint = f" (found {', '.join(pickles)}: pickled weights are refused)" if pickles else ""
        raise CheckpointError(f"{directory}: a drafter checkpoint needs {WEIGHTS_FILE}{hint}")
    if not config_path.exists():
        raise CheckpointError(f"{directory}: a drafter checkpoint needs {CONFIG_FILE}")
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{weights_path}: not a readable safetensors file ({exc})") from None
    return json.loads(config_path.read_text()), tensors


def load_drafter(directory: Path, target_num_layers: int | None = None) -> Drafter:
    """Load and check a checkpoint of either kind; the caller then attaches the target.

    `target_num_layers` supplies vLLM's default aux layers for EAGLE-3 checkpoints that do
    not name theirs (the EAGLE authors' releases)."""
    raw, tensors = _read(directory)
    architectures = raw.get("architectures")
    if architectures == [EAGLE3_ARCHITECTURE]:
        return _load_eagle3(directory, raw, tensors, target_num_layers)
    if architectures != [ARCHITECTURE]:
        raise CheckpointError(
            f"{directory / CONFIG_FILE}: architectures {architectures}, expected "
            f"[{ARCHITECTURE!r}] or [{EAGLE3_ARCHITECTURE!r}]"
        )
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    rope_theta, rope_scaling = _rope(raw, config_path)
    try:
        config = EagleConfig(**{k: raw[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "max_position_embeddings")}, rope_theta=rope_theta, rope_scaling=rope_scaling)
    except KeyError as exc:
        raise CheckpointError(f"{config_path}: missing key {exc}") from None
    model = EagleDrafter(config)
    expected = model.trainable_state_dict()
    _check_tensors(weights_path, expected, tensors, extra={"embed_tokens.weight", "lm_head.weight"})
    model.load_state_dict({k: tensors[k].to(torch.float32) for k in expected}, strict=False)
    return model


def _check_tensors(
    weights_path: Path, expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
    optional: set[str] = frozenset(), extra: set[str] = frozenset(),
) -> None:
    """The checkpoint's tensors against what its config implies, for every kind: each expected key
    present (but `optional` ones) at its shape, and no key beyond them but the `extra` ones."""
    missing = sorted(set(expected) - set(tensors) - optional)
    unexpected = sorted(set(tensors) - set(expected) - extra)
    if missing or unexpected:
        raise CheckpointError(f"{weights_path}: missing keys {missing}, unexpected keys {unexpected}")
    for key, tensor in expected.items():
        if key in tensors and tensors[key].shape != tensor.shape:
            raise CheckpointError(
                f"{weights_path}: {key} has shape {tuple(tensors[key].shape)}, config implies {tuple(tensor.shape)}"
            )


def _rope(raw: dict, config_path: Path) -> tuple[float, dict | None]:
    """The checkpoint's (rope_theta, rope_scaling), of a scaling the draft layer can follow."""
    theta, scaling = rope_from(raw)
    try:
        check_scaling(scaling)
    except UnsupportedRopeError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None
    return theta, scaling


def _canonical_eagle3_key(key: str) -> str:
    """Published variants -> our names: a `model.` prefix, `layers.0.` for `midlayer.`."""
    key = key.removeprefix("model.")
    return "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key


def _load_eagle3(
    directory: Path, raw: dict, tensors: dict[str, torch.Tensor], target_num_layers: int | None
) -> Eagle3Drafter:
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or raw.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        if target_num_layers is None:
            raise CheckpointError(f"{config_path}: no eagle_aux_hidden_state_layer_ids and no target to default from")
        aux = default_aux_layer_ids(target_num_layers)
    rope_theta, rope_scaling = _rope(raw, config_path)
    try:
        heads = raw["num_attention_heads"]
        config = Eagle3Config(
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            aux_layer_ids=tuple(aux),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            # Absent means the EAGLE authors' / SpecForge layer (residual before hidden_norm).
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            fc_norm=bool(raw.get("fc_norm", False)),
            norm_output=bool(raw.get("norm_output", False)),
        )
    except KeyError as exc:
        raise CheckpointError(f"{config_path}: missing key {exc}") from None
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None

    tensors = {_canonical_eagle3_key(k): v for k, v in tensors.items()}
    model = Eagle3Drafter(config)
    expected = model.trainable_state_dict()
    optional = {"d2t", "t2d"} if config.draft_vocab_size == config.vocab_size else set()
    _check_tensors(weights_path, expected, tensors, optional=optional, extra={"embed_tokens.weight"})
    state = {k: tensors[k].to(v.dtype) for k, v in expected.items() if k in tensors}
    if "embed_tokens.weight" in tensors:
        embed = tensors["embed_tokens.weight"]
        if embed.shape != model.embed_tokens.weight.shape:
            raise CheckpointError(f"{weights_path}: embed_tokens.weight has shape {tuple(embed.shape)}")
        state["embed_tokens.weight"] = embed.to(torch.float32)
        model.own_embeddings = True
    model.load_state_dict(state, strict=False)
    return model
