"""Training-time-test (TTT) attention: the keys of one EAGLE-3 unroll, and three ways to attend them.

Step k's query at position t sees step 0's keys at positions <= t of its own document, and the
keys of steps 1..k at t itself; its rotary phase is t + k. Laid out as one key sequence of
(k + 1) N columns, [step 0 | step 1 | ... | step k], that is a block-causal mask on the first
N columns and a diagonal on each later block:

                 step 0 keys (N)            step 1 (N)   ...   step k (N)
    query t      same document, col <= t    col t              col t

* `TTTCache` (any device) scores the first block densely, (B, heads, N, N), and adds the
  diagonal terms one dot product each: simple, and the reference for the others.
* `BandTTTCache` (CPU) scores only a band of the first block. Documents are contiguous and
  causal, so query t needs step 0's keys in [start of t's document, t]. The queries go in chunks
  of C positions; each chunk scores the W = C + lookback keys that end at its own end, lookback
  being the furthest any chunk's first query reaches back to its document's start:

                 step 0 keys, in chunks of C             the band of chunk c: W keys
    chunk c      ..........[ lookback | c's C keys ]...   (B, heads, chunks, C, W) scores

  A packed batch of short documents (the demo's: 16 of about 55 positions) scores about W / N of
  the dense block (~15%). A batch whose band is as wide as the sequence (one long document) saves
  little (over `BAND_MAX_SHARE` of the dense block), and `ttt_cache` gives it the dense `TTTCache`.
* `FlexTTTCache` (CUDA) hands the whole sequence to FlexAttention with a block mask, so the
  kernel visits only the 128 x 128 tiles the mask touches (about a causal attention over the
  documents) and never materialises scores or probabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F


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
        return _attend(query, self.key0, self.value0, self.keys, self.values, attention_mask)


def _attend(
    query: torch.Tensor, key0: torch.Tensor, value0: torch.Tensor, keys: list[torch.Tensor],
    values: list[torch.Tensor], mask: torch.Tensor,
) -> torch.Tensor:
    """One softmax over a block of step 0's keys and one diagonal key per later step, over any leading dims `...`:
    query (..., Nq, D), key0/value0 (..., N0, D), keys/values each (..., Nq, D), mask (..., Nq, N0) broadcastable,
    True where a query sees the key -> (..., Nq, D)."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    block = (query @ key0.transpose(-1, -2)) * scale  # (..., Nq, N0)
    block = block.masked_fill(~mask, torch.finfo(block.dtype).min)
    diagonal = [(query * k).sum(-1, keepdim=True) * scale for k in keys]  # each (..., Nq, 1)
    scores = torch.cat([block, *diagonal], dim=-1)  # (..., Nq, N0 + steps)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(value0.dtype)
    n0 = key0.shape[-2]
    attn = probs[..., :n0] @ value0  # (..., Nq, D)
    for i, v in enumerate(values):
        attn = attn + probs[..., n0 + i, None] * v
    return attn


@dataclass
class UnrollPrefix:
    """Step 0's keys and values of the positions before a chunk, per drafter layer: a teacher-forced unroll run
    chunk by chunk of positions attends them as the unroll over the whole sequence would (step 0's keys at a
    position read nothing of later positions, and later steps' keys only their own position), so the chunked
    drafts equal the whole unroll's while the scores held are (chunk, positions so far), not (positions,
    positions)."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, heads, P, D)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    def extend(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This chunk's step-0 keys/values (B, heads, C, D) after the earlier ones -> (B, heads, P + C, D)."""
        if layer in self.keys:
            key, value = torch.cat([self.keys[layer], key], dim=2), torch.cat([self.values[layer], value], dim=2)
        self.keys[layer], self.values[layer] = key, value
        return key, value


@dataclass
class PrefixTTTCache(TTTCache):
    """`TTTCache` for one chunk of positions: step 0 attends the earlier chunks' step-0 keys too (the mask is
    (B, 1, C, P + C)); later steps' diagonal keys are the chunk's own."""

    prefix: UnrollPrefix = field(default_factory=UnrollPrefix)
    layer: int = 0

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """query/key/value (B, heads, C, D) of this step; attention_mask (B, 1, C, P + C) the causal block. By SDPA
        over [step 0's P + C keys | each later step's C], its diagonals a mask: no (C, P + C) scores per head are
        held (the CPU's flash kernel tiles them), so a chunk's memory does not grow with the positions before it."""
        if self.key0 is None:
            self.key0, self.value0 = self.prefix.extend(self.layer, key, value)  # (B, heads, P + C, D)
        else:
            self.keys.append(key)
            self.values.append(value)
        C = query.shape[2]
        diagonal = torch.eye(C, dtype=torch.bool, device=query.device).expand(*attention_mask.shape[:2], C, C)
        mask = torch.cat([attention_mask, *[diagonal] * len(self.keys)], dim=-1)  # (B, 1, C, P + C + steps C)
        keys = torch.cat([self.key0, *self.keys], dim=2)  # (B, heads, P + C + steps C, D)
        values = torch.cat([self.value0, *self.values], dim=2)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)


def unroll_cache(prefix: UnrollPrefix | None, layer: int = 0) -> TTTCache:
    """A TTT unroll's cache: the whole sequence at once (no prefix), or one chunk after `prefix`."""
    return TTTCache() if prefix is None else PrefixTTTCache(prefix=prefix, layer=layer)


