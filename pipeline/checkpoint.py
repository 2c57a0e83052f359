"""Drafter checkpoints as vLLM loads them, with no conversion step.

    <dir>/
    ├── config.json         LlamaConfig + "architectures": ["EagleLlamaForCausalLM"]
    └── model.safetensors   fc.weight, layers.0.* (no embed_tokens / lm_head: vLLM
                            shares the target's, which is what we train against)

Serve with:
    vllm serve TARGET --speculative-config '{"method": "eagle", "model": "<dir>", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pipeline.eagle import EagleConfig, EagleDrafter

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "EagleLlamaForCausalLM"


class CheckpointError(ValueError):
    """A drafter checkpoint that does not match its config or is not safetensors."""


def vllm_config(config: EagleConfig) -> dict:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def save_drafter(model: EagleDrafter, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.trainable_state_dict().items()}
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(vllm_config(model.config), indent=2))
    return directory


def load_drafter(directory: Path) -> EagleDrafter:
    """Load and check a checkpoint; the caller then attaches the target's embeddings and lm_head."""
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.exists() or not weights_path.exists():
        raise CheckpointError(f"{directory}: a drafter checkpoint needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    raw = json.loads(config_path.read_text())
    if raw.get("architectures") != [ARCHITECTURE]:
        raise CheckpointError(f"{config_path}: architectures {raw.get('architectures')}, expected [{ARCHITECTURE!r}]")
    try:
        config = EagleConfig(**{k: raw[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "rope_theta", "max_position_embeddings")})
    except KeyError as exc:
        raise CheckpointError(f"{config_path}: missing key {exc}") from None
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{weights_path}: not a readable safetensors file ({exc})") from None
    model = EagleDrafter(config)
    expected = model.trainable_state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected) - {"embed_tokens.weight", "lm_head.weight"})
    if missing or unexpected:
        raise CheckpointError(f"{weights_path}: missing keys {missing}, unexpected keys {unexpected}")
    for key, tensor in expected.items():
        if tensors[key].shape != tensor.shape:
            raise CheckpointError(
                f"{weights_path}: {key} has shape {tuple(tensors[key].shape)}, config implies {tuple(tensor.shape)}"
            )
    model.load_state_dict({k: tensors[k].to(torch.float32) for k in expected}, strict=False)
    return model
