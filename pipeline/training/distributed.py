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

FSDP2 (`fully_shard`, `train.parallelism: fsdp`) shards the drafter's parameters, gradients
and AdamW state over the ranks: each rank holds 1/N of them and all-gathers each unit's weights
once per step, when the step first needs them. It pays off when the fp32 training state
(16 bytes per trainable parameter: weight, gradient, two AdamW moments; 4 per frozen one)
would crowd the activations out of a GPU: `train.parallelism: auto` (`choose_parallelism`)
shards when that state exceeds `train.fsdp_memory_share` of one GPU's memory. For the
reference drafters on an 80 GB GPU (share 0.5), from `reference_drafter` on the meta device:

    target            trainable   frozen (target embeddings)   state     auto
    Llama-3.1-8B      0.43 B      0.53 B                        8.9 GB    ddp
    Llama-3.1-70B     1.40 B      1.05 B                       26.7 GB    ddp
    Llama-3.1-405B    4.82 B      2.10 B                       85.5 GB    fsdp

Sharded, `train.fsdp_units` sets how many collectives a step has (`shard_drafter`): the whole
drafter one unit (one all-gather, one reduce-scatter) when a step's peak with its weights and
gradient whole fits the same share (`step_peak_bytes`; on 8 ranks 6.6, 18.8 and 57.6 GB for the
drafters above: the 405B one gets a unit per decoder layer), else a unit per layer.

The sharded drafter is a copy that `fully_shard` rewrites (its parameters become DTensors);
the caller's drafter waits on the host and receives the trained weights, gathered from the
shards, when training ends, so the export and everything after it see plain tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipeline.ranks import Ranks, join, leave, ranks_from_env

# A training's ranks are a launched stage's ranks (pipeline.ranks), under the names the training code reads.
DistContext = Ranks
context_from_env = ranks_from_env
init_process_group = join
destroy_process_group = leave


def rank_device(ctx: DistContext, device: str) -> str:
    """`cuda` means this rank's own GPU (cuda:LOCAL_RANK); anything else is used as given."""
    return ctx.device(device)


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


# -- FSDP2


TRAINABLE_BYTES_PER_PARAM = 16  # fp32 weight, gradient, AdamW exp_avg and exp_avg_sq
FROZEN_BYTES_PER_PARAM = 4  # fp32 weight only: no gradient, no optimizer state


@dataclass(frozen=True)
class ParallelPlan:
    """How the ranks hold the drafter (`train.parallelism`), and the figures behind `auto`'s choice."""

    mode: Literal["single", "ddp", "fsdp"]  # single: one process, nothing to share or shard
    setting: str  # train.parallelism as configured
    trainable_params: int
    frozen_params: int
    state_bytes: int  # the drafter's fp32 training state on one unsharded rank
    device_memory_bytes: int  # one GPU's memory (the smallest over the ranks), or train.gpu_memory_gb off CUDA
    memory_share: float  # train.fsdp_memory_share
    reason: str
    units: Literal["drafter", "layer"] | None = None  # how FSDP2 gathers the sharded drafter (None: not sharded)
    step_peak_bytes: int = 0  # fsdp: one rank's peak within a step with the drafter one unit (`step_peak_bytes`)
    units_reason: str = ""

    @property
    def state_share(self) -> float:
        return self.state_bytes / self.device_memory_bytes

    def metadata(self) -> dict[str, str | int | float]:
        """The decision and its figures as the run's metadata and MLflow params read them."""
        sharded = {"fsdp_units": self.units, "fsdp_units_reason": self.units_reason,
                   "fsdp_step_peak_gb": round(self.step_peak_bytes / 1e9, 3)} if self.units else {}
        return {"parallelism": self.mode, "parallelism_setting": self.setting, "parallelism_reason": self.reason,
                "trainable_params": self.trainable_params, "frozen_params": self.frozen_params,
                "training_state_gb": round(self.state_bytes / 1e9, 3),
                "device_memory_gb": round(self.device_memory_bytes / 1e9, 1),
                "training_state_share": round(self.state_share, 4), **sharded}


