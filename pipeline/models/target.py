"""The target model (the RL policy): loading checkpoints and running the forward pass.

A policy checkpoint is a transformers directory (config.json + model.safetensors) at
a URI; nothing is fetched from a hub. `features` returns what an EAGLE-1/2 drafter
consumes: the last hidden state AFTER the final norm, i.e. exactly what the target's
lm_head reads and what vLLM hands its `eagle` drafter.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import fsspec
import torch
import transformers
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from pipeline.data.store import ObjectStore

CHECKPOINT_FILES = ("config.json", "model.safetensors")

# A checkpoint per RL step is loaded several times per step: per-load progress bars are noise in run logs.
transformers.utils.logging.disable_progress_bar()


@dataclass(frozen=True)
class TargetOutput:
    features: torch.Tensor  # (B, T, H) last hidden state after the final norm
    logits: torch.Tensor  # (B, T, V)
    layers: torch.Tensor | None = None  # (B, T, len(layer_ids), H) requested layers, vLLM ids


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


def build_target(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def save_checkpoint(model: LlamaForCausalLM, store: ObjectStore, prefix: str) -> str:
    """Write config.json + model.safetensors under `prefix`; returns the directory URI."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for name in CHECKPOINT_FILES:
            store.write_bytes(f"{prefix}/{name}", (Path(tmp) / name).read_bytes())
    return store.uri(prefix)


def resolve_uri(store: ObjectStore, uri_or_key: str) -> str:
    """A pointer may hold a full URI or a key relative to the store root."""
    return uri_or_key if "://" in uri_or_key else store.uri(uri_or_key)


def load_checkpoint(uri: str, device: str = "cpu", store: ObjectStore | None = None) -> LlamaForCausalLM:
    """Load a transformers checkpoint directory from any fsspec URI (safetensors only); `store`
    lends its options (an S3 endpoint, say) to URIs of its protocol."""
    fs, path = store.filesystem(uri) if store else fsspec.core.url_to_fs(uri)
    missing = [n for n in CHECKPOINT_FILES if not fs.exists(f"{path}/{n}")]
    if missing:
        raise FileNotFoundError(f"policy checkpoint {uri} lacks {', '.join(missing)} (pickled weights are not read)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in CHECKPOINT_FILES:
            fs.get(f"{path}/{name}", str(Path(tmp) / name))
        config = AutoConfig.from_pretrained(tmp)
        model = LlamaForCausalLM.from_pretrained(tmp, config=config, use_safetensors=True)
    return model.to(device).eval()


def load_policy(store: ObjectStore, checkpoint_uri: str, device: str = "cpu") -> LlamaForCausalLM:
    """The policy a step's pointer names (a full URI or a key under the store root)."""
    return load_checkpoint(resolve_uri(store, checkpoint_uri), device, store)


@torch.no_grad()
def forward(model: LlamaForCausalLM, input_ids: torch.Tensor, layer_ids: list[int] | None = None) -> TargetOutput:
    """input_ids (B, T) -> post-norm features (B, T, H), logits (B, T, V) and the requested layers.

    Layer ids follow vLLM: id k is the residual stream entering decoder layer k
    (transformers' hidden_states[k]); id L is the last layer's output BEFORE the final
    norm, which transformers does not return, so it is caught on its way into the norm.
    """
    if not layer_ids:
        features = model.model(input_ids=input_ids).last_hidden_state  # (B, T, H)
        return TargetOutput(features=features, logits=model.lm_head(features))
    num_layers = model.config.num_hidden_layers
    bad = [i for i in layer_ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} outside [0, {num_layers}] of the target")
    caught: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: caught.append(args[0]))
    try:
        out = model.model(input_ids=input_ids, output_hidden_states=True)
    finally:
        hook.remove()
    states = [*out.hidden_states[:num_layers], caught[0]]  # L + 1 entries, all before the final norm
    features = out.last_hidden_state
    return TargetOutput(features, model.lm_head(features), torch.stack([states[i] for i in layer_ids], dim=2))


def model_id(model: LlamaForCausalLM) -> str:
    c = model.config
    return f"tiny-llama-v{c.vocab_size}-h{c.hidden_size}-l{c.num_hidden_layers}"
