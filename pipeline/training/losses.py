"""Drafter training losses.

EAGLE-2 (FastRL): `vloss_weight * SmoothL1(f^, f) + ploss_weight * softCE(p_target, q_draft)`.
EAGLE-3: soft cross-entropy against the target's distribution over the draft vocabulary,
summed over the training-time-test steps with weights decay**k.
P-EAGLE: the same soft cross-entropy over every row of a COD sample (every depth at once, one
forward), averaged over the rows that count, as speculators does.

The soft cross-entropy is computed in chunks of tokens, forward and backward, so that
no two full (tokens, vocab) float32 tensors ever exist at once (at vocab 128256 and
2048 tokens each is 1 GB).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, singledispatch

import torch
import torch.nn.functional as F

from pipeline.config import TrainConfig
from pipeline.models.eagle import EagleDrafter
from pipeline.models.eagle3 import Eagle3Drafter, shift_within_document
from pipeline.models.peagle import PEagleDrafter, cod_sample, context_mask
from pipeline.models.teacher import Teacher
from pipeline.models.ttt import ttt_cache
from pipeline.training.window import DeviceBatch, block_causal_mask


@dataclass(frozen=True)
class LossParts:
    loss: torch.Tensor  # scalar, differentiable
    vloss: torch.Tensor  # scalar, SmoothL1 on features (0 for EAGLE-3)
    ploss: torch.Tensor  # scalar, soft cross-entropy against the target's distribution
    accuracy: torch.Tensor  # scalar, top-1 agreement of drafter and target tokens (step 0 for EAGLE-3)


def _matmul_dtype(device: torch.device, acc: torch.dtype) -> torch.dtype:
    """The dtype the loss's matmuls read: bf16 where CUDA autocast is on, else `acc`. Autocast does
    not reach inside this autograd function's chunked products (they write into buffers), so
    without this a bf16 run would do its largest matmuls, (tokens, H) x (H, vocab), in float32."""
    on = device.type == "cuda" and torch.is_autocast_enabled("cuda")
    return torch.get_autocast_dtype("cuda") if on else acc


def _product(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with the result in `acc`: operands already in `acc` write into `out` (on the CPU, reusing
    a buffer saves page faults as slow as the matmul); bf16 ones (CUDA autocast) use cuBLAS's
    bf16 x bf16 -> float32 product."""
    if a.dtype == acc:
        return torch.matmul(a, b, out=out)
    return torch.mm(a, b, out_dtype=acc)


def _soft_ce_terms(
    logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, grad_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's terms from its (c, V) float32 logits of the drafter and the target, both
    overwritten: (masked loss sum, top-1 agreement per row (c,), d loss / d logits (c, V) in
    `grad_dtype`). In place: the loss's memory stays the two (c, V) buffers (a fresh one per step
    would triple the peak measured by benchmarks/policy_loss.py, and costs page faults on the CPU)."""
    agree = logits.argmax(-1) == target_logits.argmax(-1)
    p = target_logits.sub_(target_logits.amax(-1, keepdim=True)).exp_()
    p.div_(p.sum(-1, keepdim=True))  # softmax of the target
    z = logits.sub_(logits.amax(-1, keepdim=True))
    p_dot_z = (p[:, None, :] @ z[:, :, None]).view(-1)  # (c,)
    e = z.exp_()
    sum_e = e.sum(-1)
    # sum_v p log q = sum_v p (z - log sum exp z) = p.z - lse, as p sums to 1
    loss = -((p_dot_z - sum_e.log()) * mask).sum()
    # d/dlogits of -sum p log softmax(logits) = softmax(logits) - p
    return loss, agree, e.div_(sum_e[:, None]).sub_(p).mul_(mask[:, None]).to(grad_dtype)


@cache
def _chunk_terms(cuda: bool) -> Callable:
    """`_soft_ce_terms`, compiled on a GPU, where its passes over (c, V) fuse into two kernels."""
    return torch.compile(_soft_ce_terms, dynamic=True) if cuda else _soft_ce_terms


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    """sum_t mask_t * -sum_v p_t[v] log q_t[v],  q = softmax(h W^T),  p = softmax(g U^T).

    Returns (loss sum, (N,) bool: argmax q == argmax p). The gradient is
    computed in the same pass over the chunks as the loss (d loss / d logits = q - p), so
    the logits are never recomputed and never held whole; backward only scales it.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target_hidden, target_weight, mask, chunk):
        acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 inputs accumulate in float32
        mm = _matmul_dtype(hidden.device, acc)
        weight_mm, target_weight_mm = weight.to(mm), target_weight.to(mm)  # (V, H), (V, H_t); no copy when mm is theirs
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = None  # (V, H) in acc, from the first chunk on
        loss = hidden.new_zeros((), dtype=acc)
        agree = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        # Two (chunk, V) buffers reused for every chunk: allocating fresh ones per chunk costs
        # page faults on the CPU that are as slow as the matmuls.
        rows = min(chunk, hidden.shape[0])
        logits_buf = hidden.new_empty((rows, weight.shape[0]), dtype=acc)
        target_buf = hidden.new_empty((rows, target_weight.shape[0]), dtype=acc)
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            h = hidden[sl].to(mm)  # (c, H)
            n = h.shape[0]
            logits = _product(h, weight_mm.T, acc, out=logits_buf[:n])  # (c, V)
            target_logits = _product(target_hidden[sl].to(mm), target_weight_mm.T, acc, out=target_buf[:n])
            with torch.autocast(hidden.device.type, enabled=False):  # p.z in float32
                loss_c, agree[sl], grad_logits = _chunk_terms(logits.is_cuda)(logits, target_logits, mask[sl], mm)
            loss += loss_c
            if need_hidden:
                grad_hidden[sl] = _product(grad_logits, weight_mm, acc).to(hidden.dtype)  # (c, H)
            if need_weight:  # (V, H)
                if grad_weight is None:
                    grad_weight = _product(grad_logits.T, h, acc)
                elif mm == acc:
                    grad_weight.addmm_(grad_logits.T, h)
                else:
                    grad_weight += _product(grad_logits.T, h, acc)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if need_weight else None)
        ctx.mark_non_differentiable(agree)
        return loss, agree

    @staticmethod
    def backward(ctx, grad_loss, _grad_agree):
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
    mask (N,): each token's weight in the sum (1 on tokens that count, 0 elsewhere)
    returns (masked loss sum, (N,) bool: the drafter's top-1 token is the target's)
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
    ploss_sum, agree = soft_cross_entropy(
        predicted.reshape(-1, H), lm_head_weight, target.reshape(-1, H), lm_head_weight, mask
    )
    ploss = ploss_sum / num_valid
    return LossParts(vloss_weight * vloss + ploss_weight * ploss, vloss, ploss, (agree * mask).sum() / num_valid)


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
    cache = ttt_cache(docs)
    state = model.project_aux(aux)  # (1, N, H)
    total_decay = sum(decay**k for k in range(ttt_steps))
    states, teacher_states, row_weights = [], [], []
    for k in range(ttt_steps):
        input_ids = shift_within_document(batch.input_ids, docs, k)  # x_{t+1+k}
        valid = shift_within_document(batch.loss_mask, docs, k)[0]  # (N,) 0 past the sample's end
        state = model.step(input_ids, state, positions, mask, cache)  # (1, N, H)
        states.append(model.logits_input(state)[0])
        teacher_states.append(target_norm(shift_within_document(last, docs, k))[0])  # (N, H_t)
        # step k's masked mean, weighted decay**k among the steps
        row_weights.append(valid * (decay**k / total_decay) / valid.sum().clamp(min=1.0))
    # One chunked pass over every step's rows: the lm_head is cast, and its gradient made, once.
    ploss, agree = soft_cross_entropy(torch.cat(states), model.lm_head.weight, torch.cat(teacher_states),
                                      target_head, torch.cat(row_weights))  # (steps N, H) -> scalar, (steps N,)
    valid0 = batch.loss_mask[0]  # (N,) step 0's rows come first
    accuracy = (agree[: valid0.shape[0]] * valid0).sum() / valid0.sum().clamp(min=1.0)
    return LossParts(ploss, ploss.new_zeros(()), ploss, accuracy)


