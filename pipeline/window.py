"""Windowing and packing of buffer samples into drafter training sequences (FastRL semantics).

Window: at most `window_tokens` tokens per sample, starting at the response start; if
the response end does not fit, the window moves so that the response END is inside.

Packing: windows are concatenated without padding into one sequence. Unlike FastRL we
shift inside each sample (never pairing the last token of one sample with the first of
the next) and keep attention block-causal per sample.

Shift (EAGLE alignment): the drafter at position t reads the target's feature f_t and
the embedding of token x_{t+1} (the token that feature produced), and predicts f_{t+1}:

    hidden_in = hidden[:-1]   ids_in = ids[1:]   target = hidden[1:]   mask = mask[1:]

DESIGN section 4 writes `ids[:-1]`; that pairs f_t with x_t, which f_t already encodes,
and does not match what vLLM feeds an EAGLE drafter at inference, so we use ids[1:].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def window_bounds(loss_mask: torch.Tensor, window_tokens: int) -> tuple[int, int]:
    """[start, end) of the training window of one sample."""
    full_len = int(loss_mask.shape[0])
    span = min(full_len, window_tokens)
    response = torch.nonzero(loss_mask).flatten()
    if response.numel() == 0:
        return full_len - span, full_len
    resp_start, resp_end = int(response[0]), int(response[-1]) + 1
    start = max(0, min(resp_start, full_len - span))
    if resp_end - start > span:
        start = resp_end - span
    return start, start + span


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # (1, N) token x_{t+1} per position
    hidden_states: torch.Tensor  # (1, N, H) target feature f_t
    target: torch.Tensor  # (1, N, H) target feature f_{t+1}
    loss_mask: torch.Tensor  # (1, N) float, 1 where f_{t+1} belongs to a response token
    position_ids: torch.Tensor  # (1, N) position inside the sample's window
    document_ids: torch.Tensor  # (1, N) which sample each position belongs to

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: str) -> PackedBatch:
        """On `device`, features as float32 (shards hold bf16)."""
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            hidden_states=self.hidden_states.to(device, torch.float32),
            target=self.target.to(device, torch.float32),
            loss_mask=self.loss_mask.to(device),
            position_ids=self.position_ids.to(device),
            document_ids=self.document_ids.to(device),
        )


def pack(samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], window_tokens: int) -> PackedBatch:
    """Pack (input_ids (T,), hidden (T, H), loss_mask (T,)) samples; samples under 2 tokens are skipped.

    Outputs are allocated once and each window is copied in with one slice copy per tensor;
    positions and document ids are computed for the whole batch at once (no per-token work)."""
    kept: list[tuple[int, int, int]] = []  # (sample index, window start, window end)
    for doc, (_, _, loss_mask) in enumerate(samples):
        start, end = window_bounds(loss_mask, window_tokens)
        if end - start >= 2:
            kept.append((doc, start, end))
    if not kept:
        raise ValueError("pack: no sample has at least 2 tokens inside its window")
    lengths = torch.tensor([end - start - 1 for _, start, end in kept])  # (B,) shifted positions per sample
    total = int(lengths.sum())
    first_hidden = samples[kept[0][0]][1]
    hidden_in = torch.empty(total, first_hidden.shape[1], dtype=first_hidden.dtype)  # (N, H)
    hidden_tgt = torch.empty_like(hidden_in)  # (N, H)
    input_ids = torch.empty(total, dtype=torch.int64)  # (N,)
    loss_mask = torch.empty(total, dtype=torch.float32)  # (N,)
    at = 0
    for (doc, start, end), n in zip(kept, lengths.tolist(), strict=True):
        ids, hidden, mask = samples[doc]
        hidden_in[at : at + n] = hidden[start : end - 1]
        hidden_tgt[at : at + n] = hidden[start + 1 : end]
        input_ids[at : at + n] = ids[start + 1 : end]
        loss_mask[at : at + n] = mask[start + 1 : end]
        at += n
    sample_start = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)  # (N,)
    return PackedBatch(
        input_ids=input_ids.unsqueeze(0),
        hidden_states=hidden_in.unsqueeze(0),
        target=hidden_tgt.unsqueeze(0),
        loss_mask=loss_mask.unsqueeze(0),
        position_ids=(torch.arange(total) - sample_start).unsqueeze(0),
        document_ids=torch.repeat_interleave(torch.tensor([doc for doc, _, _ in kept]), lengths).unsqueeze(0),
    )


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, N) document ids -> (B, 1, N, N) bool mask, True where query i may attend key j."""
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # (B, N, N)
    n = document_ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=document_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)
