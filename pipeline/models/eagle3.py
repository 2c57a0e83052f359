"""EAGLE-3 drafter, laid out as vLLM's / SGLang's `LlamaForCausalLMEagle3`.

    aux hidden states of the target at layers (a, b, c), each (H_t)
        -> [fc_norm per chunk] -> cat (3 H_t) -> fc -> g (H)                 step 0 only
    step k > 0: g = the drafter's own output of step k-1
    token x_{t+1+k} -> embed_tokens -> input_layernorm -> e (H) --+
    g -> hidden_norm -> (H) ------------------------------------- cat (2H) -> attention -> + residual
        -> post_attention_layernorm -> MLP -> + residual = h_k -> norm -> lm_head (draft vocab) -> x^_{t+2+k}

Training-time test (TTT): the query of step k at position t sees the causal block of
step 0's keys (positions <= t of the same sample) plus the keys of steps 1..k at the
same position t; its rotary phase is t + k. This is exactly the attention pattern of the
runtime, where step k's token sits at position t + k and attends to the prefix and to
the earlier draft tokens, so one implementation serves training and drafting.

The draft vocabulary is the N most frequent target tokens: `d2t[i] = target_id - i`
(vLLM), `t2d[target_id] = True` (SGLang).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    check_heads,
    gather_rows,
    llama_fields,
)
from pipeline.models.layers import default_aux_layer_ids  # noqa: F401 - the kind's default, named here too
from pipeline.models.layers import eagle3_stored_layer_ids as stored_layer_ids
from pipeline.models.rope import RotaryEmbedding, apply_rotary
from pipeline.models.teacher import Teacher
from pipeline.models.ttt import BandTTTCache, FlexTTTCache, TTTCache, UnrollPrefix, unroll_cache

if TYPE_CHECKING:
    from pipeline.data.shard_format import HiddenSample

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Config:
    vocab_size: int  # the target's
    draft_vocab_size: int
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # the target's; None: plain RoPE
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm per aux chunk before fc
    norm_output: bool = False  # EAGLE-3.1: carry the post-norm state to the next step

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        check_heads(self.hidden_size, self.num_attention_heads, self.num_key_value_heads)
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]")
        if len(self.aux_layer_ids) < 1:
            raise ValueError("aux_layer_ids must name at least one target layer")


def read_positions(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Where the drafter's inputs [aux..., L] lie among `stored_layer_ids`."""
    stored = stored_layer_ids(aux_layer_ids, num_layers)
    return [stored.index(i) for i in [*aux_layer_ids, num_layers]]


def vllm_vocab_layout(tensors: dict[str, torch.Tensor], config: Eagle3Config,
                      draft_to_target: torch.Tensor) -> dict[str, torch.Tensor]:
    """A draft vocabulary that is the whole target vocabulary has no maps in vLLM's layout: vLLM allocates d2t only
    for a smaller one and refuses a checkpoint that brings it, reading head row i as target token i. So the head's
    rows go in target-id order and d2t, t2d stay out (a checkpoint without them loads as the identity map)."""
    if config.draft_vocab_size != config.vocab_size:
        return tensors
    head = torch.empty_like(tensors["lm_head.weight"])  # (V, H)
    head[draft_to_target] = tensors["lm_head.weight"]
    return {**{k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}, "lm_head.weight": head}


