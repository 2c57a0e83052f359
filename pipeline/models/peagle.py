"""P-EAGLE drafter: parallel-drafting EAGLE-3, laid out as speculators' `peagle` model and vLLM's
parallel-drafting EAGLE-3 load it.

One forward proposes k tokens. After the committed pairs (aux_t, x_{t+1}) of EAGLE-3, the
sequence holds k - 1 masked slots: the learnable `mask_hidden` in place of the aux states
(projected through the same fc) and the token `mask_token_id`, at positions t+1 .. t+k-1.
Depth d (slot d, or the pair itself at d = 0) predicts token x_{t+2+d}:

    aux (n_aux H_t) | mask_hidden -> [fc_norm] -> fc -> g (H)
    x_{t+1} | mask_token_id -> embed_tokens -> e (H)
    layers.0: EAGLE-3's first layer over cat(e, g) (2H) -> layers.1 .. L-1: plain Llama blocks (H)
        -> norm -> lm_head (draft vocab) -> x^_{t+2+d}

Training (COD sampling): depth 0 keeps every position of the packed sequence; depth d keeps
a random `max(down_sample_ratio**d, down_sample_ratio_min)` share of the response positions,
drawn among the anchors kept at depth d - 1, so each kept chain (anchor a, depths 0..d) is
whole. The kept rows form one flat sequence; its cross-depth mask lets row (a, d) see the
depth-0 rows of its document up to a and its own chain's rows of depth <= d: exactly what
the masked slot of depth d sees at decoding time, where a is the last committed position.

The checkpoint is EAGLE-3's (`layers.N.` for every layer) plus `mask_hidden`, and the
embeddings are trained, so they are always written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.eagle import (
    MLP,
    CachedProposer,
    CommittedPairs,
    DraftCache,
    DraftChooser,
    LayerCache,
    RMSNorm,
    gather_rows,
)
from pipeline.models.eagle3 import (
    Eagle3Config,
    Eagle3DecoderLayer,
    Eagle3Drafter,
    checkpoint_fields,
    read_positions,
    vllm_vocab_layout,
)
from pipeline.models.eagle3 import stored_layer_ids as eagle3_stored_layer_ids
from pipeline.models.rope import RotaryEmbedding, apply_rotary
from pipeline.models.teacher import Teacher
from pipeline.models.ttt import UnrollPrefix

if TYPE_CHECKING:
    from pipeline.data.shard_format import HiddenSample


@dataclass(frozen=True)
class PEagleConfig(Eagle3Config):
    """EAGLE-3's fields (`norm_output` is not read: no state is carried between depths) and P-EAGLE's."""

    num_hidden_layers: int = 2  # layers.0 is EAGLE-3's; the others plain Llama blocks
    mask_token_id: int = 0  # the token input of every masked depth
    num_depths: int = 8  # tokens one forward predicts (training and at most k at decoding)
    down_sample_ratio: float = 0.7  # COD: depth d keeps a ratio**d share of the positions ...
    down_sample_ratio_min: float = 0.2  # ... but never less than this

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers {self.num_hidden_layers} must be >= 1")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.num_depths < 1:
            raise ValueError(f"num_depths {self.num_depths} must be >= 1")
        if not 0 < self.down_sample_ratio_min <= self.down_sample_ratio <= 1:
            raise ValueError("COD ratios must satisfy 0 < down_sample_ratio_min <= down_sample_ratio <= 1, got "
                             f"{self.down_sample_ratio_min} and {self.down_sample_ratio}")


# -- COD sampling and the cross-depth mask


@dataclass(frozen=True)
class CodSample:
    """The rows of one parallel training forward: row i is depth `depth[i]` of the chain at `anchor[i]`."""

    anchor: torch.Tensor  # (M,) int64 position of the chain's real pair
    depth: torch.Tensor  # (M,) int64; depth 0 rows come first, one per position, in order

    def to(self, device: torch.device | str) -> CodSample:
        return CodSample(self.anchor.to(device), self.depth.to(device))


def cod_sample(
    loss_mask: torch.Tensor, document_ids: torch.Tensor, num_depths: int, ratio: float, ratio_min: float,
    generator: torch.Generator | None = None,
) -> CodSample:
    """COD sampling over one packed sequence (on the CPU; the caller moves the indices).

    loss_mask (N,): 1 where the token a row predicts at depth 0 counts; document_ids (N,).
    Depth d keeps floor((n_valid - d) * max(ratio**d, ratio_min)) chains (fewer if fewer are
    left), drawn among the chains of depth d - 1 whose token t + d is still a counted token of
    the same document; n_valid is the number of counted positions.
    """
    loss_mask, document_ids = loss_mask.cpu(), document_ids.cpu()
    n = loss_mask.shape[0]
    anchors = [torch.arange(n)]
    n_valid = int((loss_mask > 0).sum())
    alive = torch.arange(n)  # chains that reached depth d - 1
    for d in range(1, num_depths):
        size = int((n_valid - d) * max(ratio**d, ratio_min))
        ahead = alive + d
        inside = ahead < n
        alive, ahead = alive[inside], ahead[inside]
        alive = alive[(document_ids[ahead] == document_ids[alive]) & (loss_mask[ahead] > 0)]
        if size <= 0 or alive.numel() == 0:
            break
        if alive.numel() > size:
            alive = alive[torch.randperm(alive.numel(), generator=generator)[:size]].sort().values
        anchors.append(alive)
    depth = torch.cat([torch.full_like(a, d) for d, a in enumerate(anchors)])
    return CodSample(anchor=torch.cat(anchors), depth=depth)


def cross_depth_mask(sample: CodSample, document_ids: torch.Tensor) -> torch.Tensor:
    """(M, M) bool, True where row q may attend row kv: kv is a depth-0 row of q's document at or
    before q's anchor, or a row of q's own chain at a depth <= q's.

    anchor [0 1 2 0 1 0], depth [0 0 0 1 1 2] (one document):

               kv  a0d0 a1d0 a2d0 a0d1 a1d1 a0d2
        a0d0        x    .    .    .    .    .
        a1d0        x    x    .    .    .    .
        a2d0        x    x    x    .    .    .
        a0d1        x    .    .    x    .    .
        a1d1        x    x    .    .    x    .
        a0d2        x    .    .    x    .    x
    """
    anchor, depth = sample.anchor, sample.depth
    doc = document_ids[anchor]  # (M,)
    same_doc = doc[:, None] == doc[None, :]  # (M, M)
    context = (depth[None, :] == 0) & (anchor[None, :] <= anchor[:, None])
    chain = (anchor[None, :] == anchor[:, None]) & (depth[None, :] <= depth[:, None])
    return same_doc & (context | chain)


def context_mask(sample: CodSample, document_ids: torch.Tensor) -> torch.Tensor:
    """(M, N) bool: the depth-0 rows (one per position) each row may attend, those of its document up to
    its anchor: the first N columns of `cross_depth_mask`."""
    n = document_ids.shape[0]
    same_doc = document_ids[sample.anchor][:, None] == document_ids[None, :]  # (M, N)
    return same_doc & (torch.arange(n, device=document_ids.device)[None, :] <= sample.anchor[:, None])


@dataclass(frozen=True)
class ParallelMask:
    """What each row of a parallel forward attends, kept in its structure: the depth-0 rows of its
    context (a dense (M, N) block) and the deeper rows of its own chain (at most num_depths - 1 each),
    as EAGLE-3's TTT keeps a causal block and diagonals. Row i's chain is at rows chain[i]."""

    context: torch.Tensor  # (B or 1, 1, M, N) bool
    chain: torch.Tensor  # (M, D-1) int64: the row of depth j+1 of row i's chain (0 where none)
    chain_valid: torch.Tensor  # (M, D-1) bool: that row exists and is no deeper than row i

    @classmethod
    def of(cls, sample: CodSample, context: torch.Tensor) -> ParallelMask:
        """context (M, N) or (B, 1, M, N); depth-0 rows are the sample's first N, one per position in order."""
        anchor, depth = sample.anchor, sample.depth  # (M,)
        n, depths = context.shape[-1], int(depth.max()) + 1
        table = torch.full((n, depths), -1, dtype=torch.int64, device=anchor.device)  # (N, D) row of (a, d)
        table[anchor, depth] = torch.arange(anchor.shape[0], device=anchor.device)
        chain = table[anchor, 1:]  # (M, D-1)
        deep_enough = torch.arange(1, depths, device=anchor.device)[None, :] <= depth[:, None]  # (M, D-1)
        context = context if context.dim() == 4 else context[None, None]
        return cls(context, chain.clamp(min=0), (chain >= 0) & deep_enough)

    def dense(self) -> torch.Tensor:
        """(B or 1, 1, M, M) bool: the same mask over every row (`cross_depth_mask` in training)."""
        m, n = self.chain.shape[0], self.context.shape[-1]
        context = F.pad(self.context, (0, m - n))  # (B or 1, 1, M, M)
        return context | self.chains()[None, None]

    def chains(self) -> torch.Tensor:
        """(M, M) bool: row i attends row j of its own chain (itself too, from depth 1)."""
        m = self.chain.shape[0]
        rows = torch.arange(m, device=self.chain.device)
        chain = torch.zeros(m, m, dtype=torch.bool, device=self.chain.device)
        chain[rows[:, None].expand_as(self.chain)[self.chain_valid], self.chain[self.chain_valid]] = True
        return chain


