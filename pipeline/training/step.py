"""One training step of a drafter, as the loop runs it and as benchmarks/training.py times it.

    forward_backward   the loss of a batch on the device (bf16 autocast on a GPU) and its gradient
    apply_gradients    clip, AdamW step at the scheduled learning rate, drop the gradient

Nothing here reads the device's results back to the host: the loss parts and the gradient norm
come back as 0-d tensors, and the loop copies them out every `train.log_every` iterations.
This module imports only torch and the model and loss code, so the GPU benchmark runs where
torch alone is installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.training.losses import LossParts
from pipeline.training.window import DeviceBatch


@dataclass(frozen=True)
class StepStats:
    """An iteration's loss parts: 0-d tensors on the training device (reading them waits for it)."""

    loss: torch.Tensor
    vloss: torch.Tensor
    ploss: torch.Tensor
    accuracy: torch.Tensor

    @classmethod
    def of(cls, parts: LossParts) -> StepStats:
        return cls(parts.loss.detach(), parts.vloss.detach(), parts.ploss.detach(), parts.accuracy.detach())

    def values(self) -> list[torch.Tensor]:
        return [self.loss, self.vloss, self.ploss, self.accuracy]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in two AdamW groups: matrices decay; norms and biases (1-d) never
    do, as pulling a norm's gain or a bias towards 0 only fights what it is for."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def sharded(params: list[torch.nn.Parameter]) -> bool:
    """Whether `params` are FSDP2's shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def make_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, device: str | torch.device
) -> torch.optim.AdamW:
    """AdamW over `param_groups`; on a GPU the fused kernel (one launch for all parameters). Over
    sharded parameters off a GPU, the foreach kernels: each operation on a DTensor pays a Python
    dispatch, once per operation for all parameters rather than once per parameter."""
    fused = True if torch.device(device).type == "cuda" else None
    foreach = True if fused is None and sharded(list(model.parameters())) else None
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, fused=fused, foreach=foreach)


def autocast(device: str | torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on a GPU when `train.dtype` is bf16 (weights, gradients and optimizer state
    stay fp32); fp32 otherwise, and always on a CPU."""
    if torch.device(device).type == "cuda" and dtype == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_backward(
    loss_of: Callable[[DeviceBatch], LossParts], batch: DeviceBatch, dtype: str, scale: float = 1.0
) -> StepStats:
    """The loss of one batch on its device and the gradient of `scale` x that loss, accumulated into
    the parameters' .grad (the loss parts returned are unscaled)."""
    with autocast(batch.input_ids.device, dtype):
        parts = loss_of(batch)
    (parts.loss if scale == 1.0 else parts.loss * scale).backward()
    return StepStats.of(parts)


def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A sharded drafter's tensors as this rank's shards (plain tensors sharing their storage), so that
    arithmetic on them skips DTensor's dispatch; plain tensors as they are."""
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of `grads` (this rank's shards): a (1,) float32 tensor on their device."""
    norms = torch._foreach_norm(grads)
    return torch.stack(norms).float().pow(2).sum().reshape(1)


def clip_to(params: list[torch.nn.Parameter], grad_clip: float, norm: torch.Tensor) -> None:
    """Scale the gradients as `clip_grad_norm_` does, given their whole norm (summed over a sharded
    drafter's ranks by the caller): by grad_clip / (norm + 1e-6), at most 1."""
    grads = local_tensors([p.grad for p in params if p.grad is not None])
    if not grads:
        return
    coef = torch.clamp(grad_clip / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))


def apply_gradients(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], lr: float, grad_clip: float,
    norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clip the gradient, take the optimizer step at `lr` and drop the gradient; returns the
    gradient's norm before clipping (a 0-d tensor on the device). `norm`: that norm, where the caller
    has it already (a sharded drafter's, summed over the ranks with the step's figures)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    if norm is None:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True if sharded(params) else None)
    else:
        clip_to(params, grad_clip, norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
