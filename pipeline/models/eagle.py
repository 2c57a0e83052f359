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

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.rope import RotaryEmbedding, apply_rotary, rope_of
from pipeline.models.teacher import Teacher
from pipeline.models.ttt import TTTCache, UnrollPrefix, unroll_cache

if TYPE_CHECKING:
    from pipeline.data.shard_format import HiddenSample

ARCHITECTURE = "EagleLlamaForCausalLM"


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
    rope_scaling: dict | None = None  # the target's; None: plain RoPE
    max_position_embeddings: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        check_heads(self.hidden_size, self.num_attention_heads, self.num_key_value_heads)

    @classmethod
    def from_target(cls, target_config, intermediate_size: int | None = None) -> EagleConfig:
        """The drafter mirrors the target's widths so that its features live in the same space."""
        rope_theta, rope_scaling = rope_of(target_config)
        return cls(
            vocab_size=target_config.vocab_size,
            hidden_size=target_config.hidden_size,
            intermediate_size=intermediate_size or target_config.intermediate_size,
            num_attention_heads=target_config.num_attention_heads,
            num_key_value_heads=target_config.num_key_value_heads,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=target_config.max_position_embeddings,
        )


def llama_fields(config: EagleConfig) -> dict:
    """The LlamaConfig fields vLLM and SGLang read for the one draft decoder layer (either kind)."""
    return {
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
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


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


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Eager scaled dot-product attention, the softmax in float32 (as transformers' eager Llama).

    query:          (B, heads, Nq, D)
    key, value:     (B, heads, S, D)
    attention_mask: (B, 1, Nq, S) bool, True = may attend
    returns:        (B, heads, Nq, D)
    """
    scores = (query @ key.transpose(-1, -2)) / math.sqrt(query.shape[-1])  # (B, heads, Nq, S)
    scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(value.dtype)  # (B, heads, Nq, S)
    return probs @ value


@dataclass
class LayerCache:
    """One draft layer's keys and values at decoding time (heads already repeated for GQA).

    Columns are appended per call and cropped after a proposal; which columns a row may
    attend is the caller's mask, so a row's rejected or padded columns stay in place, masked.
    """

    key: torch.Tensor | None = None  # (B, heads, S, D)
    value: torch.Tensor | None = None  # (B, heads, S, D)
    position_offset: int = 0  # rotary phase added to the positions (TTT steps use theirs)

    @property
    def length(self) -> int:
        return 0 if self.key is None else self.key.shape[2]

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """query/key/value (B, heads, Nq, D) of the new columns; attention_mask (B, 1, Nq, S + Nq)."""
        self.key = key if self.key is None else torch.cat([self.key, key], dim=2)  # (B, heads, S + Nq, D)
        self.value = value if self.value is None else torch.cat([self.value, value], dim=2)
        return attend(query, self.key, self.value, attention_mask)

    def crop(self, length: int) -> None:
        """Keep the first `length` columns."""
        if self.key is not None:
            self.key, self.value = self.key[:, :, :length], self.value[:, :, :length]

    def take(self, rows: torch.Tensor, columns: torch.Tensor) -> None:
        """Keep `rows` (B',) and `columns` (S',), in that order."""
        if self.key is not None:
            self.key = self.key[rows][:, :, columns]  # (B', heads, S', D)
            self.value = self.value[rows][:, :, columns]

    def add_rows(self, n: int) -> None:
        """n rows of zeros after the others (their columns are masked until they hold keys of their own)."""
        if self.key is not None:
            B, heads, S, D = self.key.shape
            self.key = torch.cat([self.key, self.key.new_zeros(n, heads, S, D)])  # (B + n, heads, S, D)
            self.value = torch.cat([self.value, self.value.new_zeros(n, heads, S, D)])


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
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """
        hidden_states:  (B, N, H)
        cos, sin:       (B, 1, N, D)
        attention_mask: (B, 1, N, N) bool, True = may attend; with `cache`, (B, 1, N, S + N)
        cache:          decoding only: earlier columns, extended by these N
        returns:        (B, N, H)
        """
        B, N, _ = hidden_states.shape
        c = self.config
        groups = c.num_attention_heads // c.num_key_value_heads
        query_states = self.q_proj(hidden_states).view(B, N, c.num_attention_heads, c.head_dim)  # (B, N, heads, D)
        key_states = self.k_proj(hidden_states).view(B, N, c.num_key_value_heads, c.head_dim)  # (B, N, kv_heads, D)
        value_states = self.v_proj(hidden_states).view(B, N, c.num_key_value_heads, c.head_dim)
        query_states = apply_rotary(query_states.transpose(1, 2), cos, sin)  # (B, heads, N, D)
        key_states = apply_rotary(key_states.transpose(1, 2), cos, sin).repeat_interleave(groups, dim=1)
        value_states = value_states.transpose(1, 2).repeat_interleave(groups, dim=1)  # (B, heads, N, D)
        if cache is None:
            attn = attend(query_states, key_states, value_states, attention_mask)  # (B, heads, N, D)
        else:
            attn = cache.attend(query_states, key_states, value_states, attention_mask)
        return self.o_proj(attn.transpose(1, 2).reshape(B, N, -1))  # (B, N, heads * D) -> (B, N, H)


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
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: LayerCache | TTTCache | None = None,
    ) -> torch.Tensor:
        """hidden_states (B, N, H) -> (B, N, H); the other arguments as `Attention.forward`'s."""
        hidden_states = hidden_states + self.self_attn(hidden_states, cos, sin, attention_mask, cache)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class EagleDrafter(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(config)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                          config.max_position_embeddings)
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    # -- the drafter interface (pipeline.models.drafter.Drafter)
    kind = "eagle"
    decode_layer_ids = None  # reads the target's post-norm last layer, as vLLM hands its `eagle` drafter

    @property
    def target_hidden_size(self) -> int:
        """The target's width: the drafter's own, since it reads the target's last layer as it is."""
        return self.config.hidden_size

    def attach(self, target: nn.Module) -> None:
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

    def stored_layer_ids(self, num_layers: int) -> list[int]:
        """The target's last layer (vLLM id L), whose post-norm state the stored sample holds last."""
        return [num_layers]

    def training_sample(
        self, sample: HiddenSample, num_layers: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids (T,), features (T, H) of the last stored layer, loss_mask (T,))."""
        return sample.input_ids, sample.hidden[:, -1, :], sample.loss_mask

    def teacher(self, target: nn.Module) -> Teacher | None:
        """None: EAGLE-1/2's soft labels come from its own (the target's) lm_head over the stored features."""
        return None

    def checkpoint_config(self) -> dict:
        return {"architectures": [ARCHITECTURE], **llama_fields(self.config)}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return self.trainable_state_dict()

    def proposer(self) -> EagleProposer:
        return EagleProposer(self)

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        caches: list[LayerCache] | list[TTTCache] | None = None,
    ) -> torch.Tensor:
        """
        hidden_states:  (B, N, H) target features f_t
        input_ids:      (B, N)    tokens x_{t+1}
        position_ids:   (B, N)
        attention_mask: (B, 1, N, N) bool, True = may attend; with `caches`, (B, 1, N, S + N)
        caches:         one per layer: decoding's key/value columns, or a TTT unroll's
        returns:        (B, N, H) predicted features f^_{t+1}
        """
        B, N, H = hidden_states.shape
        if input_ids.shape != (B, N):
            raise ValueError(f"input_ids shape {tuple(input_ids.shape)} does not match hidden states {(B, N)}")
        if H != self.config.hidden_size:
            raise ValueError(f"hidden size {H} differs from the drafter's {self.config.hidden_size}")
        inputs_embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)  # (B, N, H)
        hidden_states = self.fc(torch.cat([inputs_embeds, hidden_states], dim=-1))  # (B, N, 2H) -> (B, N, H)
        offset = caches[0].position_offset if caches else 0
        cos, sin = self.rotary_emb(position_ids + offset)  # (B, 1, N, D)
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, cos, sin, attention_mask, caches[i] if caches else None)
        return hidden_states

    def draft_unrolled(
        self, features: torch.Tensor, step_ids: list[torch.Tensor], position_ids: torch.Tensor,
        attention_mask: torch.Tensor, prefix: UnrollPrefix | None = None,
    ) -> torch.Tensor:
        """Teacher-forced drafting at every position at once, as a TTT unroll.

        features (B, N, H) f_t; step_ids[j] (B, N) the token step j reads at position t (step 0:
        x_{t+1}; step j: the token step j-1 should have drafted); attention_mask (B, 1, N, N) ->
        (steps, B, N) target token ids: step j at position t drafts token t+2+j from the real pairs
        up to t and its own features of steps < j (the runtime's attention pattern when every
        earlier draft was accepted). With `prefix`, the positions are one chunk after the earlier chunks' (their
        step-0 keys, which the call extends): attention_mask is then (B, 1, N, P + N).
        """
        caches = [unroll_cache(prefix, i) for i in range(len(self.layers))]
        drafts = []
        for ids in step_ids:
            predicted = self(features, ids, position_ids, attention_mask, caches)  # (B, N, H)
            drafts.append(self.lm_head(predicted).argmax(-1))  # (B, N)
            features = predicted
        return torch.stack(drafts)  # (steps, B, N)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights that go into the checkpoint: everything but the target's embeddings and lm_head."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}


# -- decoding: a batch of rows, each accepting its own number of drafts per round


class DraftChooser(Protocol):
    """How a proposer turns its logits into draft tokens, greedy or sampled (evaluation/rejection_sampler.py)."""

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits over the target vocabulary (-inf outside the draft vocabulary) -> (B,) token ids."""
        ...