def draft_vocab(token_counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(V,) counts -> d2t (size,) int64 offsets and t2d (V,) bool; ties broken by token id."""
    if size > token_counts.shape[0]:
        raise ValueError(f"draft vocab {size} larger than the target vocab {token_counts.shape[0]}")
    # stable sort on -count keeps the lower id first among equal counts
    order = torch.sort(-token_counts.to(torch.float64), stable=True).indices[:size]
    selected = torch.sort(order).values  # ascending target ids: offsets stay >= 0
    d2t = selected - torch.arange(size)
    t2d = torch.zeros(token_counts.shape[0], dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(2 * h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.rotary_emb = RotaryEmbedding(d, config.rope_theta, config.rope_scaling, config.max_position_embeddings)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: TTTCache | BandTTTCache | FlexTTTCache | LayerCache,
    ) -> torch.Tensor:
        """
        hidden_states:  (B, Nq, 2H)
        position_ids:   (B, Nq) positions of the queries (TTT step 0: of all N0 keys too)
        attention_mask: (B, 1, Nq, N0) bool: TTT, the causal block against step 0's keys;
                        decoding (LayerCache), (B, 1, Nq, S + Nq) against every column
        cache:          the TTT unroll's keys (training) or the decoding columns
        returns:        (B, Nq, H)
        """
        B, Nq, _ = hidden_states.shape
        c = self.config
        cos, sin = self.rotary_emb(position_ids + cache.position_offset)  # (B, 1, Nq, D)
        groups = c.num_attention_heads // c.num_key_value_heads
        query_states = self.q_proj(hidden_states).view(B, Nq, c.num_attention_heads, c.head_dim)  # (B, Nq, heads, D)
        key_states = self.k_proj(hidden_states).view(B, Nq, c.num_key_value_heads, c.head_dim)  # (B, Nq, kv, D)
        value_states = self.v_proj(hidden_states).view(B, Nq, c.num_key_value_heads, c.head_dim)
        query_states = apply_rotary(query_states.transpose(1, 2), cos, sin)  # (B, heads, Nq, D)
        key_states = apply_rotary(key_states.transpose(1, 2).repeat_interleave(groups, dim=1), cos, sin)
        value_states = value_states.transpose(1, 2).repeat_interleave(groups, dim=1)  # (B, heads, Nq, D)
        attn = cache.attend(query_states, key_states, value_states, attention_mask)  # (B, heads, Nq, D)
        return self.o_proj(attn.transpose(1, 2).reshape(B, Nq, -1))  # (B, Nq, heads * D) -> (B, Nq, H)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: TTTCache | BandTTTCache | FlexTTTCache | LayerCache,
    ) -> torch.Tensor:
        """
        inputs_embeds:  (B, Nq, H) embeddings of the tokens
        hidden_states:  (B, Nq, H) the fused aux features (step 0) or the previous step's state
        position_ids, attention_mask, cache: as `Eagle3Attention.forward`'s
        returns:        (B, Nq, H)
        """
        embeds = self.input_layernorm(inputs_embeds)  # (B, Nq, H)
        if self.config.norm_before_residual:
            hidden_states = self.hidden_norm(hidden_states)
            residual = hidden_states
        else:
            residual = hidden_states
            hidden_states = self.hidden_norm(hidden_states)
        attn_in = torch.cat([embeds, hidden_states], dim=-1)  # (B, Nq, 2H)
        hidden_states = residual + self.self_attn(attn_in, position_ids, attention_mask, cache)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def checkpoint_fields(c: Eagle3Config) -> dict:
    """The config.json fields every EAGLE-3 layout shares (P-EAGLE's adds its own to them)."""
    return {
        "architectures": [ARCHITECTURE],
        **llama_fields(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }


class Eagle3Drafter(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        n_aux, h_t = len(config.aux_layer_ids), config.target_hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.requires_grad_(False)
        self.own_embeddings = False  # True when a checkpoint brought embeddings other than the target's
        self.fc_norm = nn.ModuleList([RMSNorm(h_t, config.rms_norm_eps) for _ in range(n_aux)]) \
            if config.fc_norm else None
        self.fc = nn.Linear(n_aux * h_t, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        # Identity maps until set_vocab: draft id i is target id i.
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)

    # -- vocabulary
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab maps of shape {tuple(d2t.shape)}/{tuple(t2d.shape)} do not fit the drafter")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target(self) -> torch.Tensor:
        """(draft_vocab,) target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def choose(self, draft_logits: torch.Tensor, chooser: DraftChooser | None) -> torch.Tensor:
        """(B, draft_vocab) logits -> (B,) target ids: the argmax, or the chooser's pick from the logits spread over
        the target vocabulary (-inf on the ids outside the draft vocabulary)."""
        if chooser is None:
            return self.draft_to_target[draft_logits.argmax(-1)]
        logits = draft_logits.new_full((draft_logits.shape[0], self.config.vocab_size), float("-inf")).float()
        logits[:, self.draft_to_target] = draft_logits.float()  # (B, V)
        return chooser.choose(logits)

    # -- the drafter interface (pipeline.models.drafter.Drafter)
    kind = "eagle3"

    @property
    def target_hidden_size(self) -> int:
        return self.config.target_hidden_size

    @property
    def decode_layer_ids(self) -> list[int]:
        """The target layers (vLLM ids) the drafter reads at decoding time: its aux layers."""
        return list(self.config.aux_layer_ids)

    def attach(self, target: nn.Module) -> None:
        """Frozen token embeddings from the target (unless a checkpoint brought its own)."""
        embed = target.get_input_embeddings().weight
        if embed.shape != self.embed_tokens.weight.shape:
            raise ValueError(f"target embeddings {tuple(embed.shape)} do not fit the drafter")
        if not self.own_embeddings:
            with torch.no_grad():
                self.embed_tokens.weight.copy_(embed)

    def init_lm_head(self, target: nn.Module) -> None:
        """A new drafter's lm_head starts from the target's rows of the draft vocabulary."""
        with torch.no_grad():
            self.lm_head.weight.copy_(target.get_output_embeddings().weight[self.draft_to_target])

    def init_layer_from_target(self, target: nn.Module) -> None:
        """A new drafter's decoder layer starts as the target's last one, reading the fused features
        through its hidden half (the token's half of q/k/v starts at zero, so the layer first sees
        what the target's layer sees); `fc` starts by passing the deepest aux layer through, and the
        final norm is the target's. Training then only has to move from there."""
        c = self.config
        last = target.model.layers[-1]
        attn = last.self_attn
        shapes = (attn.q_proj.weight.shape, attn.k_proj.weight.shape, last.mlp.gate_proj.weight.shape)
        mine = (self.midlayer.self_attn.q_proj.weight[:, c.hidden_size:].shape,
                self.midlayer.self_attn.k_proj.weight[:, c.hidden_size:].shape,
                self.midlayer.mlp.gate_proj.weight.shape)
        if shapes != mine or c.target_hidden_size != c.hidden_size:
            raise ValueError(f"the target's last layer {shapes} does not fit the drafter's {mine}")
        layer = self.midlayer
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj"):
                weight = getattr(layer.self_attn, name).weight  # (out, 2H): [embeds | hidden]
                weight[:, :c.hidden_size].zero_()
                weight[:, c.hidden_size:].copy_(getattr(attn, name).weight)
            layer.self_attn.o_proj.weight.copy_(attn.o_proj.weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
            layer.hidden_norm.weight.copy_(last.input_layernorm.weight)
            layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
            self.norm.weight.copy_(target.model.norm.weight)
            deepest = max(range(len(c.aux_layer_ids)), key=lambda i: c.aux_layer_ids[i])
            self.fc.weight.zero_()  # (H, n_aux * H): one chunk per aux layer, in aux_layer_ids' order
            self.fc.weight[:, deepest * c.hidden_size:(deepest + 1) * c.hidden_size].copy_(torch.eye(c.hidden_size))

    def stored_layer_ids(self, num_layers: int) -> list[int]:
        """The aux layers, then the last (its next-token state is what the teacher's labels come from), each once."""
        return stored_layer_ids(self.config.aux_layer_ids, num_layers)

    def training_sample(
        self, sample: HiddenSample, num_layers: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids (T,), features (T, (n_aux + 1) * H_t) of layers [aux..., L], loss_mask (T,));
        a layer stored once may be read twice."""
        positions = read_positions(self.config.aux_layer_ids, num_layers)
        return sample.input_ids, sample.hidden[:, positions].flatten(1), sample.loss_mask

    def teacher(self, target: nn.Module) -> Teacher:
        """Soft labels from the target's final norm and its lm_head rows of the draft vocabulary."""
        # In the drafter's dtype: a target loaded in bf16 (target.dtype auto on CUDA) meets fp32 drafter states.
        head = target.get_output_embeddings().weight[self.draft_to_target].detach().to(self.lm_head.weight.dtype)
        return Teacher(norm=target.model.norm.requires_grad_(False), head=head)

    def checkpoint_config(self) -> dict:
        """config.json as vLLM, SGLang and SpecForge read it. `norm_before_residual` is always written
        (the engines' defaults differ); the EAGLE-3.1 flags only when set, since an engine may read a
        written `false` differently from an absent key (SpecForge 0.2: `norm_output: false` = no final norm)."""
        c = self.config
        return {**checkpoint_fields(c), **{flag: True for flag in ("fc_norm", "norm_output") if getattr(c, flag)}}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The trainable tensors, plus the embeddings when they are not the target's."""
        tensors = vllm_vocab_layout(self.trainable_state_dict(), self.config, self.draft_to_target)
        if self.own_embeddings:
            tensors["embed_tokens.weight"] = self.embed_tokens.weight
        return tensors

    def proposer(self) -> Eagle3Proposer:
        return Eagle3Proposer(self)

    def draft_unrolled(
        self, features: torch.Tensor, step_ids: list[torch.Tensor], position_ids: torch.Tensor,
        attention_mask: torch.Tensor, prefix: UnrollPrefix | None = None,
    ) -> torch.Tensor:
        """Teacher-forced drafting at every position at once: the TTT unroll of training.

        features (B, N, n_aux * H_t) aux states at t; step_ids[j] (B, N) the token step j reads at
        t; attention_mask (B, 1, N, N) -> (steps, B, N) target token ids, step j at t drafting token t+2+j. With
        `prefix`, N positions of one chunk after the earlier chunks' step-0 keys: attention_mask (B, 1, N, P + N).
        """
        cache = unroll_cache(prefix)
        state = self.project_aux(features)  # (B, N, H)
        drafts = []
        for ids in step_ids:
            state = self.step(ids, state, position_ids, attention_mask, cache)  # (B, N, H)
            drafts.append(self.draft_to_target[self.lm_head(self.logits_input(state)).argmax(-1)])  # (B, N)
        return torch.stack(drafts)  # (steps, B, N)

    # -- forward
    def project_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """(B, N, n_aux * H_t) concatenated aux states -> (B, N, H)."""
        if self.fc_norm is not None:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux_hidden)

    def step(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: TTTCache | BandTTTCache | FlexTTTCache | LayerCache,
    ) -> torch.Tensor:
        """One TTT step (training), or one decoding call (a LayerCache).

        input_ids:      (B, Nq)     token x_{t+1+k}
        hidden_states:  (B, Nq, H)  step 0: project_aux(aux); step k: the output of step k-1
        position_ids:   (B, Nq)
        attention_mask: (B, 1, Nq, N0) TTT; (B, 1, Nq, S + Nq) decoding
        returns:        (B, Nq, H)  this step's state (post-norm if norm_output)
        """
        inputs_embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)  # (B, Nq, H)
        out = self.midlayer(inputs_embeds, hidden_states, position_ids, attention_mask, cache)
        return self.norm(out) if self.config.norm_output else out

    def logits_input(self, state: torch.Tensor) -> torch.Tensor:
        """What lm_head reads: the final norm, unless the state is already post-norm."""
        return state if self.config.norm_output else self.norm(state)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors: everything but the (frozen, shared) target embeddings."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


class Eagle3Proposer(CachedProposer):
    """Drafts with an EAGLE-3 drafter: the committed pairs (aux_t, x_{t+1}) enter its key/value cache
    once (TTT step 0's keys); step j then queries at the row's last position with phase t + j,
    attending to every committed column and the earlier steps' (TTT's pattern at decoding time).
    The steps' columns are withdrawn after the proposal."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter.eval()
        self.forwards = 0  # drafter forward passes so far: k per proposal
        self.layer_ids = drafter.decode_layer_ids
        self.cache = DraftCache(1)

    @torch.no_grad()
    def propose(self, pairs: CommittedPairs, k: int, chooser: DraftChooser | None = None) -> torch.Tensor:
        """pairs: the block committed since the last call -> (B, k) proposed target tokens per row (the argmax, or
        the chooser's pick)."""
        d = self.drafter
        layer = self.cache.layers[0]
        mask = self.cache.extend(pairs.valid)  # (B, 1, N, S + N)
        fused = d.project_aux(pairs.features.to(d.fc.weight.dtype))  # (B, N, H)
        state = d.step(pairs.next_tokens, fused, pairs.positions, mask, layer)  # (B, N, H)
        self.forwards += 1
        committed = self.cache.length
        last = pairs.last()  # (B,)
        state = gather_rows(state, last)  # (B, 1, H): only the last position drafts
        position = gather_rows(pairs.positions, last)  # (B, 1)
        proposal = []
        for j in range(k):
            token = d.choose(d.lm_head(d.logits_input(state))[:, 0], chooser)[:, None]  # (B, 1) target ids
            proposal.append(token)
            if j + 1 < k:
                mask = self.cache.extend(torch.ones_like(token, dtype=torch.bool))  # (B, 1, 1, S + 1)
                state = d.step(token, state, position + 1 + j, mask, layer)  # (B, 1, H)
                self.forwards += 1
        self.cache.crop(committed)
        return torch.cat(proposal, dim=1)  # (B, k)


def shift_within_document(x: torch.Tensor, document_ids: torch.Tensor, k: int, fill: float = 0) -> torch.Tensor:
    """x[:, t + k] where position t + k is in the same document as t, else `fill`. x is (B, N, ...)."""
    if k == 0:
        return x
    shifted = F.pad(x.movedim(1, -1), (0, k), value=fill).movedim(-1, 1)[:, k:]
    docs = F.pad(document_ids, (0, k), value=-1)[:, k:]
    same = (docs == document_ids).view(*document_ids.shape, *([1] * (x.dim() - 2)))
    return torch.where(same, shifted, torch.full_like(shifted, fill))