class MaskedAttention:
    """A parallel training forward's attention under a `ParallelMask`. On a CPU, kept in its structure:
    scores against the N depth-0 rows and the chain's few rows, never the (M, M) ones. On a GPU by SDPA
    under the dense mask (its memory-efficient kernel never holds the scores)."""

    position_offset = 0  # rows carry their own positions (anchor + depth)

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: ParallelMask
    ) -> torch.Tensor:
        """query/key/value (B, heads, M, D) of every row -> (B, heads, M, D)."""
        if query.is_cuda:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask.dense())
        n = attention_mask.context.shape[-1]
        return _structured(query, key[:, :, :n], value[:, :, :n], key, value, attention_mask)


@dataclass
class PrefixMaskedAttention(MaskedAttention):
    """`MaskedAttention` over one chunk of anchors after earlier chunks: the context (B, 1, M, P + C) covers the
    earlier chunks' depth-0 keys (held in `prefix`, extended here) and the chunk's C own; chains are the chunk's."""

    prefix: UnrollPrefix
    layer: int
    anchors: int  # C: the chunk's depth-0 rows, the first C of its M

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: ParallelMask
    ) -> torch.Tensor:
        c = self.anchors
        key0, value0 = self.prefix.extend(self.layer, key[:, :, :c], value[:, :, :c])  # (B, heads, P + C, Dh)
        # By SDPA over [the depth-0 keys | the chunk's M rows], the chains a mask: no (M, P + C) scores per head
        # are held (the CPU's flash kernel tiles them), so a chunk's memory does not grow with the earlier ones.
        context = attention_mask.context  # (B or 1, 1, M, P + C)
        chains = attention_mask.chains().expand(*context.shape[:2], -1, -1)  # (B or 1, 1, M, M)
        mask = torch.cat([context, chains], dim=-1)  # (B or 1, 1, M, P + C + M)
        return F.scaled_dot_product_attention(query, torch.cat([key0, key], dim=2), torch.cat([value0, value], dim=2),
                                              attn_mask=mask)