# Queries per chunk: a larger chunk widens every band (W = C + lookback), a smaller one adds chunks;
# at the demo's shapes 16 to 128 cost the same.
BAND_CHUNK = 64
# The band where it scores at most this share of the dense block: its padding and copies cost about
# a tenth more per score than the dense path's (measured on the CPU at N 250 to 1,000).
BAND_MAX_SHARE = 0.8


@dataclass(frozen=True)
class TTTBand:
    """Where each chunk of queries looks among step 0's keys: the band geometry of `BandTTTCache`."""

    length: int  # N positions
    chunk: int  # C queries per chunk; the last chunk is padded to C
    lookback: int  # keys before its own C that every chunk scores
    mask: torch.Tensor  # (B, 1, chunks, C, W) bool: key in the query's document, at or before it

    @property
    def chunks(self) -> int:
        return -(-self.length // self.chunk)

    @property
    def width(self) -> int:
        return self.chunk + self.lookback  # W keys per chunk

    @property
    def saves_work(self) -> bool:
        """At most `BAND_MAX_SHARE` of the dense block's N x N (query, key) scores."""
        return self.chunks * self.chunk * self.width <= BAND_MAX_SHARE * self.length**2

    @classmethod
    def of(cls, document_ids: torch.Tensor, chunk: int = BAND_CHUNK) -> TTTBand:
        """The band of documents `document_ids` (B, N), each a contiguous run of positions."""
        B, n = document_ids.shape
        chunks = -(-n // chunk)
        padded = chunks * chunk
        position = torch.arange(padded, device=document_ids.device)  # (Np,)
        starts = torch.ones(B, padded, dtype=torch.bool, device=document_ids.device)  # (B, Np)
        # a padding position is a document of its own, so that its (discarded) row softmaxes over itself
        starts[:, 1:n] = document_ids[:, 1:] != document_ids[:, :-1]
        doc_start = torch.where(starts, position, 0).cummax(dim=1).values  # (B, Np) start of t's document
        lookback = int((position[::chunk] - doc_start[:, ::chunk]).max())
        width = chunk + lookback
        key_position = torch.arange(-lookback, padded, device=document_ids.device)  # (lookback + Np,)
        key_position = key_position.unfold(0, width, chunk)  # (chunks, W) the keys of each chunk's band
        query_position = position.view(chunks, chunk, 1)  # (chunks, C, 1)
        query_start = doc_start.view(B, chunks, chunk, 1)  # (B, chunks, C, 1)
        mask = (key_position[:, None, :] <= query_position) & (key_position[:, None, :] >= query_start)
        return cls(n, chunk, lookback, mask.unsqueeze(1))  # (B, 1, chunks, C, W)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """(B, heads, N, D) -> (B, heads, chunks, C, D), zero padded."""
        B, heads, n, D = x.shape
        return F.pad(x, (0, 0, 0, self.chunks * self.chunk - n)).view(B, heads, self.chunks, self.chunk, D)

    def to_bands(self, x: torch.Tensor) -> torch.Tensor:
        """(B, heads, N, D) -> (B, heads, chunks, W, D): each chunk's band, views of one padded copy."""
        n = x.shape[2]
        padded = F.pad(x, (0, 0, self.lookback, self.chunks * self.chunk - n))  # (B, heads, lookback + Np, D)
        return padded.unfold(2, self.width, self.chunk).transpose(-1, -2)  # (B, heads, chunks, D, W) -> W, D


@dataclass
class BandTTTCache:
    """Eager TTT attention over a band of step 0's keys (`TTTBand`) and the diagonal ones of later
    steps: `TTTCache`'s result, without scoring the pairs its mask would drop."""

    band: TTTBand
    key0: torch.Tensor | None = None  # (B, heads, chunks, W, D) each chunk's band of keys
    value0: torch.Tensor | None = None
    keys: list[torch.Tensor] = field(default_factory=list)  # each (B, heads, chunks, C, D)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def step(self) -> int:
        return 0 if self.key0 is None else 1 + len(self.keys)

    position_offset = step  # the rotary phase of the step about to attend: the steps before it

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """query/key/value (B, heads, N, D) of this step -> (B, heads, N, D); `attention_mask` is not
        read (the band's mask stands for it)."""
        band = self.band
        if self.key0 is None:
            self.key0, self.value0 = band.to_bands(key), band.to_bands(value)
        else:
            self.keys.append(band.to_chunks(key))
            self.values.append(band.to_chunks(value))
        B, heads, n, D = query.shape
        # chunks as a leading dim: each chunk's C queries against its band of W keys
        attn = _attend(band.to_chunks(query), self.key0, self.value0, self.keys, self.values, band.mask)
        return attn.view(B, heads, -1, D)[:, :, :n]  # (B, heads, chunks, C, D) -> (B, heads, N, D)


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


def ttt_cache(document_ids: torch.Tensor) -> TTTCache | BandTTTCache | FlexTTTCache:
    """The cache a training unroll over documents `document_ids` (B, N) uses: FlexAttention on a
    GPU; elsewhere (FlexAttention on a CPU compiles C++ at run time) the band, or the dense block
    where the band would score as much."""
    if document_ids.is_cuda:
        return FlexTTTCache(document_ids)
    band = TTTBand.of(document_ids)
    return BandTTTCache(band) if band.saves_work else TTTCache()
