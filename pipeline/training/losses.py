"""Drafter training losses.

EAGLE-2 (FastRL): `vloss_weight * SmoothL1(f^, f) + ploss_weight * softCE(p_target, q_draft)`.
EAGLE-3: soft cross-entropy against the target's distribution over the draft vocabulary,
summed over the training-time-test steps with weights decay**k.

The soft cross-entropy is computed in chunks of tokens, forward and backward, so that
no two full (tokens, vocab) float32 tensors ever exist at once (at vocab 128256 and
2048 tokens each is 1 GB).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import singledispatch

import torch
import torch.nn.functional as F

from pipeline.config import TrainConfig
from pipeline.models.eagle import EagleDrafter
from pipeline.models.eagle3 import Eagle3Drafter, TTTCache, shift_within_document
from pipeline.models.teacher import Teacher
from pipeline.training.window import DeviceBatch, block_causal_mask


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor  # scalar, differentiable
    vloss: torch.Tensor  # scalar, SmoothL1 on features (0 for EAGLE-3)
    ploss: torch.Tensor  # scalar, soft cross-entropy against the target's distribution
    accuracy: torch.Tensor  # scalar, top-1 agreement of drafter and target tokens (step 0 for EAGLE-3)


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b.T, written into `out` (accumulation dtype) without a temporary where dtypes allow."""
    if a.dtype == out.dtype and b.dtype == out.dtype:
        torch.matmul(a, b.T, out=out)
    else:
        out.copy_(a @ b.T)


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    """sum_t mask_t * -sum_v p_t[v] log q_t[v],  q = softmax(h W^T),  p = softmax(g U^T).

    Returns (loss sum, number of valid tokens whose argmax q == argmax p). The gradient is
    computed in the same pass over the chunks as the loss (d loss / d logits = q - p), so
    the logits are never recomputed and never held whole; backward only scales it.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target_hidden, target_weight, mask, chunk):
        acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 inputs accumulate in float32
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if need_weight else None
        loss = hidden.new_zeros((), dtype=acc)
        hits = hidden.new_zeros((), dtype=acc)
        # Two (chunk, V) buffers reused for every chunk: allocating fresh ones per chunk costs
        # page faults on the CPU that are as slow as the matmuls.
        rows = min(chunk, hidden.shape[0])
        logits_buf = hidden.new_empty((rows, weight.shape[0]), dtype=acc)
        target_buf = hidden.new_empty((rows, target_weight.shape[0]), dtype=acc)
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            n = hidden[sl].shape[0]
            logits, target_logits = logits_buf[:n], target_buf[:n]  # (c, V)
            _matmul_into(logits, hidden[sl], weight)
            _matmul_into(target_logits, target_hidden[sl], target_weight)
            hits += ((logits.argmax(-1) == target_logits.argmax(-1)).to(acc) * mask[sl]).sum()
            # Everything below works in place on the two buffers.
            p = target_logits.sub_(target_logits.amax(-1, keepdim=True)).exp_()
            p.div_(p.sum(-1, keepdim=True))  # softmax of the target
            z = logits.sub_(logits.amax(-1, keepdim=True))
            p_dot_z = (p[:, None, :] @ z[:, :, None]).view(n)
            e = z.exp_()
            sum_e = e.sum(-1)
            # sum_v p log q = sum_v p (z - log sum exp z) = p.z - lse, as p sums to 1
            loss -= ((p_dot_z - sum_e.log()) * mask[sl]).sum()
            if need_hidden or need_weight:
                # d/dlogits of -sum p log softmax(logits) = softmax(logits) - p
                grad_logits = e.div_(sum_e[:, None]).sub_(p).mul_(mask[sl][:, None])
                if need_hidden:
                    grad_hidden[sl] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_weight:
                    grad_weight.addmm_(grad_logits.T, hidden[sl].to(acc))
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if need_weight else None)
        ctx.mark_non_differentiable(hits)
        return loss, hits

    @staticmethod
    def backward(ctx, grad_loss, _grad_hits):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype),
            None if grad_weight is None else grad_weight * grad_loss.to(grad_weight.dtype),
            None, None, None, None,
        )


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk so that one (chunk, vocab) float32 buffer is about 256 MB: ~500 tokens at
    vocab 128k. Smaller chunks save memory but the matmuls get less efficient per row (measured
    with `make bench`: 130-token chunks cost 1.4x the time of the plain version, 500-token ones less)."""
    return max(16, (1 << 26) // vocab)


def soft_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_hidden: torch.Tensor,
    target_weight: torch.Tensor,
    mask: torch.Tensor,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    hidden (N, H) and weight (V, H): the drafter's logits are hidden @ weight.T
    target_hidden (N, Ht) and target_weight (V, Ht): the target's logits (no gradient)
    mask (N,): 1 on tokens that count
    returns (masked loss sum, masked count of top-1 agreements)
    """
    return _ChunkedSoftCrossEntropy.apply(
        hidden, weight, target_hidden.detach(), target_weight.detach(),
        mask.to(torch.promote_types(hidden.dtype, torch.float32)),
        chunk_tokens or default_chunk_tokens(weight.shape[0]),
    )


def soft_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, target_hidden: torch.Tensor, target_weight: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """The plain version (two full (N, V) tensors): for tests and the benchmark."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    log_q = F.log_softmax((hidden @ weight.T).to(acc), dim=-1)
    with torch.no_grad():
        p = F.softmax((target_hidden @ target_weight.T).to(acc), dim=-1)
    return -((p * log_q).sum(-1) * mask).sum()


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
    H = predicted.shape[-1]
    mask = loss_mask.reshape(-1).to(predicted.dtype)
    num_valid = mask.sum().clamp(min=1.0)
    vloss = (F.smooth_l1_loss(predicted, target, reduction="none").mean(dim=-1).reshape(-1) * mask).sum() / num_valid
    ploss_sum, hits = soft_cross_entropy(
        predicted.reshape(-1, H), lm_head_weight, target.reshape(-1, H), lm_head_weight, mask
    )
    ploss = ploss_sum / num_valid
    return LossParts(vloss_weight * vloss + ploss_weight * ploss, vloss, ploss, hits / num_valid)


def eagle3_loss(
    model: Eagle3Drafter,
    batch: DeviceBatch,
    target_norm: Callable[[torch.Tensor], torch.Tensor],
    target_head: torch.Tensor,
    ttt_steps: int,
    decay: float,
) -> LossParts:
    """Training-time test over `ttt_steps`; batch.hidden_states holds [aux layers..., last layer] per position.

    target_norm: the target's final norm; target_head (draft_vocab, H_t): its lm_head rows of the draft vocab.
    """
    aux_dim = len(model.config.aux_layer_ids) * model.config.target_hidden_size
    aux = batch.hidden_states[..., :aux_dim]  # (1, N, n_aux * H_t) features of position t
    last = batch.target[..., aux_dim:]  # (1, N, H_t) last layer at t+1: the target's view of x_{t+2}
    docs, positions = batch.document_ids, batch.position_ids
    mask = block_causal_mask(docs)  # (1, 1, N, N)
    cache = TTTCache()
    state = model.project_aux(aux)  # (1, N, H)
    total, weights, accuracy = aux.new_zeros(()), 0.0, aux.new_zeros(())
    for k in range(ttt_steps):
        input_ids = shift_within_document(batch.input_ids, docs, k)  # x_{t+1+k}
        valid = shift_within_document(batch.loss_mask, docs, k)  # 0 past the sample's end
        target_k = shift_within_document(last, docs, k)
        state = model.step(input_ids, state, positions, mask, cache)
        num_valid = valid.sum().clamp(min=1.0)
        loss_sum, hits = soft_cross_entropy(
            model.logits_input(state)[0], model.lm_head.weight, target_norm(target_k)[0], target_head, valid[0]
        )
        total = total + decay**k * loss_sum / num_valid
        weights += decay**k
        if k == 0:
            accuracy = hits / num_valid
    ploss = total / weights
    return LossParts(ploss, ploss.new_zeros(()), ploss, accuracy)


@singledispatch
def drafter_loss(model: torch.nn.Module, batch: DeviceBatch, cfg: TrainConfig, teacher: Teacher | None) -> LossParts:
    """The training objective of `model`'s kind on one batch; each kind registers its own below."""
    raise TypeError(f"no training objective for {type(model).__name__}")


@drafter_loss.register
def _(model: EagleDrafter, batch: DeviceBatch, cfg: TrainConfig, teacher: Teacher | None) -> LossParts:
    predicted = model(batch.hidden_states, batch.input_ids, batch.position_ids, block_causal_mask(batch.document_ids))
    return eagle_loss(predicted, batch.target, model.lm_head.weight, batch.loss_mask, cfg.vloss_weight,
                      cfg.ploss_weight)


@drafter_loss.register
def _(model: Eagle3Drafter, batch: DeviceBatch, cfg: TrainConfig, teacher: Teacher | None) -> LossParts:
    if teacher is None:
        raise ValueError("EAGLE-3 training needs the target's norm and lm_head (teacher)")
    return eagle3_loss(model, batch, teacher.norm, teacher.head, cfg.ttt_steps, cfg.ttt_decay)
