"""EAGLE-1/2 drafter (FastRL's online kind), laid out as vLLM's `EagleLlamaForCausalLM`.

    token x_{t+1} --embed_tokens--> e (H) --+
                                            cat (2H) --fc--> (H) --decoder layer--> f^_{t+1} --lm_head--> x^_{t+2}
    target feature f_t (H) -----------------+

* `embed_tokens` and `lm_head` belong to the target: frozen here, copied from the
  current policy, and not written to the checkpoint (vLLM shares the target's).
* The decoder layer has no input norm (EAGLE removes it; vLLM replaces it with
  Identity) and there is no final norm: the output is the residual stream.
* Parameter names match the checkpoint keys vLLM loads: `fc.weight`,
  `layers.0.self_attn.q_proj.weight`, ..., `layers.0.post_attention_layernorm.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def check_heads(hidden_size: int, num_attention_heads: int, num_key_value_heads: int) -> None:
    if hidden_size % num_attention_heads:
        raise ValueError("hidden_size must be divisible by num_attention_heads")
    if num_attention_heads % num_key_value_heads:
        raise ValueError("num_attention_heads must be divisible by num_key_value_heads")


@dataclass(frozen=True)
class EagleConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        check_heads(self.hidden_size, self.num_attention_heads, self.num_key_value_heads)

    @classmethod
    def from_target(cls, target_config, intermediate_size: int | None = None) -> EagleConfig:
        """The drafter mirrors the target's widths so that its features live in the same space."""
        rope = getattr(target_config, "rope_parameters", None) or {}
        return cls(
            vocab_size=target_config.vocab_size,
            hidden_size=target_config.hidden_size,
            intermediate_size=intermediate_size or target_config.intermediate_size,
            num_attention_heads=target_config.num_attention_heads,
            num_key_value_heads=target_config.num_key_value_heads,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
            max_position_embeddings=target_config.max_position_embeddings,
        )


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.eps)).to(dtype)


def rotary(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N) positions -> cos, sin of shape (B, 1, N, head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim)
    freqs = position_ids.float()[..., None] * inv_freq  # (B, N, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, N, head_dim)
    return emb.cos()[:, None], emb.sin()[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        B, N, _ = hidden_states.shape
        c = self.config
        query_states = self.q_proj(hidden_states).view(B, N, c.num_attention_heads, c.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(B, N, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(B, N, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        # (B, heads, N, head_dim)
        query_states = query_states * cos + rotate_half(query_states) * sin
        key_states = key_states * cos + rotate_half(key_states) * sin
        groups = c.num_attention_heads // c.num_key_value_heads
        key_states = key_states.repeat_interleave(groups, dim=1)
        value_states = value_states.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=attention_mask)
        return self.o_proj(attn.transpose(1, 2).reshape(B, N, -1))  # (B, N, H)


class MLP(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class DecoderLayer(nn.Module):
    """Llama decoder layer without the input norm (EAGLE's first layer)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(hidden_states, cos, sin, attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class EagleDrafter(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(config)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    def use_target_heads(self, target: nn.Module) -> None:
        """Take (frozen) token embeddings and lm_head from the current target."""
        embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        if embed.shape != self.embed_tokens.weight.shape or head.shape != self.lm_head.weight.shape:
            raise ValueError(
                f"target embeddings {tuple(embed.shape)} / lm_head {tuple(head.shape)} do not fit the drafter "
                f"(vocab {self.config.vocab_size}, hidden {self.config.hidden_size})"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            self.lm_head.weight.copy_(head)

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """
        hidden_states:  (B, N, H) target features f_t
        input_ids:      (B, N)    tokens x_{t+1}
        position_ids:   (B, N)
        attention_mask: (B, 1, N, N) bool, True = may attend
        returns:        (B, N, H) predicted features f^_{t+1}
        """
        B, N, H = hidden_states.shape
        if input_ids.shape != (B, N):
            raise ValueError(f"input_ids shape {tuple(input_ids.shape)} does not match hidden states {(B, N)}")
        if H != self.config.hidden_size:
            raise ValueError(f"hidden size {H} differs from the drafter's {self.config.hidden_size}")
        inputs_embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)  # (B, N, H)
        hidden_states = self.fc(torch.cat([inputs_embeds, hidden_states], dim=-1))  # (B, N, 2H) -> (B, N, H)
        cos, sin = rotary(position_ids, self.config.head_dim, self.config.rope_theta)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin, attention_mask)
        return hidden_states

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights that go into the checkpoint: everything but the target's embeddings and lm_head."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}
