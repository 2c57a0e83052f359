"""Drafter training: config + data in, a trained drafter and a typed result out.

One visible loop. Metrics leave through `MetricsSink.log_dict(payload, step)`, which
the MLflow side implements; nothing here knows about Dagster or MLflow.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipeline.config import TrainConfig
from pipeline.models.drafter import Drafter
from pipeline.models.teacher import Teacher
from pipeline.training.dataset import Dataset, iter_batches, plan_epoch
from pipeline.training.distributed import DistContext, global_plan_sizes, rank_share, reduce_gradients
from pipeline.training.losses import LossParts, drafter_loss
from pipeline.training.state import ResumeState, TrainingCheckpoints
from pipeline.training.window import DeviceBatch


class MetricsSink(Protocol):
    def log_dict(self, payload: dict[str, float], step: int) -> None: ...


class NullSink:
    def log_dict(self, payload: dict[str, float], step: int) -> None:
        pass


@dataclass
class TrainResult:
    iterations: int
    samples: int
    tokens: int
    loss: float
    vloss: float
    ploss: float
    accuracy: float
    wall_s: float
    loss_history: list[float] = field(default_factory=list)
    resumed_from_iteration: int = 0  # 0: trained from the start; else the checkpoint it continued from

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def lr_at(iteration: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to 10% of it at `total`."""
    if warmup and iteration < warmup:
        return peak * (iteration + 1) / warmup
    progress = min(1.0, (iteration - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def compute_loss(model: Drafter, batch: DeviceBatch, cfg: TrainConfig, teacher: Teacher | None) -> LossParts:
    return drafter_loss(model, batch, cfg, teacher)


def train_drafter(
    model: Drafter,
    data: Dataset,
    cfg: TrainConfig,
    sink: MetricsSink | None = None,
    device: str = "cpu",
    teacher: Teacher | None = None,
    *,
    ctx: DistContext | None = None,
    checkpoints: TrainingCheckpoints | None = None,
    on_checkpoint: Callable[[ResumeState], None] | None = None,
) -> TrainResult:
    """Train `model` in place for `cfg.epochs` passes over `data`, streamed batch by batch.

    A sample's features are (T, D): EAGLE-1/2 reads the last layer (D = H); EAGLE-3 reads
    [aux layers..., last layer] concatenated (D = (n_aux + 1) * H_t).

    Data parallel (`ctx.world_size` > 1, process group already joined): each rank trains
    on its share of every global batch and the gradients are summed over the ranks (see
    `pipeline.training.distributed`); only rank 0 logs metrics and saves checkpoints. With
    `checkpoints`, the latest one is restored first and training continues from its
    iteration; a new one is saved every `cfg.checkpoint_every` iterations, after which
    `on_checkpoint` runs (e.g. to flush metrics, so a resumed run never logs an iteration twice).
    """
    sink, ctx = sink or NullSink(), ctx or DistContext()
    if not data.lengths:
        raise ValueError("train_drafter: no samples")
    torch.manual_seed(cfg.seed)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    batch_size, max_seq_len = global_plan_sizes(cfg.batch_size_per_gpu, cfg.max_seq_len, ctx)
    plan_cfg = cfg.model_copy(update={"batch_size_per_gpu": batch_size, "max_seq_len": max_seq_len})
    plan = [batch for e in range(cfg.epochs) for batch in plan_epoch(data.lengths, plan_cfg, e)]  # global batches
    total = len(plan)

    # -- resume: the plan is seeded, so iteration i is the same global batch in every attempt
    state = checkpoints.restore(model, optimizer) if checkpoints else None
    if state and (state.total_iterations, state.world_size) != (total, ctx.world_size):
        raise ValueError(f"checkpoint at iteration {state.iteration} is of a training of {state.total_iterations} "
                         f"iterations on {state.world_size} ranks, this one has {total} on {ctx.world_size}")
    state = state or ResumeState(iteration=0, total_iterations=total, world_size=ctx.world_size)
    resumed_from, iteration, tokens, history = state.iteration, state.iteration, state.tokens, list(state.loss_history)
    last: tuple[float, float, float, float] | None = None  # loss, vloss, ploss, accuracy of the last step
    start = time.perf_counter() - state.wall_s
    shares = [rank_share(batch, ctx) for batch in plan[resumed_from:]]
    for batch in iter_batches(data, shares, cfg.window_tokens):
        # -- learning rate
        lr = lr_at(iteration, total, cfg.optim.lr, cfg.optim.lr_warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # -- forward, loss and backward; None: nothing of this share could be read (warned), or nothing to read
        tick = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        local = (0.0, 0.0, 0.0, 0.0)
        if batch is not None:
            parts = compute_loss(model, batch.to(device), cfg, teacher)
            parts.loss.backward()
            local = (parts.loss.item(), parts.vloss.item(), parts.ploss.item(), parts.accuracy.item())
        batch_tokens = batch.num_tokens if batch is not None else 0
        # -- the global batch's gradient: token-weighted sum over the ranks
        if ctx.distributed:
            loss_tokens = float(batch.loss_mask.sum()) if batch is not None else 0.0
            summed = reduce_gradients(params, loss_tokens, [loss_tokens, batch_tokens,
                                                            *(v * loss_tokens for v in local)])
            loss_tokens, batch_tokens = summed[0], int(summed[1])
            if loss_tokens == 0:  # no rank had a token to learn from: keep the iteration count aligned with the plan
                iteration += 1
                continue
            for p in params:
                p.grad.div_(loss_tokens)
            local = tuple(v / loss_tokens for v in summed[2:])
        elif batch is None:
            iteration += 1
            continue
        # -- step
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        optimizer.step()
        # -- metrics (rank 0 speaks for the job: the figures are already summed over the ranks)
        tokens += batch_tokens
        history.append(local[0])
        last = local
        if ctx.is_main:
            sink.log_dict({
                "loss": local[0], "vloss": local[1], "ploss": local[2], "accuracy": local[3], "lr": lr,
                "tokens_per_s": batch_tokens / max(time.perf_counter() - tick, 1e-9),
            }, iteration)
        iteration += 1
        # -- checkpoint
        if checkpoints and cfg.checkpoint_every and iteration % cfg.checkpoint_every == 0 and iteration < total:
            if ctx.is_main:
                state = ResumeState(iteration, total, ctx.world_size, tokens, time.perf_counter() - start, history)
                checkpoints.save(model, optimizer, state)
                if on_checkpoint:
                    on_checkpoint(state)
    model.eval()
    if last is None:
        raise ValueError("train_drafter: no batch could be read (every shard unreadable)")
    return TrainResult(
        iterations=iteration, samples=len(data.lengths), tokens=tokens, loss=history[-1],
        vloss=last[1], ploss=last[2], accuracy=last[3],
        wall_s=time.perf_counter() - start, loss_history=history, resumed_from_iteration=resumed_from,
    )
