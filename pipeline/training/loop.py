"""Drafter training: config + data in, a trained drafter and a typed result out.

One visible loop. Metrics leave through `MetricsSink.log_dict(payload, step)`, which
the MLflow side implements; nothing here knows about Dagster or MLflow.

The iteration's figures stay on the training device until `train.log_every` iterations have
run (or a checkpoint is saved, or training ends): then one copy brings them to the host and
each iteration is logged. On a GPU, nothing else in an iteration waits for the device.

Several ranks hold the drafter whole (data parallel) or sharded (FSDP2), as
`distributed.choose_parallelism` decides from `train.parallelism`; both take the same steps
on the same global batches. Checkpoints are snapshots copied to the host, written in the
background (`state.CheckpointWriter`); with checkpoints on, an iteration's metrics reach the
sink only once a checkpoint at or after it has committed, so a resumed run never logs an
iteration twice.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from pipeline.config import TrainConfig
from pipeline.models.drafter import Drafter
from pipeline.models.teacher import Teacher
from pipeline.training.dataset import Dataset, iter_batches, plan_epoch
from pipeline.training.distributed import (
    DistContext,
    LossModule,
    ParallelPlan,
    choose_parallelism,
    device_memory_bytes,
    global_plan_sizes,
    local_bytes,
    rank_share,
    reduce_gradients,
    shard_drafter,
)
from pipeline.training.losses import LossParts, drafter_loss
from pipeline.training.state import CheckpointWriter, ResumeState, TrainingCheckpoints, sharded_snapshot, snapshot
from pipeline.training.step import (
    StepStats,
    apply_gradients,
    forward_backward,
    local_tensors,
    make_optimizer,
    squared_norm,
)
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
    parallelism: ParallelPlan | None = None  # how the ranks held the drafter, and why
    rank_state_bytes: int = 0  # the training state one rank held: weights, gradients, AdamW (its shards)
    checkpoint_s: float = 0.0  # the training thread's time on checkpoints: copies to the host, waits for writes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def fitted_warmup(warmup: int, total: int) -> int:
    """The warmup of a run of `total` iterations: `warmup`, but at most a tenth of the run (at least
    one iteration), so that a short budgeted run still spends most of its iterations near the peak."""
    return min(warmup, max(1, total // 10))


def lr_at(iteration: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to 10% of it at `total`."""
    if warmup and iteration < warmup:
        return peak * (iteration + 1) / warmup
    progress = min(1.0, (iteration - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def compute_loss(model: Drafter, batch: DeviceBatch, cfg: TrainConfig, teacher: Teacher | None) -> LossParts:
    return drafter_loss(model, batch, cfg, teacher)


def _parts(parts: LossParts) -> tuple[torch.Tensor, ...]:
    """LossParts as the tensors a module's forward returns (FSDP2 hooks its outputs' tensors)."""
    return parts.loss, parts.vloss, parts.ploss, parts.accuracy


# -- the loop


@dataclass(frozen=True)
class _Iteration:
    """An iteration's figures, kept until the next log."""

    iteration: int
    lr: float
    tokens: int
    stats: StepStats
    grad_norm: torch.Tensor


@dataclass(frozen=True)
class IterationMetrics:
    """An iteration's figures on the host, as logged."""

    iteration: int
    loss: float
    vloss: float
    ploss: float
    accuracy: float
    grad_norm: float
    lr: float
    tokens: int


class _Progress:
    """What training has done so far: the logged history, and the iterations not yet logged."""

    def __init__(self, state: ResumeState, sink: MetricsSink, is_main: bool, held: bool,
                 on_logged: Callable[[IterationMetrics, int], None] | None = None) -> None:
        self.tokens, self.history = state.tokens, list(state.loss_history)
        self.sink, self.is_main, self.held, self.on_logged = sink, is_main, held, on_logged
        self.pending: list[_Iteration] = []
        self.unreleased: list[tuple[int, dict[str, float]]] = []  # logged, held until a checkpoint commits
        self.last: IterationMetrics | None = None
        self.window_start = time.perf_counter()

    def release(self, before: int | None = None) -> None:
        """Hand the held records of iterations before `before` (None: all) to the sink."""
        keep = []
        for iteration, payload in self.unreleased:
            if before is None or iteration < before:
                self.sink.log_dict(payload, iteration)
            else:
                keep.append((iteration, payload))
        self.unreleased = keep

    def add(self, done: _Iteration) -> None:
        self.pending.append(done)

    def flush(self) -> None:
        """One copy of the pending figures to the host, then one log record per iteration (rank 0)."""
        if not self.pending:
            return
        rows = torch.stack([torch.stack([*p.stats.values(), p.grad_norm.float()]) for p in self.pending]).tolist()
        now = time.perf_counter()
        window_tokens = sum(p.tokens for p in self.pending)
        tokens_per_s = window_tokens / max(now - self.window_start, 1e-9)
        for p, (loss, vloss, ploss, accuracy, grad_norm) in zip(self.pending, rows, strict=True):
            self.last = IterationMetrics(p.iteration, loss, vloss, ploss, accuracy, grad_norm, p.lr, p.tokens)
            self.history.append(loss)
            if self.is_main:  # rank 0 speaks for the job: the figures are already summed over the ranks
                self.unreleased.append((p.iteration, {
                    "loss": loss, "vloss": vloss, "ploss": ploss, "accuracy": accuracy, "grad_norm": grad_norm,
                    "lr": p.lr, "tokens_per_s": tokens_per_s}))
        if not self.held:
            self.release()
        self.tokens += window_tokens
        self.pending = []
        if self.on_logged and self.is_main:
            self.on_logged(self.last, self.tokens)
        self.window_start = time.perf_counter()  # the hook's time is not training's


def planned_tokens(lengths: list[int], batch: list[int], window_tokens: int) -> int:
    """Positions a batch trains on: each sample's window less the one its shift drops."""
    return sum(max(0, min(lengths[i], window_tokens) - 1) for i in batch)


def _plan(data: Dataset, cfg: TrainConfig, ctx: DistContext) -> list[list[int]]:
    """The global batches, in order (seeded: the same in every attempt): epoch after epoch, at most
    `cfg.epochs`, and with `cfg.max_tokens` only the batches that fit that many trained positions
    (at least one batch)."""
    batch_size, max_seq_len = global_plan_sizes(cfg.batch_size_per_gpu, cfg.max_seq_len, ctx)
    plan_cfg = cfg.model_copy(update={"batch_size_per_gpu": batch_size, "max_seq_len": max_seq_len})
    plan: list[list[int]] = []
    tokens = 0
    for epoch in range(cfg.epochs):
        for batch in plan_epoch(data.lengths, plan_cfg, epoch):
            tokens += planned_tokens(data.lengths, batch, cfg.window_tokens)
            if cfg.max_tokens and plan and tokens > cfg.max_tokens:
                return plan
            plan.append(batch)
    return plan


def _resume(
    checkpoints: TrainingCheckpoints | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer, total: int,
    ctx: DistContext, sharded: bool,
) -> ResumeState:
    """The latest checkpoint's state (model and optimizer restored in place), or a fresh start."""
    state = checkpoints.restore(model, optimizer, sharded) if checkpoints else None
    if state and (state.total_iterations, state.world_size) != (total, ctx.world_size):
        raise ValueError(f"checkpoint at iteration {state.iteration} is of a training of {state.total_iterations} "
                         f"iterations on {state.world_size} ranks, this one has {total} on {ctx.world_size}")
    return state or ResumeState(iteration=0, total_iterations=total, world_size=ctx.world_size)


@dataclass(frozen=True)
class _Backward:
    """A global batch's backward pass, its gradient left in the parameters' `.grad`: the figures,
    summed over the ranks."""

    stats: StepStats
    tokens: int
    grad_norm: torch.Tensor | None = None  # 0-d: the whole gradient's norm, where the ranks have summed it (sharded)


def _summed_over_ranks(
    params: list[torch.nn.Parameter], batch: DeviceBatch | None, stats: StepStats | None, device: str
) -> _Backward | None:
    """The global batch's gradient and figures: token-weighted sums over the ranks, divided by the
    global batch's loss tokens; None when no rank had a token to learn from. The figures cross
    the host here, once per iteration: the all-reduce carries them with the gradient."""
    loss_tokens = float(batch.loss_mask.sum()) if batch is not None else 0.0
    local = [float(v) for v in stats.values()] if stats is not None else [0.0] * 4
    global_loss_tokens, global_tokens, *stat_sums = reduce_gradients(
        params, loss_tokens, [loss_tokens, batch.num_tokens if batch is not None else 0,
                              *(v * loss_tokens for v in local)])
    if global_loss_tokens == 0:
        return None
    for p in params:
        p.grad.div_(global_loss_tokens)
    means = torch.tensor([v / global_loss_tokens for v in stat_sums], device=device)
    return _Backward(StepStats(*means.unbind()), int(global_tokens))


def _idle_batch(feature_size: int, device: str) -> DeviceBatch:
    """Two positions of zeros: what a rank with no data of its own runs, at weight 0, so that it
    joins the sharded drafter's all-gathers and reduce-scatters (every rank must)."""
    zeros = torch.zeros(1, 2, feature_size, device=device)  # (1, 2, D)
    return DeviceBatch(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
                       loss_mask=torch.ones(1, 2, device=device),
                       position_ids=torch.arange(2, device=device)[None],
                       document_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
                       hidden_states=zeros, target=zeros.clone())


def _sharded_forward_backward(
    root: LossModule, batch: DeviceBatch | None, dtype: str, device: str, params: list[torch.nn.Parameter]
) -> _Backward | None:
    """The global batch's gradient (reduce-scattered: each rank keeps its shard) and figures, with the
    drafter sharded. The ranks first agree on the global batch's loss tokens W, then each back-propagates
    its mean loss weighted by its own share of W: the summed gradient is the whole batch's mean loss's,
    as `_summed_over_ranks` gives it unsharded. The loss parts and the squares of the gradient's shards
    are summed in one all-reduce after the backward (the clip needs the whole norm). None when no rank
    had a token to learn from."""
    loss_tokens = float(batch.loss_mask.sum()) if batch is not None else 0.0
    num_tokens = batch.num_tokens if batch is not None else 0
    feature_size = batch.hidden_states.shape[-1] if batch is not None else 0
    totals = torch.tensor([loss_tokens, num_tokens, feature_size, batch is not None], dtype=torch.float64,
                          device=device)
    dist.all_reduce(totals)
    global_loss_tokens, global_tokens, feature_sum, ranks_with_data = totals.tolist()
    if global_loss_tokens == 0:
        return None
    weight = loss_tokens / global_loss_tokens
    idle = _idle_batch(int(feature_sum / ranks_with_data), device) if batch is None else None
    stats = forward_backward(lambda b: LossParts(*root(b)), batch if batch is not None else idle, dtype, weight)
    root.end_backward()
    figures = torch.stack([v.float() for v in stats.values()]) * weight if batch is not None \
        else torch.zeros(4, device=device)  # (4,) this rank's token-weighted share of the loss parts
    grads = local_tensors([p.grad for p in params if p.grad is not None])
    shares = torch.cat([figures, squared_norm(grads) if grads else torch.zeros(1, device=device)])  # (5,)
    dist.all_reduce(shares)
    return _Backward(StepStats(*shares[:4].unbind()), int(global_tokens), shares[4].sqrt())


def _replicated_forward_backward(
    loss_of: Callable[[DeviceBatch], LossParts], batch: DeviceBatch | None, dtype: str, device: str,
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, ctx: DistContext,
) -> _Backward | None:
    """The global batch's gradient and figures, with the drafter whole on every rank (summed over the
    ranks when there are several). None when no rank had a token to learn from."""
    stats = None if batch is None else forward_backward(loss_of, batch, dtype)
    if not ctx.distributed:
        return None if stats is None else _Backward(stats, batch.num_tokens)
    summed = _summed_over_ranks(params, batch, stats, device)
    if summed is None:  # the step is skipped: its gradient must not add to the next one's
        optimizer.zero_grad(set_to_none=True)
    return summed


def _iterations(
    data: Dataset, plan: list[list[int]], start: int, cfg: TrainConfig, ctx: DistContext
) -> Iterator[tuple[int, DeviceBatch | None]]:
    """(iteration, this rank's share of the global batch) from `start` on; None: nothing of this share
    could be read (warned), or nothing to read."""
    shares = [rank_share(batch, ctx) for batch in plan[start:]]
    yield from enumerate(iter_batches(data, shares, cfg.window_tokens), start)


@dataclass
class _Run:
    """One rank's training, set up: the drafter as it trains, its optimizer, the plan, where it starts."""

    parallel: ParallelPlan
    root: LossModule | None  # the sharded drafter inside its loss module; None: the drafter is whole on this rank
    trained: torch.nn.Module  # what the optimizer updates: the caller's drafter, or its sharded copy
    params: list[torch.nn.Parameter]  # the trainable weights of `trained`
    loss_of: Callable[[DeviceBatch], LossParts]  # a batch's loss through the whole drafter (unsharded)
    optimizer: torch.optim.Optimizer
    plan: list[list[int]]  # the global batches, in order
    warmup: int
    state: ResumeState  # the latest checkpoint's, or a fresh start
    # At its largest (gradients held, then AdamW's update): weights, and per trainable weight its
    # gradient and two moments, as this rank holds them (its shards, when sharded).
    rank_state_bytes: int

    @property
    def total(self) -> int:
        return len(self.plan)


def _setup(
    model: Drafter, data: Dataset, cfg: TrainConfig, device: str, teacher: Teacher | None, ctx: DistContext,
    checkpoints: TrainingCheckpoints | None,
) -> _Run:
    """The drafter placed (whole on `device`, or sharded) and in training mode, its optimizer, the
    plan, and the state it continues from."""
    torch.manual_seed(cfg.seed)
    parallel = choose_parallelism(model, cfg.parallelism, cfg.fsdp_memory_share,
                                  device_memory_bytes(device, cfg.gpu_memory_gb, ctx), ctx.world_size,
                                  cfg.fsdp_units)
    root: LossModule | None = None
    if parallel.mode == "fsdp":
        model.to("cpu").train()  # the caller's drafter waits on the host for the trained weights
        root = shard_drafter(model, lambda m, b: _parts(compute_loss(m, b, cfg, teacher)), device,
                             parallel.units or "layer")
    else:
        model.to(device).train()
    trained: torch.nn.Module = root.drafter if root is not None else model
    params = [p for p in trained.parameters() if p.requires_grad]
    optimizer = make_optimizer(trained, cfg.optim.lr, cfg.optim.weight_decay, device)
    plan = _plan(data, cfg, ctx)
    return _Run(
        parallel=parallel, root=root, trained=trained, params=params,
        loss_of=lambda b: compute_loss(model, b, cfg, teacher), optimizer=optimizer, plan=plan,
        warmup=fitted_warmup(cfg.optim.lr_warmup_steps, len(plan)),
        state=_resume(checkpoints, trained, optimizer, len(plan), ctx, root is not None),
        rank_state_bytes=local_bytes(list(trained.parameters())) + 3 * local_bytes(params),
    )


def _optimizer_step(
    run: _Run, batch: DeviceBatch | None, iteration: int, cfg: TrainConfig, device: str, ctx: DistContext
) -> _Iteration | None:
    """One optimizer step on the global batch of which `batch` is this rank's share. None when no rank
    had a token to learn from: the iteration is skipped, so that the iteration count stays aligned."""
    on_device = batch.to(device) if batch is not None else None
    if run.root is not None:
        backward = _sharded_forward_backward(run.root, on_device, cfg.dtype, device, run.params)
    else:
        backward = _replicated_forward_backward(run.loss_of, on_device, cfg.dtype, device, run.params,
                                                run.optimizer, ctx)
    if backward is None:
        return None
    lr = lr_at(iteration, run.total, cfg.optim.lr, run.warmup)
    grad_norm = apply_gradients(run.optimizer, run.params, lr, cfg.optim.grad_clip, backward.grad_norm)
    return _Iteration(iteration, lr, backward.tokens, backward.stats, grad_norm)


@dataclass
class _Checkpointing:
    """Saves a checkpoint every `every` iterations (rank 0 writes it; the ranks of a sharded drafter
    gather it together), hands the metrics it covers to the sink once it has committed, and counts
    the training thread's time on checkpoints."""

    run: _Run
    ctx: DistContext
    progress: _Progress
    every: int  # 0: no checkpoints
    writer: CheckpointWriter | None  # rank 0's, when checkpoints are saved
    on_checkpoint: Callable[[ResumeState], None] | None
    seconds: float = 0.0

    def due(self, iterations: int) -> bool:
        """A checkpoint after `iterations`; none after the last, whose drafter the caller receives."""
        return self.every > 0 and iterations % self.every == 0 and iterations < self.run.total

    def _committed(self, saved: ResumeState | None) -> None:
        if saved is not None:
            self.progress.release(saved.iteration)
            if self.on_checkpoint:
                self.on_checkpoint(saved)

    def poll(self) -> None:
        if self.writer:
            self._committed(self.writer.poll())

    def save(self, iterations: int, start: float) -> None:
        """A host copy of the training after `iterations`, handed to the writer (`start`: when training
        began, on the perf counter)."""
        started = time.perf_counter()
        run, progress = self.run, self.progress
        state = ResumeState(iterations, run.total, self.ctx.world_size, progress.tokens, time.perf_counter() - start,
                            list(progress.history),  # copies: training appends while it is written
                            list(progress.unreleased))
        snap = sharded_snapshot(run.trained, run.optimizer, state, self.ctx.is_main) if run.root is not None \
            else snapshot(run.trained, run.optimizer, state) if self.ctx.is_main else None
        if self.writer and snap:
            self._committed(self.writer.submit(snap))
            self._committed(self.writer.poll())  # a synchronous writer has committed already
        self.seconds += time.perf_counter() - started

    def finish(self) -> None:
        """Wait for the last write to commit."""
        if self.writer:
            started = time.perf_counter()
            self._committed(self.writer.wait())
            self.seconds += time.perf_counter() - started

    def abandon(self) -> None:
        """No write goes on behind a failed training; the previous checkpoint stays in force."""
        if self.writer:
            with contextlib.suppress(BaseException):
                self.writer.wait()


def _hand_back(run: _Run, model: Drafter, device: str) -> None:
    """The trained weights in the caller's drafter, on `device`, in eval mode."""
    if run.root is not None:
        # Gathered from the shards on every rank.
        full = get_model_state_dict(run.trained, options=StateDictOptions(full_state_dict=True))
        model.load_state_dict(full)
        model.to(device)
    model.eval()


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
    on_logged: Callable[[IterationMetrics, int], None] | None = None,
) -> TrainResult:
    """Train `model` in place on `cfg.max_tokens` trained positions of `data` (0: `cfg.epochs` passes;
    with a budget, epochs are an upper bound), streamed batch by batch. The learning-rate schedule
    spans the planned iterations, whatever the budget made of them (`fitted_warmup`, `lr_at`).

    A sample's features are (T, D): EAGLE-1/2 reads the last layer (D = H); EAGLE-3 reads
    [aux layers..., last layer] concatenated (D = (n_aux + 1) * H_t).

    Several ranks (`ctx.world_size` > 1, process group already joined): each rank trains on
    its share of every global batch and the gradients are summed over the ranks, the drafter
    replicated or sharded (FSDP2) as `cfg.parallelism` decides (see
    `pipeline.training.distributed`); only rank 0 logs metrics and writes checkpoints (the ranks
    of a sharded drafter gather each one together). With `checkpoints`, the latest one is
    restored first and training continues from its iteration; a new one is saved every
    `cfg.checkpoint_every` iterations (written in the background with
    `cfg.checkpoint_background`), and `on_checkpoint` runs on the training thread once it has
    committed (e.g. to flush metrics, so a resumed run never logs an iteration twice). `on_logged`
    runs on rank 0 after every `cfg.log_every` iterations with the last iteration's figures and
    the positions trained so far (e.g. to measure the drafter along a learning curve; it leaves
    the drafter in training mode).
    """
    sink, ctx = sink or NullSink(), ctx or DistContext()
    if not data.lengths:
        raise ValueError("train_drafter: no samples")
    run = _setup(model, data, cfg, device, teacher, ctx, checkpoints)
    saving = checkpoints is not None and cfg.checkpoint_every > 0
    progress = _Progress(run.state, sink, ctx.is_main, held=saving, on_logged=on_logged)
    saver = _Checkpointing(run, ctx, progress, cfg.checkpoint_every if saving else 0,
                           CheckpointWriter(checkpoints, cfg.checkpoint_background) if saving and ctx.is_main else None,
                           on_checkpoint)
    start = time.perf_counter() - run.state.wall_s
    iterations = run.state.iteration  # run so far, skipped ones included: the plan's position
    try:
        for iteration, batch in _iterations(data, run.plan, run.state.iteration, cfg, ctx):
            iterations = iteration + 1
            saver.poll()
            done = _optimizer_step(run, batch, iteration, cfg, device, ctx)
            if done is None:
                continue
            progress.add(done)
            if (iterations - run.state.iteration) % cfg.log_every == 0:
                progress.flush()
            if saver.due(iterations):
                progress.flush()
                saver.save(iterations, start)
        progress.flush()
        saver.finish()
    except BaseException:
        saver.abandon()
        raise
    progress.release()
    _hand_back(run, model, device)
    last = progress.last
    if last is None:
        raise ValueError("train_drafter: no batch could be read (every shard unreadable)")
    return TrainResult(
        iterations=iterations, samples=len(data.lengths), tokens=progress.tokens, loss=last.loss,
        vloss=last.vloss, ploss=last.ploss, accuracy=last.accuracy,
        wall_s=time.perf_counter() - start, loss_history=progress.history,
        resumed_from_iteration=run.state.iteration, parallelism=run.parallel, rank_state_bytes=run.rank_state_bytes,
        checkpoint_s=saver.seconds,
    )
