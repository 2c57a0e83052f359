"""Windowing and packing of buffer samples into drafter training sequences (FastRL semantics).

Window (`window_bounds`, pipeline/data/capture.py, where capture stores only that window): at
most `window_tokens` tokens per sample, starting at the response start; if the response end does
not fit, the window moves so that the response END is inside.

Packing: windows are concatenated without padding into one sequence. Unlike FastRL we
shift inside each sample (never pairing the last token of one sample with the first of
the next) and keep attention block-causal per sample.

Shift (EAGLE alignment): the drafter at position t reads the target's feature f_t and
the embedding of token x_{t+1} (the token that feature produced), and predicts f_{t+1}:

    hidden_in = hidden[:-1]   ids_in = ids[1:]   target = hidden[1:]   mask = mask[1:]

ids[1:], not ids[:-1]: pairing f_t with x_t would feed the drafter a token f_t already encodes,
and vLLM feeds an EAGLE drafter x_{t+1} beside f_t at inference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.data.capture import window_bounds


@dataclass(frozen=True)
class _Positions:
    """What N packed positions (B samples, no padding) carry besides features."""

    input_ids: torch.Tensor  # (1, N) token x_{t+1} per position
    loss_mask: torch.Tensor  # (1, N) float, 1 where f_{t+1} belongs to a response token
    position_ids: torch.Tensor  # (1, N) position inside the sample's window
    document_ids: torch.Tensor  # (1, N) which sample each position belongs to

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


@dataclass(frozen=True)
class DeviceBatch(_Positions):
    """A packed batch on the training device, features as float32: what a training step reads."""

    hidden_states: torch.Tensor  # (1, N, H) target feature f_t
    target: torch.Tensor  # (1, N, H) target feature f_{t+1}


@dataclass(frozen=True)
class PackedBatch(_Positions):
    """Samples packed into one sequence of N positions, on the host.

    The features are not copied when packing: `windows` are views of each sample's window of
    features (its n_b + 1 rows f_start .. f_end-1). `to(device)` moves those N + B rows, not
    the 2N rows of a packed input and target, and fills the float32 inputs f_t and targets
    f_{t+1} there, each row converted and copied once."""

    windows: tuple[torch.Tensor, ...]  # B x (n_b + 1, H) target features of each sample's window

    @property
    def hidden_states(self) -> torch.Tensor:
        """(1, N, H) the target feature f_t at each position (a copy; for inspection)."""
        return torch.cat([w[:-1] for w in self.windows]).unsqueeze(0)

    @property
    def target(self) -> torch.Tensor:
        """(1, N, H) the target feature f_{t+1} at each position (a copy; for inspection)."""
        return torch.cat([w[1:] for w in self.windows]).unsqueeze(0)

    def to(self, device: str | torch.device) -> DeviceBatch:
        hidden_size = self.windows[0].shape[1]
        hidden = torch.empty(self.num_tokens, hidden_size, dtype=torch.float32, device=device)  # (N, H) f_t
        target = torch.empty_like(hidden)  # (N, H) f_{t+1}
        at = 0
        for window in self.windows:
            window = window.to(device)  # as stored (bf16): half the bytes of float32
            n = window.shape[0] - 1
            hidden[at : at + n].copy_(window[:-1])
            target[at : at + n].copy_(window[1:])
            at += n
        return DeviceBatch(
            input_ids=self.input_ids.to(device),
            hidden_states=hidden.unsqueeze(0),
            target=target.unsqueeze(0),
            loss_mask=self.loss_mask.to(device),
            position_ids=self.position_ids.to(device),
            document_ids=self.document_ids.to(device),
        )


def pack(samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], window_tokens: int) -> PackedBatch:
    """Pack (input_ids (T,), hidden (T, H), loss_mask (T,)) samples; samples under 2 tokens are skipped.

    No per-token work: ids, masks, positions and document ids take one slice or fill per sample,
    and the features stay where they are (views)."""
    kept: list[tuple[int, int, int]] = []  # (sample index, window start, window end)
    for doc, (_, _, loss_mask) in enumerate(samples):
        start, end = window_bounds(loss_mask, window_tokens)
        if end - start >= 2:
            kept.append((doc, start, end))
    if not kept:
        raise ValueError("pack: no sample has at least 2 tokens inside its window")
    return PackedBatch(
        input_ids=torch.cat([samples[doc][0][start + 1 : end] for doc, start, end in kept]).long().unsqueeze(0),
        windows=tuple(samples[doc][1][start:end] for doc, start, end in kept),
        loss_mask=torch.cat([samples[doc][2][start + 1 : end] for doc, start, end in kept]).float().unsqueeze(0),
        position_ids=torch.cat([torch.arange(end - start - 1) for _, start, end in kept]).unsqueeze(0),
        document_ids=torch.cat([torch.full((end - start - 1,), doc) for doc, start, end in kept]).unsqueeze(0),
    )


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, N) document ids -> (B, 1, N, N) bool mask, True where query i may attend key j."""
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]  # (B, N, N)
    n = document_ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=document_ids.device).tril()
    return (same_doc & causal).unsqueeze(1)
