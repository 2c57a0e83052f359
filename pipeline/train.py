"""Drafter training: config + data in, a trained drafter and a typed result out.

One visible loop. Metrics leave through `MetricsSink.log_dict(payload, step)`, which
the MLflow side implements; nothing here knows about Dagster or MLflow.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipeline.config import TrainConfig
from pipeline.dataset import Dataset, iter_batches, plan_epoch
from pipeline.eagle import EagleDrafter
from pipeline.eagle3 import Eagle3Drafter
from pipeline.losses import LossParts, eagle3_loss, eagle_loss
from pipeline.window import PackedBatch, block_causal_mask


class MetricsSink(Protocol):
    def log_dict(self, payload: dict[str, float], step: int) -> None: ...


@dataclass(frozen=True)
class Teacher:
    """The target's final norm and lm_head rows of the draft vocabulary: EAGLE-3's soft labels."""

    norm: torch.nn.Module
    head: torch.Tensor  # (draft_vocab, H_t)


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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def lr_at(iteration: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to 10% of it at `total`."""
    if warmup and iteration < warmup:
        return peak * (iteration + 1) / warmup
    progress = min(1.0, (iteration - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def compute_loss(
    model: EagleDrafter | Eagle3Drafter, batch: PackedBatch, cfg: TrainConfig, teacher: Teacher | None
) -> LossParts:
    if isinstance(model, Eagle3Drafter):
        if teacher is None:
            raise ValueError("EAGLE-3 training needs the target's norm and lm_head (teacher)")
        return eagle3_loss(model, batch, teacher.norm, teacher.head, cfg.ttt_steps, cfg.ttt_decay)
    predicted = model(batch.hidden_states, batch.input_ids, batch.position_ids, block_causal_mask(batch.document_ids))
    return eagle_loss(predicted, batch.target, model.lm_head.weight, batch.loss_mask, cfg.vloss_weight,
                      cfg.ploss_weight)


def train_drafter(
    model: EagleDrafter | Eagle3Drafter,
    data: Dataset,
    cfg: TrainConfig,
    sink: MetricsSink | None = None,
    device: str = "cpu",
    teacher: Teacher | None = None,
) -> TrainResult:
    """Train `model` in place for `cfg.epochs` passes over `data`, streamed batch by batch.

    A sample's features are (T, D): EAGLE-1/2 reads the last layer (D = H); EAGLE-3 reads
    [aux layers..., last layer] concatenated (D = (n_aux + 1) * H_t).
    """
    sink = sink or NullSink()
    if not data.lengths:
        raise ValueError("train_drafter: no samples")
    torch.manual_seed(cfg.seed)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    plans = [plan_epoch(data.lengths, cfg, e) for e in range(cfg.epochs)]
    total = sum(len(p) for p in plans)

    iteration, tokens, history, parts = 0, 0, [], None
    start = time.perf_counter()
    for plan in plans:
        for batch in iter_batches(data, plan, cfg.window_tokens):
            if batch is None:  # every sample of this batch sat in an unreadable shard (warned)
                iteration += 1
                continue
            # -- learning rate
            lr = lr_at(iteration, total, cfg.optim.lr, cfg.optim.lr_warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # -- forward and loss
            tick = time.perf_counter()
            parts = compute_loss(model, batch.to(device), cfg, teacher)
            # -- backward and step
            optimizer.zero_grad(set_to_none=True)
            parts.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            optimizer.step()
            # -- metrics
            tokens += batch.num_tokens
            history.append(parts.loss.item())
            sink.log_dict({
                "loss": history[-1], "vloss": parts.vloss.item(), "ploss": parts.ploss.item(),
                "accuracy": parts.accuracy.item(), "lr": lr,
                "tokens_per_s": batch.num_tokens / max(time.perf_counter() - tick, 1e-9),
            }, iteration)
            iteration += 1
    model.eval()
    if parts is None:
        raise ValueError("train_drafter: no batch could be read (every shard unreadable)")
    return TrainResult(
        iterations=iteration, samples=len(data.lengths), tokens=tokens, loss=history[-1],
        vloss=parts.vloss.item(), ploss=parts.ploss.item(), accuracy=parts.accuracy.item(),
        wall_s=time.perf_counter() - start, loss_history=history,
    )
