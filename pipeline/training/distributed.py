"""Data-parallel training over torch.distributed: gloo on CPU, NCCL on GPU.

Every rank derives the same global batch plan (seeded, from sample lengths) and takes
every `world_size`-th sample of each global batch, reading only those from the store.
After backward the ranks sum their gradients, each weighted by its share of the batch's
loss tokens, in one flat all-reduce: the step then equals a single process training on
the whole global batch (up to float rounding).

Why an explicit all-reduce and not the `DistributedDataParallel` wrapper: DDP reduces only
after a forward through the wrapper, while EAGLE-3's training-time test drives the
drafter's submodules step by step; and a rank whose share of a global batch is empty (the
last batch of an epoch) or unreadable (a corrupt shard, skipped) must still join the
reduction with zero gradients, which DDP cannot express. A drafter is one decoder layer:
its gradients are reduced once per step, and the lost overlap with backward is small.
FSDP2 (`fully_shard`) pays off only when the drafter's fp32 weights, gradients and AdamW
state (16 bytes per parameter) stop fitting one GPU next to the activations: an EAGLE-3
drafter of a 70B target (hidden 8192, MLP 28672, draft vocab 32000) has about 1.4B trainable
parameters (22 GB), which fits an 80 GB GPU; one of a 405B target (hidden 16384, MLP 53248)
has about 4.8B (77 GB), which does not, and is where FSDP2 would be used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job (torchrun's RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def context_from_env() -> DistContext:
    """torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; a plain `python -m` run is rank 0 of 1."""
    return DistContext(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                       int(os.environ.get("LOCAL_RANK", 0)))


def rank_device(ctx: DistContext, device: str) -> str:
    """`cuda` means this rank's own GPU (cuda:LOCAL_RANK); anything else is used as given."""
    return f"cuda:{ctx.local_rank}" if device == "cuda" else device


def init_process_group(ctx: DistContext, device: str) -> None:
    """Join the job's process group (nothing to join for one process)."""
    if not ctx.distributed or dist.is_initialized():
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(ctx.local_rank)
    dist.init_process_group(backend, rank=ctx.rank, world_size=ctx.world_size)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_share(indices: list[int], ctx: DistContext) -> list[int]:
    """This rank's samples of one global batch: every world_size-th, starting at its rank (may be empty)."""
    return indices[ctx.rank :: ctx.world_size]


def global_plan_sizes(batch_size_per_gpu: int, max_seq_len: int, ctx: DistContext) -> tuple[int, int]:
    """A global batch holds `batch_size_per_gpu` samples and `max_seq_len` tokens per rank."""
    return batch_size_per_gpu * ctx.world_size, max_seq_len * ctx.world_size


def broadcast_state(tensors: dict[str, torch.Tensor], ctx: DistContext) -> None:
    """Overwrite every rank's `tensors` (a model's trainable state, in place) with rank 0's, as DDP
    does when it wraps a model: the ranks start identical however each built its copy."""
    if not ctx.distributed:
        return
    for tensor in tensors.values():
        if tensor.dtype == torch.bool:  # NCCL has no bool
            carrier = tensor.to(torch.uint8)
            dist.broadcast(carrier, src=0)
            tensor.copy_(carrier.bool())
        else:
            dist.broadcast(tensor, src=0)


def reduce_gradients(params: list[torch.nn.Parameter], weight: float, stats: list[float]) -> list[float]:
    """Sum `weight * grad` and `stats` over the ranks in one all-reduce; returns the summed stats.

    params: the trainable parameters, whose .grad holds this rank's gradient (None: no data here)
    weight: this rank's loss tokens (its gradient is of its mean loss, so weight * grad is a sum)
    stats:  numbers to sum across ranks alongside (loss tokens, token-weighted losses, ...)
    Afterwards each .grad holds sum_r weight_r * grad_r (the caller divides by the summed tokens).
    """
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    device = grads[0].device
    flat = _flatten_dense_tensors([g.float() for g in grads]).mul_(weight)  # (P,)
    flat = torch.cat([flat, torch.tensor(stats, dtype=flat.dtype, device=device)])  # (P + S,)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    summed, totals = flat[: -len(stats)], flat[-len(stats) :]
    for p, g in zip(params, _unflatten_dense_tensors(summed, grads), strict=True):
        p.grad = g.to(p.dtype)
    return totals.tolist()