def training_state_bytes(model: torch.nn.Module) -> tuple[int, int, int]:
    """(trainable params, frozen params, bytes of their fp32 training state); works on the meta device."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return trainable, frozen, TRAINABLE_BYTES_PER_PARAM * trainable + FROZEN_BYTES_PER_PARAM * frozen


def device_memory_bytes(device: str, fallback_gb: float, ctx: DistContext) -> int:
    """One GPU's memory: this rank's CUDA device's, the smallest over the ranks (so every rank decides
    alike); off CUDA, `fallback_gb` (the production GPU the decision stands for)."""
    own = torch.cuda.get_device_properties(torch.device(device)).total_memory \
        if torch.device(device).type == "cuda" else int(fallback_gb * 1e9)
    if not ctx.distributed:
        return own
    carrier = torch.tensor([own], dtype=torch.float64, device=device)
    dist.all_reduce(carrier, op=dist.ReduceOp.MIN)
    return int(carrier.item())


def step_peak_bytes(trainable: int, frozen: int, state: int, world_size: int) -> int:
    """One rank's training memory at its peak within a step when the sharded drafter is one FSDP2 unit:
    the whole drafter's weights gathered (fp32), its whole gradient before the reduce-scatter, and
    the rank's shards of the training state (1/world_size of it)."""
    return FROZEN_BYTES_PER_PARAM * (2 * trainable + frozen) + state // world_size


def choose_parallelism(
    model: torch.nn.Module, setting: str, memory_share: float, memory_bytes: int, world_size: int,
    units: str = "auto",
) -> ParallelPlan:
    """`train.parallelism` for this drafter: `auto` shards (FSDP2) when the unsharded training state
    exceeds `memory_share` of one GPU, else replicates (data parallel). Sharded, `train.fsdp_units`:
    `auto` makes the whole drafter one unit (gathered once a step, reduce-scattered once) when its
    `step_peak_bytes` is within the same share, else one unit per decoder layer."""
    trainable, frozen, state = training_state_bytes(model)
    figures = f"{state / 1e9:.2f} GB of training state, {state / memory_bytes:.1%} of {memory_bytes / 1e9:.0f} GB"

    def plan(mode: Literal["single", "ddp", "fsdp"], reason: str) -> ParallelPlan:
        if mode != "fsdp":
            return ParallelPlan(mode, setting, trainable, frozen, state, memory_bytes, memory_share, reason)
        peak = step_peak_bytes(trainable, frozen, state, world_size)
        peak_figures = f"a step's peak with one unit {peak / 1e9:.2f} GB, {peak / memory_bytes:.1%} of the GPU"
        if units != "auto":
            chosen, why = units, f"train.fsdp_units is {units} ({peak_figures})"
        elif peak <= memory_share * memory_bytes:
            chosen, why = "drafter", f"{peak_figures}, within train.fsdp_memory_share={memory_share}"
        else:
            chosen, why = "layer", f"{peak_figures}, exceeds train.fsdp_memory_share={memory_share}"
        return ParallelPlan(mode, setting, trainable, frozen, state, memory_bytes, memory_share, reason,
                            chosen, peak, why)  # type: ignore[arg-type]

    if world_size == 1:
        return plan("single", f"one rank: nothing to shard ({figures})")
    if setting != "auto":
        return plan(setting, f"train.parallelism is {setting} ({figures})")  # type: ignore[arg-type]
    if state > memory_share * memory_bytes:
        return plan("fsdp", f"{figures} exceeds train.fsdp_memory_share={memory_share}")
    return plan("ddp", f"{figures} is within train.fsdp_memory_share={memory_share}")


