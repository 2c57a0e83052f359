"""The held-out split of a step's rollouts: which ones the drafter trains on, which ones measure it.

A rollout is held out by its sample id alone (a hash, stable across reruns and processes), so the
extraction, the acceptance measurement and the fleet's canaries agree on it without talking.
"""

from __future__ import annotations

import zlib

import torch

from pipeline.config import PipelineConfig
from pipeline.data.rollouts import Rollout, TargetLimits, read_rollouts
from pipeline.data.store import ObjectStore


def is_held_out(sample_id: str, fraction: float) -> bool:
    """Deterministic split by sample id, stable across reruns and processes."""
    return (zlib.crc32(sample_id.encode()) % 10_000) < fraction * 10_000


def training_rollouts(rollouts: list[Rollout], held_out_fraction: float) -> list[Rollout]:
    return [r for r in rollouts if not is_held_out(r.sample_id, held_out_fraction)]


def held_out_rollouts(rollouts: list[Rollout], held_out_fraction: float) -> list[Rollout]:
    return [r for r in rollouts if is_held_out(r.sample_id, held_out_fraction)]


def held_out_prompts(
    store: ObjectStore, cfg: PipelineConfig, step: int, limits: TargetLimits | None = None
) -> list[torch.Tensor]:
    """The prompts of the step's first `eval.num_prompts` held-out rollouts: what drafters are measured on."""
    rollouts = held_out_rollouts(read_rollouts(store, cfg.run, step, limits), cfg.eval.held_out_fraction)
    if not rollouts:
        raise ValueError(f"step {step}: no held-out rollouts (eval.held_out_fraction={cfg.eval.held_out_fraction})")
    return [torch.tensor(r.input_ids[: max(1, r.prompt_len)]) for r in rollouts[: cfg.eval.num_prompts]]


def held_out_sequences(
    store: ObjectStore, cfg: PipelineConfig, step: int, limits: TargetLimits | None = None
) -> tuple[list[torch.Tensor], list[int]]:
    """Whole held-out rollouts (prompt + response) and their prompt lengths: what the acceptance estimate reads."""
    rollouts = held_out_rollouts(read_rollouts(store, cfg.run, step, limits), cfg.eval.held_out_fraction)
    rollouts = rollouts[: cfg.eval.num_prompts]
    return [torch.tensor(r.input_ids) for r in rollouts], [max(1, r.prompt_len) for r in rollouts]