def _structured(query: torch.Tensor, key0: torch.Tensor, value0: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, mask: ParallelMask) -> torch.Tensor:
    """query, key, value (B, heads, M, Dh) of every row; key0/value0 (B, heads, N, Dh) the depth-0 rows the
    context (B or 1, 1, M, N) covers -> (B, heads, M, Dh): one softmax over the context and the row's chain."""
    n = key0.shape[2]
    scale = 1.0 / math.sqrt(query.shape[-1])
    block = (query @ key0.transpose(-1, -2)) * scale  # (B, heads, M, N)
    block = block.masked_fill(~mask.context, torch.finfo(block.dtype).min)
    chain_keys, chain_values = key[:, :, mask.chain], value[:, :, mask.chain]  # (B, heads, M, D-1, Dh)
    chain = (query[..., None, :] * chain_keys).sum(-1) * scale  # (B, heads, M, D-1)
    chain = chain.masked_fill(~mask.chain_valid, torch.finfo(chain.dtype).min)
    probs = torch.cat([block, chain], dim=-1).softmax(dim=-1, dtype=torch.float32).to(value.dtype)
    out = probs[..., :n] @ value0  # (B, heads, M, Dh)
    return out + (probs[..., n:, None] * chain_values).sum(-2)


# -- the model


class PEagleAttention(nn.Module):
    """Llama attention over H-wide inputs (the layers after the first), under an explicit mask."""

    def __init__(self, config: PEagleConfig) -> None:
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.rotary_emb = RotaryEmbedding(d, config.rope_theta, config.rope_scaling, config.max_position_embeddings)

    def forward(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
        cache: LayerCache | MaskedAttention,
    ) -> torch.Tensor:
        """
        hidden_states:  (B, Nq, H)
        position_ids:   (B, Nq)
        attention_mask: (B, 1, Nq, S + Nq) bool against the cache's columns and these
        cache:          this layer's key/value columns (decoding), or training's masked attention
        returns:        (B, Nq, H)
        """
        B, Nq, _ = hidden_states.shape
        c = self.config
        cos, sin = self.rotary_emb(position_ids)  # (B, 1, Nq, D)
        groups = c.num_attention_heads // c.num_key_value_heads
        query_states = self.q_proj(hidden_states).view(B, Nq, c.num_attention_heads, c.head_dim)  # (B, Nq, heads, D)
        key_states = self.k_proj(hidden_states).view(B, Nq, c.num_key_value_heads, c.head_dim)  # (B, Nq, kv, D)
        value_states = self.v_proj(hidden_states).view(B, Nq, c.num_key_value_heads, c.head_dim)
        query_states = apply_rotary(query_states.transpose(1, 2), cos, sin)  # (B, heads, Nq, D)
        key_states = apply_rotary(key_states.transpose(1, 2).repeat_interleave(groups, dim=1), cos, sin)
        value_states = value_states.transpose(1, 2).repeat_interleave(groups, dim=1)  # (B, heads, Nq, D)
        attn = cache.attend(query_states, key_states, value_states, attention_mask)  # (B, heads, Nq, D)
        return self.o_proj(attn.transpose(1, 2).reshape(B, Nq, -1))  # (B, Nq, H)


