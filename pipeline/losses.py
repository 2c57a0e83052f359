"""EAGLE-2 training loss (FastRL): hidden-state regression plus soft-label token loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor  # scalar, differentiable
    vloss: torch.Tensor  # scalar, SmoothL1 on features
    ploss: torch.Tensor  # scalar, soft cross-entropy against the target's distribution
    accuracy: torch.Tensor  # scalar, top-1 agreement of drafter and target tokens


def eagle_loss(
    predicted: torch.Tensor,
    target: torch.Tensor,
    lm_head_weight: torch.Tensor,
    loss_mask: torch.Tensor,
    vloss_weight: float,
    ploss_weight: float,
) -> LossParts:
    """
    predicted, target: (B, N, H) drafter output f^_{t+1} and target feature f_{t+1}
    lm_head_weight:    (V, H) the target's (frozen) lm_head
    loss_mask:         (B, N) 1 on positions that count
    Both terms are masked and averaged over valid tokens.
    """
    mask = loss_mask.to(predicted.dtype)
    num_valid = mask.sum().clamp(min=1.0)
    vloss = (F.smooth_l1_loss(predicted, target, reduction="none").mean(dim=-1) * mask).sum() / num_valid
    out_logp = F.log_softmax(predicted @ lm_head_weight.T, dim=-1)  # (B, N, V)
    with torch.no_grad():
        target_logits = target @ lm_head_weight.T  # (B, N, V)
        target_p = F.softmax(target_logits, dim=-1)
    ploss = -((target_p * out_logp).sum(dim=-1) * mask).sum() / num_valid
    with torch.no_grad():
        hits = (out_logp.argmax(dim=-1) == target_logits.argmax(dim=-1)).to(mask.dtype)
        accuracy = (hits * mask).sum() / num_valid
    return LossParts(vloss_weight * vloss + ploss_weight * ploss, vloss, ploss, accuracy)
