"""Drafter training: config + data in, a trained drafter and a typed result out.

One visible loop. Metrics leave through `MetricsSink.log_dict(payload, step)`, which
the MLflow side implements; nothing here knows about Dagster or MLflow.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipeline.config import TrainConfig
from pipeline.eagle import EagleDrafter
from pipeline.eagle3 import Eagle3Drafter
from pipeline.losses import LossParts, eagle3_loss, eagle_loss
from pipeline.window import PackedBatch, block_causal_mask, pack

# One training sample: input_ids (T,), hidden (T, H), loss_mask (T,)
Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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


def make_batches(samples: list[Sample], cfg: TrainConfig, epoch: int) -> list[PackedBatch]:
    """Shuffle (seeded per epoch) and pack up to `batch_size_per_gpu` samples / `max_seq_len` tokens each."""
    order = list(range(len(samples)))
    random.Random(cfg.seed * 10_007 + epoch).shuffle(order)
    batches, group, tokens = [], [], 0
    for i in order:
        length = min(samples[i][0].shape[0], cfg.window_tokens)
        if group and (len(group) == cfg.batch_size_per_gpu or tokens + length > cfg.max_seq_len):
            batches.append(pack(group, cfg.window_tokens))
            group, tokens = [], 0
        group.append(samples[i])
        tokens += length
    if group:
        batches.append(pack(group, cfg.window_tokens))
    return batches


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
    samples: list[Sample],
    cfg: TrainConfig,
    sink: MetricsSink | None = None,
    device: str = "cpu",
    teacher: Teacher | None = None,
) -> TrainResult:
    """Train `model` in place for `cfg.epochs` passes over `samples`.

    A sample's hidden states are (T, D): EAGLE-1/2 reads the last layer (D = H); EAGLE-3
    reads [aux layers..., last layer] concatenated (D = (n_aux + 1) * H_t).
    """
    sink = sink or NullSink()
    if not samples:
        raise ValueError("train_drafter: no samples")
    torch.manual_seed(cfg.seed)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    epochs = [make_batches(samples, cfg, e) for e in range(cfg.epochs)]
    total = sum(len(b) for b in epochs)

    iteration, tokens, history = 0, 0, []
    start = time.perf_counter()
    for batches in epochs:
        for batch in batches:
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
    return TrainResult(
        iterations=iteration, samples=len(samples), tokens=tokens, loss=history[-1],
        vloss=parts.vloss.item(), ploss=parts.ploss.item(), accuracy=parts.accuracy.item(),
        wall_s=time.perf_counter() - start, loss_history=history,
    )