class PEagleDecoderLayer(nn.Module):
    """A plain Llama decoder layer (pre-norm attention and MLP, each with its residual)."""

    def __init__(self, config: PEagleConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PEagleAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, hidden_states: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
        cache: LayerCache | MaskedAttention,
    ) -> torch.Tensor:
        """hidden_states (B, Nq, H) -> (B, Nq, H); the other arguments as `PEagleAttention.forward`'s."""
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_ids,
                                                       attention_mask, cache)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class PEagleDrafter(nn.Module):
    def __init__(self, config: PEagleConfig) -> None:
        super().__init__()
        self.config = config
        n_aux, h_t = len(config.aux_layer_ids), config.target_hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # trained, unlike EAGLE-3's
        self.fc_norm = nn.ModuleList([RMSNorm(h_t, config.rms_norm_eps) for _ in range(n_aux)]) \
            if config.fc_norm else None
        self.fc = nn.Linear(n_aux * h_t, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config)]
                                    + [PEagleDecoderLayer(config) for _ in range(1, config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, n_aux * h_t))  # stands for the aux states of depth >= 1
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        self.own_embeddings = False  # True once it has its own (the target's at birth, then trained)

    # -- vocabulary, as EAGLE-3's
    set_vocab = Eagle3Drafter.set_vocab
    draft_to_target = Eagle3Drafter.draft_to_target
    choose = Eagle3Drafter.choose
    project_aux = Eagle3Drafter.project_aux

    # -- the drafter interface (pipeline.models.drafter.Drafter)
    kind = "peagle"

    @property
    def decode_layer_ids(self) -> list[int]:
        return list(self.config.aux_layer_ids)

    @property
    def target_hidden_size(self) -> int:
        return self.config.target_hidden_size

    def attach(self, target: nn.Module) -> None:
        """A new drafter's embeddings start from the target's; trained ones are the drafter's own."""
        embed = target.get_input_embeddings().weight
        if embed.shape != self.embed_tokens.weight.shape:
            raise ValueError(f"target embeddings {tuple(embed.shape)} do not fit the drafter")
        if not self.own_embeddings:
            with torch.no_grad():
                self.embed_tokens.weight.copy_(embed)
            self.own_embeddings = True

    def init_lm_head(self, target: nn.Module) -> None:
        with torch.no_grad():
            self.lm_head.weight.copy_(target.get_output_embeddings().weight[self.draft_to_target])

    def stored_layer_ids(self, num_layers: int) -> list[int]:
        return eagle3_stored_layer_ids(self.config.aux_layer_ids, num_layers)

    def training_sample(
        self, sample: HiddenSample, num_layers: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As EAGLE-3's: (input_ids (T,), features (T, (n_aux + 1) H_t) of layers [aux..., L], loss_mask (T,))."""
        positions = read_positions(self.config.aux_layer_ids, num_layers)
        return sample.input_ids, sample.hidden[:, positions].flatten(1), sample.loss_mask

    def teacher(self, target: nn.Module) -> Teacher:
        head = target.get_output_embeddings().weight[self.draft_to_target].detach().to(self.lm_head.weight.dtype)
        return Teacher(norm=target.model.norm.requires_grad_(False), head=head)

    def checkpoint_config(self) -> dict:
        """EAGLE-3's config.json with every layer, and what vLLM's parallel drafting reads: the masked
        token as `pard_token` (and `ptd_token_id`), the depths as `num_speculative_tokens` at most."""
        c = self.config
        return {
            **checkpoint_fields(c),
            "num_hidden_layers": c.num_hidden_layers,
            **({"fc_norm": True} if c.fc_norm else {}),
            "parallel_drafting": True,
            "mask_token_id": c.mask_token_id,
            "pard_token": c.mask_token_id,
            "ptd_token_id": c.mask_token_id,
            "num_depths": c.num_depths,
            "down_sample_ratio": c.down_sample_ratio,
            "down_sample_ratio_min": c.down_sample_ratio_min,
        }

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return vllm_vocab_layout(self.trainable_state_dict(), self.config, self.draft_to_target)

    def proposer(self) -> PEagleProposer:
        return PEagleProposer(self)

    def draft_unrolled(
        self, features: torch.Tensor, step_ids: list[torch.Tensor], position_ids: torch.Tensor,
        attention_mask: torch.Tensor, prefix: UnrollPrefix | None = None,
    ) -> torch.Tensor:
        """Teacher-forced drafts at every position at once: every chain to depth len(step_ids) - 1 in one
        parallel forward (only step_ids[0], the real x_{t+1}, is read: deeper depths read the mask).

        features (B, N, n_aux * H_t); attention_mask (B, 1, N, N) the pairs' own mask -> (steps, B, N)
        target token ids, depth j at t drafting token t+2+j. With `prefix`, the N anchors are one chunk after
        the earlier chunks' depth-0 rows (their keys, extended by the call): attention_mask (B, 1, N, P + N)."""
        B, N, _ = features.shape
        steps = len(step_ids)
        anchor = torch.arange(N, device=features.device).repeat(steps)  # (steps N,)
        depth = torch.arange(steps, device=features.device).repeat_interleave(N)
        attention = None if prefix is None else [PrefixMaskedAttention(prefix, i, N) for i in range(len(self.layers))]
        hidden = self.forward_parallel(features, step_ids[0], position_ids, CodSample(anchor, depth),
                                       attention_mask[:, :, anchor], attention)  # (B, steps N, H)
        tokens = self.draft_to_target[self.lm_head(self.norm(hidden)).argmax(-1)]  # (B, steps N)
        return tokens.view(B, steps, N).transpose(0, 1)  # (steps, B, N)

    # -- forward
    def forward_parallel(
        self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, sample: CodSample,
        context: torch.Tensor, attention: list[MaskedAttention] | None = None,
    ) -> torch.Tensor:
        """One parallel forward over the rows of `sample` (training: a COD sample of one packed sequence).

        features:       (B, N, n_aux * H_t) aux states at t
        input_ids:      (B, N) x_{t+1}
        position_ids:   (B, N) t within its document
        sample:         M rows (anchor, depth), depth 0's first: one per position, in order
        context:        (M, N) or (B, 1, M, N) bool: the depth-0 rows each row attends (training:
                        `context_mask`); its own chain's rows up to its depth it attends too
        returns:        (B, M, H) each row's state before the final norm
        """
        anchor, depth = sample.anchor, sample.depth  # (M,)
        real = (depth == 0)[None]  # (1, M)
        ids = torch.where(real, input_ids[:, anchor], self.config.mask_token_id)  # (B, M)
        aux = torch.where(real[..., None], features[:, anchor], self.mask_hidden.to(features.dtype))  # (B, M, A)
        positions = position_ids[:, anchor] + depth  # (B, M)
        mask = ParallelMask.of(sample, context)
        attention = attention or [MaskedAttention() for _ in self.layers]
        return self.layer_stack(ids, self.project_aux(aux), positions, mask, attention)

    def layer_stack(
        self, input_ids: torch.Tensor, hidden_states: torch.Tensor, position_ids: torch.Tensor,
        attention_mask: torch.Tensor | ParallelMask, caches: list[LayerCache] | list[MaskedAttention],
    ) -> torch.Tensor:
        """
        input_ids:      (B, Nq) tokens (real or the mask token)
        hidden_states:  (B, Nq, H) projected aux states (real or mask_hidden)
        position_ids:   (B, Nq)
        attention_mask: (B, 1, Nq, S + Nq) bool (decoding), or a training forward's ParallelMask
        caches:         one per layer: decoding's key/value columns, or a training forward's attention
        returns:        (B, Nq, H) before the final norm
        """
        inputs_embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)  # (B, Nq, H)
        hidden_states = self.layers[0](inputs_embeds, hidden_states, position_ids, attention_mask, caches[0])
        for layer, cache in zip(self.layers[1:], caches[1:], strict=True):
            hidden_states = layer(hidden_states, position_ids, attention_mask, cache)
        return hidden_states

    def logits_input(self, state: torch.Tensor) -> torch.Tensor:
        return self.norm(state)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, the embeddings included (they are trained)."""
        return dict(self.state_dict())

    @classmethod
    def from_eagle3(cls, eagle3: Eagle3Drafter, config: PEagleConfig) -> PEagleDrafter:
        """A P-EAGLE drafter that drafts depth 0 exactly as `eagle3` drafts its first token: its first
        layer, fc, norms, head, vocabulary and embeddings carry over; the added layers start as the
        identity (their output projections zero), mask_hidden as a fresh draw."""
        c = eagle3.config
        shared = ("vocab_size", "draft_vocab_size", "hidden_size", "target_hidden_size", "intermediate_size",
                  "num_attention_heads", "num_key_value_heads", "aux_layer_ids", "fc_norm")
        different = [f for f in shared if getattr(c, f) != getattr(config, f)]
        if different:
            raise ValueError(f"EAGLE-3 drafter differs from the P-EAGLE config in {different}")
        model = cls(config)
        state = {("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v
                 for k, v in eagle3.state_dict().items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"EAGLE-3 tensors with no P-EAGLE counterpart: {unexpected}")
        with torch.no_grad():
            for layer in model.layers[1:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        model.own_embeddings = True
        return model


class PEagleProposer(CachedProposer):
    """Drafts with a P-EAGLE drafter: one forward over the committed pairs (which stay in its key/value
    caches) and k - 1 masked slots after each row's last pair (withdrawn after the proposal); depth d's
    output is the (d+1)-th proposed token."""

    def __init__(self, drafter: PEagleDrafter) -> None:
        self.drafter = drafter.eval()
        self.layer_ids = drafter.decode_layer_ids
        self.cache = DraftCache(len(drafter.layers))
        self.forwards = 0

    @torch.no_grad()
    def propose(self, pairs: CommittedPairs, k: int, chooser: DraftChooser | None = None) -> torch.Tensor:
        """pairs: the block committed since the last call -> (B, k) proposed target tokens per row (the argmax, or
        the chooser's pick, depth by depth)."""
        d = self.drafter
        if k > d.config.num_depths:
            raise ValueError(f"k = {k} exceeds the {d.config.num_depths} depths the P-EAGLE drafter predicts")
        B, N = pairs.next_tokens.shape
        dtype = d.fc.weight.dtype
        committed = self.cache.length
        last = pairs.last()  # (B,)
        depths = torch.arange(1, k, device=last.device)  # (k-1,)
        slot_positions = gather_rows(pairs.positions, last) + depths  # (B, k-1)
        ids = torch.cat([pairs.next_tokens, torch.full((B, k - 1), d.config.mask_token_id,
                                                       device=last.device, dtype=pairs.next_tokens.dtype)], dim=1)
        fused = d.project_aux(torch.cat([pairs.features.to(dtype),
                                         d.mask_hidden.to(dtype).expand(B, k - 1, -1)], dim=1))  # (B, N+k-1, H)
        positions = torch.cat([pairs.positions, slot_positions], dim=1)  # (B, N + k - 1)
        valid = torch.cat([pairs.valid, torch.ones(B, k - 1, dtype=torch.bool, device=last.device)], dim=1)
        mask = self.cache.extend(valid)  # (B, 1, N + k - 1, S + N + k - 1)
        state = d.layer_stack(ids, fused, positions, mask, self.cache.layers)  # (B, N + k - 1, H)
        self.forwards += 1
        self.cache.crop(committed + N)
        rows = torch.cat([gather_rows(state, last), state[:, N:]], dim=1)  # (B, k, H): depth 0, then 1 .. k-1
        logits = d.lm_head(d.norm(rows))  # (B, k, draft_vocab)
        return torch.stack([d.choose(logits[:, j], chooser) for j in range(k)], dim=1)  # (B, k)
