"""Rotary position phases of the draft layer, with the target's RoPE: its theta and its scaling.

vLLM and SGLang build the draft layer's rotary embedding from the drafter's config.json, which
carries the target's `rope_theta` and `rope_scaling` (Llama 3.x: `llama3`; long-context Qwen: `yarn`).
The drafter trains under the same phases, computed by transformers' own RoPE functions (the ones the
target's forward uses), so a drafter served next to a Llama-3.1 target sees the positions it learned.

Only scalings that depend on the position alone are followed: `dynamic` and `longrope` change the
phases with the sequence length, so a target using them is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

FOLLOWED_SCALINGS = ("linear", "llama3", "yarn")


class UnsupportedRopeError(ValueError):
    """A RoPE scaling the draft layer cannot reproduce."""


def rope_of(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a transformers config object; see `rope_from`."""
    return rope_from({key: getattr(config, key, None) for key in ("rope_parameters", "rope_theta", "rope_scaling")})


def rope_from(fields: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from config fields of either transformers major version
    (`rope_parameters` in 5, `rope_theta` / `rope_scaling` in 4); rope_scaling None means plain RoPE."""
    params = dict(fields.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or fields.get("rope_theta") or 10000.0
    scaling = params if fields.get("rope_parameters") else fields.get("rope_scaling")
    return float(theta), dict(scaling) if scaling_kind(scaling or None) != "default" else None


def scaling_kind(scaling: dict[str, Any] | None) -> str:
    return "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))


def check_scaling(scaling: dict[str, Any] | None) -> None:
    kind = scaling_kind(scaling)
    if kind not in ("default", *FOLLOWED_SCALINGS):
        raise UnsupportedRopeError(
            f"rope_scaling of type {kind!r}: the draft layer follows plain RoPE and {', '.join(FOLLOWED_SCALINGS)} "
            "(a scaling that changes with the sequence length is not reproduced)"
        )


class RotaryEmbedding(nn.Module):
    """Llama's rotary phases; `inv_freq` is computed once and, like transformers', not saved."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                 max_position_embeddings: int = 2048) -> None:
        super().__init__()
        check_scaling(scaling)
        kind = scaling_kind(scaling)
        if kind == "default":
            inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # (D/2,)
            self.attention_scaling = 1.0
        else:
            config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                                 max_position_embeddings=max_position_embeddings,
                                 rope_parameters={**scaling, "rope_type": kind, "rope_theta": theta})
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, None)  # (D/2,), float
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (B, N) -> cos, sin (B, 1, N, D), float32 whatever the model's dtype."""
        freqs = position_ids.float()[..., None] * self.inv_freq.float()  # (B, N, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (B, N, D)
        return (emb.cos() * self.attention_scaling)[:, None], (emb.sin() * self.attention_scaling)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, N, D) rotated by cos, sin (B, 1, N, D); computed in x's dtype."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)