@dataclass(frozen=True)
class CommittedPairs:
    """What the target committed since the last proposal: pairs (f_t, x_{t+1}) per row.

    Rows accept different numbers of drafts, so each row's new pairs are a left-aligned
    prefix of the block (`valid`); the rest is padding the drafter masks out.
    """

    features: torch.Tensor  # (B, N, D) target features f_t (D: the layers the proposer reads, concatenated)
    next_tokens: torch.Tensor  # (B, N) x_{t+1}
    positions: torch.Tensor  # (B, N) t
    valid: torch.Tensor  # (B, N) bool

    def last(self) -> torch.Tensor:
        """(B,) index of each row's last valid pair: where drafting continues from."""
        return self.valid.sum(dim=1) - 1

    def select(self, rows: torch.Tensor) -> CommittedPairs:
        """The pairs of `rows` (B',), in that order."""
        return CommittedPairs(self.features[rows], self.next_tokens[rows], self.positions[rows], self.valid[rows])

    def stack(self, other: CommittedPairs) -> CommittedPairs:
        """`other`'s rows after these (requests joining a batch); the narrower block padded with invalid pairs."""
        width = max(self.valid.shape[1], other.valid.shape[1])
        return CommittedPairs(*(torch.cat([_pad_columns(a, width), _pad_columns(b, width)])
                                for a, b in zip(self._fields(), other._fields(), strict=True)))

    def then(self, later: CommittedPairs) -> CommittedPairs:
        """Each row's pairs, then its `later` ones (pairs of the same rows committed since), left-aligned again."""
        fields = [torch.cat([a, b], dim=1) for a, b in zip(self._fields(), later._fields(), strict=True)]
        valid = fields[-1]
        order = (~valid).to(torch.int8).argsort(dim=1, stable=True)  # (B, N1 + N2): valid pairs first, in order
        width = int(valid.sum(dim=1).max())
        return CommittedPairs(*(f.gather(1, order.view(*order.shape, *[1] * (f.dim() - 2)).expand_as(f))[:, :width]
                                for f in fields))

    def _fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.features, self.next_tokens, self.positions, self.valid


