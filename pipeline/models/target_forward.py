"""The target's forward pass: the last hidden state, the logits, and the layers drafters read
(by vLLM's layer ids); what a drafter checkpoint records of the target it was trained for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache, PretrainedConfig, PreTrainedModel

from pipeline.models.rope import rope_of

# Families whose decoder reads one attention mask per layer type (full or sliding-window attention).
MASKS_PER_LAYER_TYPE = {"qwen2", "qwen3"}


@dataclass(frozen=True)
class TargetOutput:
    features: torch.Tensor  # (B, T, H) last hidden state after the final norm
    logits: torch.Tensor  # (B, T, V); (B, 1, V) with `logits_at`
    layers: torch.Tensor | None = None  # (B, T, len(layer_ids), H) requested layers, vLLM ids


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
    decoding = {"attention_mask": attention_mask, "position_ids": position_ids, "cache": past_key_values,
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
    features = out.last_hidden_state  # (B, T, H) on the home device, where the final norm is
    # A policy split across devices (layer_split) leaves each layer's state on its layer's device.
    layers = torch.stack([states[i].to(features.device) for i in layer_ids], dim=2)  # (B, T, n, H)
    return TargetOutput(features, logits(features), layers)


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
    its way into the module that reads it (decoder layer k, or the final norm for id L), and
    returned on the home device (a policy split across devices holds layer k on its own).
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
    home = inner.embed_tokens.weight.device
    return [caught[i].to(home) for i in layer_ids]