class LossModule(torch.nn.Module):
    """The root `fully_shard` unit: one forward computes a batch's loss through the drafter, so
    FSDP2's root hooks (lazy init, the end-of-backward wait) see every forward, however the loss
    drives the drafter's submodules (EAGLE-3's training-time test calls them step by step).

    `held`: the units that keep their gathered weights through the whole backward; `end_backward`
    frees them once it has run, before the optimizer updates their shards."""

    def __init__(self, drafter: torch.nn.Module, loss_of: Callable[[torch.nn.Module, object], tuple]) -> None:
        super().__init__()
        self.drafter, self.loss_of = drafter, loss_of
        self.held: list[torch.nn.Module] = []

    def forward(self, batch: object) -> tuple[torch.Tensor, ...]:
        return tuple(self.loss_of(self.drafter, batch))

    def end_backward(self) -> None:
        for unit in self.held:
            unit.reshard()  # type: ignore[operator]  # an FSDPModule's


def decoder_layers(drafter: torch.nn.Module) -> list[torch.nn.Module]:
    """The drafter's decoder layers (the modules holding an attention), in the order they run."""
    return [m for m in drafter.modules() if isinstance(getattr(m, "self_attn", None), torch.nn.Module)]


def shard_drafter(drafter: torch.nn.Module, loss_of: Callable[[torch.nn.Module, object], tuple],
                  device: str, units: Literal["drafter", "layer"] = "layer") -> LossModule:
    """A copy of `drafter` sharded with FSDP2 over the default process group, inside its `LossModule`.

    Each all-gather and reduce-scatter is a collective every rank waits for, so no weights are
    gathered twice in one step, and `units` (`choose_parallelism`) sets how many collectives a step has:

    * `drafter`: the whole drafter is one unit, the root's. Its weights are gathered once, when the
      step's forward begins, and kept through the backward (the root never frees them after its
      forward); its gradient is reduce-scattered once, when the backward ends: one all-gather and one
      reduce-scatter a step, ZeRO-2's traffic, where data parallel has one all-reduce. A rank then
      holds, for the step, the whole weights and gradient (`step_peak_bytes`).
    * `layer`: the units follow how the loss runs the drafter. Each decoder layer is a unit (the bulk
      of the weights). The last one runs its backward right after the loss, and EAGLE-3's only layer
      runs once per training-time-test step: it keeps its gathered weights from its first forward
      until the step's backward has ended (`LossModule.held`, freed by `end_backward`), where FSDP2
      by default frees them after every call and its backward and gathers them again for the next.
      Earlier layers (P-EAGLE's) are freed after their forward and gathered again for their
      backward (ZeRO-3). The embeddings are a unit read by every training-time-test step: gathered
      once, at the first step's lookup, and freed when the backward ends (frozen in EAGLE and
      EAGLE-3: no backward). The root unit holds the rest: `fc` (run once, first), the norms (a few
      numbers each, whose own collectives would cost more than they save), and the `lm_head`, whose
      weight the losses read outside its forward (the chunked cross-entropy).

    Gradients and AdamW's moments stay sharded between steps. Frozen parameters are sharded too (no
    gradient, no optimizer state); buffers (EAGLE-3's vocabulary maps) stay whole on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    replica = copy.deepcopy(drafter).to(device)
    held: list[torch.nn.Module] = []
    if units == "layer":
        layers = decoder_layers(replica)
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            fully_shard(layer, mesh=mesh, reshard_after_forward=not last)
            if last:
                layer.set_reshard_after_backward(False)  # type: ignore[operator]  # fully_shard made it an FSDPModule
                held.append(layer)
        embeddings = getattr(replica, "embed_tokens", None)
        if isinstance(embeddings, torch.nn.Module):
            fully_shard(embeddings, mesh=mesh, reshard_after_forward=False)
    root = LossModule(replica, loss_of)
    fully_shard(root, mesh=mesh)
    root.held = held
    for unit in root.modules():
        if isinstance(unit, FSDPModule):
            # Summed, not averaged: the loop weighs each rank's loss by its share of the batch's tokens.
            # A plain SUM reduction (gloo has no pre-multiplied sum).
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return root


def local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes this rank holds of `tensors` (a DTensor's local shard only)."""
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)