def _pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (B, N, ...) padded with zeros (False) to (B, width, ...)."""
    if x.shape[1] == width:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1], *x.shape[2:])], dim=1)


class DraftCache:
    """A drafter's decoding state: its layers' key/value columns and which columns each row may attend."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.valid: torch.Tensor | None = None  # (B, S) bool: False = padding or a withdrawn draft

    @property
    def length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def extend(self, new_valid: torch.Tensor) -> torch.Tensor:
        """Admit Nq new columns (new_valid (B, Nq)); the attention mask (B, 1, Nq, S + Nq) of their queries:
        every valid earlier column and the valid new ones up to the query's own."""
        S, Nq = self.length, new_valid.shape[1]
        self.valid = new_valid if self.valid is None else torch.cat([self.valid, new_valid], dim=1)  # (B, S + Nq)
        columns = torch.arange(S + Nq, device=new_valid.device)  # (S + Nq,)
        causal = columns[None, :] <= S + torch.arange(Nq, device=new_valid.device)[:, None]  # (Nq, S + Nq)
        return self.valid[:, None, None, :] & causal[None, None]  # (B, 1, Nq, S + Nq)

    def crop(self, length: int) -> None:
        for layer in self.layers:
            layer.crop(length)
        if self.valid is not None:
            self.valid = self.valid[:, :length]

    def select(self, rows: torch.Tensor) -> None:
        """Keep `rows` (B',) of the batch, in that order (requests that leave drop out), and only the columns a
        kept row may attend: a long-running batch holds no column of a request that left."""
        if self.valid is None:
            return
        valid = self.valid[rows]  # (B', S)
        columns = valid.any(dim=0).nonzero().flatten()  # (S',) in order: causality by index stays causality
        for layer in self.layers:
            layer.take(rows, columns)
        self.valid = valid[:, columns]

    def add_rows(self, n: int) -> None:
        """n rows after the others with nothing cached: every column masked for them; their pairs come with the
        next proposal."""
        if self.valid is None:
            return  # nothing cached yet: the next proposal's pairs size every row
        for layer in self.layers:
            layer.add_rows(n)
        self.valid = torch.cat([self.valid, self.valid.new_zeros(n, self.valid.shape[1])])  # (B + n, S)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, N, ...) and index (B,) -> x[b, index[b]] (B, 1, ...)."""
    return x[torch.arange(x.shape[0], device=x.device), index][:, None]