def peagle_loss(
    model: PEagleDrafter,
    batch: DeviceBatch,
    target_norm: Callable[[torch.Tensor], torch.Tensor],
    target_head: torch.Tensor,
    generator: torch.Generator | None = None,
) -> LossParts:
    """Every depth in one parallel forward over a COD sample of the batch; batch.hidden_states holds
    [aux layers..., last layer] per position. Row (a, d) drafts token a+2+d: its teacher is the target's
    last layer at a+d+1, and it counts where the loss mask at a+d does (within a's document).

    target_norm: the target's final norm; target_head (draft_vocab, H_t): its lm_head rows of the draft vocab.
    """
    c = model.config
    aux_dim = len(c.aux_layer_ids) * c.target_hidden_size
    aux = batch.hidden_states[..., :aux_dim]  # (1, N, n_aux * H_t) features of position t
    last = batch.target[0, :, aux_dim:]  # (N, H_t) last layer at t+1: the target's view of x_{t+2}
    docs, loss_mask = batch.document_ids[0], batch.loss_mask[0]  # (N,)
    sample = cod_sample(loss_mask, docs, c.num_depths, c.down_sample_ratio, c.down_sample_ratio_min,
                        generator).to(docs.device)
    context = context_mask(sample, docs)  # (M, N): with each row's chain, `cross_depth_mask`
    hidden = model.forward_parallel(aux, batch.input_ids, batch.position_ids, sample, context)[0]  # (M, H)
    ahead = sample.anchor + sample.depth  # (M,) the position whose loss mask and teacher row count
    inside = ahead < docs.shape[0]
    ahead = torch.where(inside, ahead, sample.anchor)
    valid = loss_mask[ahead] * (inside & (docs[ahead] == docs[sample.anchor]))  # (M,)
    weights = valid / valid.sum().clamp(min=1.0)
    ploss, agree = soft_cross_entropy(model.logits_input(hidden), model.lm_head.weight, target_norm(last[ahead]),
                                      target_head, weights)  # (M, H) -> scalar, (M,)
    n = docs.shape[0]  # depth 0's rows come first
    accuracy = (agree[:n] * valid[:n]).sum() / valid[:n].sum().clamp(min=1.0)
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


@drafter_loss.register
def _(model: PEagleDrafter, batch: DeviceBatch, cfg: TrainConfig, teacher: Teacher | None) -> LossParts:
    if teacher is None:
        raise ValueError("P-EAGLE training needs the target's norm and lm_head (teacher)")
    return peagle_loss(model, batch, teacher.norm, teacher.head)
