"""Training-time-test (TTT) attention: the keys of one EAGLE-3 unroll, and two ways to attend them.

Step k's query at position t sees step 0's keys at positions <= t of its own document, and the
keys of steps 1..k at t itself; its rotary phase is t + k. Laid out as one key sequence of
(k + 1) N columns, [step 0 | step 1 | ... | step k], that is a block-causal mask on the first
N columns and a diagonal on each later block:

                 step 0 keys (N)            step 1 (N)   ...   step k (N)
    query t      same document, col <= t    col t              col t

* `TTTCache` (any device) scores the first block densely, (B, heads, N, N), and adds the
  diagonal terms one dot product each: simple, and the reference for the other.
* `FlexTTTCache` (CUDA) hands the whole sequence to FlexAttention with a block mask, so the
  kernel visits only the 128 x 128 tiles the mask touches (about a causal attention over the
  documents) and never materialises scores or probabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache

import torch


@dataclass
class TTTCache:
    """Eager TTT attention: step 0's keys (a causal block) and the diagonal ones of later steps."""

    key0: torch.Tensor | None = None  # (B, heads, N0, D)
    value0: torch.Tensor | None = None
    keys: list[torch.Tensor] = field(default_factory=list)  # each (B, heads, Nq, D)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def step(self) -> int:
        return 0 if self.key0 is None else 1 + len(self.keys)

    position_offset = step  # the rotary phase of the step about to attend: the steps before it

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """query/key/value (B, heads, Nq, D) of this step; attention_mask (B, 1, Nq, N0) the causal block."""
        if self.key0 is None:
            self.key0, self.value0 = key, value
        else:
            self.keys.append(key)
            self.values.append(value)
        scale = 1.0 / math.sqrt(query.shape[-1])
        block = (query @ self.key0.transpose(-1, -2)) * scale  # (B, heads, Nq, N0)
        block = block.masked_fill(~attention_mask, torch.finfo(block.dtype).min)
        diagonal = [(query * k).sum(-1, keepdim=True) * scale for k in self.keys]  # each (B, heads, Nq, 1)
        scores = torch.cat([block, *diagonal], dim=-1)  # (B, heads, Nq, N0 + steps)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(value.dtype)
        n0 = self.key0.shape[2]
        attn = probs[..., :n0] @ self.value0  # (B, heads, Nq, D)
        for i, v in enumerate(self.values):
            attn = attn + probs[..., n0 + i, None] * v
        return attn


@cache
def _flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # Compiled once per process; a new sequence length recompiles once, then torch.compile
    # treats the lengths as dynamic.
    return torch.compile(flex_attention)


def ttt_block_mask(document_ids: torch.Tensor, blocks: int):
    """The FlexAttention block mask of a step that has `blocks` key blocks (step k: k + 1).

    document_ids (B, N). The mask reads only tensors indexed by (b, q, kv), no Python ints, so no
    sequence length is baked into its compiled form."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, n = document_ids.shape
    column = torch.arange(n, device=document_ids.device).repeat(blocks)  # (blocks N,) key's position t'
    first = torch.arange(blocks * n, device=document_ids.device) < n  # (blocks N,) a step-0 key
    key_doc = document_ids.repeat(1, blocks)  # (B, blocks N)

    def mask_mod(b, h, q, kv):
        same_doc = key_doc[b, kv] == document_ids[b, q]
        return same_doc & (column[kv] <= q) & (first[kv] | (column[kv] == q))

    return create_block_mask(mask_mod, B, None, n, blocks * n, device=document_ids.device, _compile=True)


@dataclass
class FlexTTTCache:
    """TTT attention by FlexAttention: every step's keys in one sequence, attended under
    `ttt_block_mask` (built from the documents; it stands for the dense causal block)."""

    document_ids: torch.Tensor  # (B, N)
    keys: list[torch.Tensor] = field(default_factory=list)  # each (B, heads, N, D)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def step(self) -> int:
        return len(self.keys)

    position_offset = step  # the rotary phase of the step about to attend: the steps before it

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """query/key/value (B, heads, N, D) of this step -> (B, heads, N, D); `attention_mask` is not read."""
        self.keys.append(key)
        self.values.append(value)
        block_mask = ttt_block_mask(self.document_ids, len(self.keys))
        keys = torch.cat(self.keys, dim=2)  # (B, heads, (k + 1) N, D)
        values = torch.cat(self.values, dim=2)
        return _flex_attention()(query, keys, values, block_mask=block_mask)


def ttt_cache(document_ids: torch.Tensor) -> TTTCache | FlexTTTCache:
    """The cache a training unroll over documents `document_ids` (B, N) uses: FlexAttention on a
    GPU, the eager version elsewhere (FlexAttention on a CPU compiles C++ at run time)."""
    return FlexTTTCache(document_ids) if document_ids.is_cuda else TTTCache()