class CachedProposer:
    """What every drafter kind's proposer shares: its DraftCache over the rows of a running batch, whose
    requests leave (`select`) and join (`add_rows`) between proposals."""

    cache: DraftCache

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)

    def add_rows(self, n: int) -> None:
        self.cache.add_rows(n)


class EagleProposer(CachedProposer):
    """Drafts with an EAGLE-1/2 drafter: the committed pairs (f_t, x_{t+1}) enter its key/value
    cache once; each drafted token is one more pair (its own predicted feature, the token),
    withdrawn from the cache after the proposal."""

    layer_ids = None

    def __init__(self, drafter: EagleDrafter) -> None:
        self.drafter = drafter.eval()
        self.forwards = 0  # drafter forward passes so far: k per proposal
        self.cache = DraftCache(len(drafter.layers))

    @torch.no_grad()
    def propose(self, pairs: CommittedPairs, k: int, chooser: DraftChooser | None = None) -> torch.Tensor:
        """pairs: the block committed since the last call -> (B, k) proposed tokens per row (the argmax, or the
        chooser's pick)."""
        d = self.drafter
        dtype = d.fc.weight.dtype
        mask = self.cache.extend(pairs.valid)  # (B, 1, N, S + N)
        predicted = d(pairs.features.to(dtype), pairs.next_tokens, pairs.positions, mask, self.cache.layers)
        self.forwards += 1
        committed = self.cache.length
        last = pairs.last()  # (B,)
        feature = gather_rows(predicted, last)  # (B, 1, H)
        position = gather_rows(pairs.positions, last)  # (B, 1)
        proposal = []
        for j in range(k):
            logits = d.lm_head(feature)  # (B, 1, V)
            token = logits.argmax(-1) if chooser is None else chooser.choose(logits[:, 0].float())[:, None]  # (B, 1)
            proposal.append(token)
            if j + 1 < k:
                mask = self.cache.extend(torch.ones_like(token, dtype=torch.bool))  # (B, 1, 1, S + 1)
                feature = d(feature, token, position + 1 + j, mask, self.cache.layers)  # (B, 1, H)
                self.forwards += 1
        self.cache.crop(committed)
        return torch.cat(proposal, dim=1)  # (B, k)
