"""The held-out split: deterministic by sample id, and the same wherever a step's rollouts are split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.data.held_out import (
    held_out_prompts,
    held_out_rollouts,
    held_out_sequences,
    is_held_out,
    training_rollouts,
)
from pipeline.data.rollouts import Rollout, write_rollouts_file
from pipeline.data.store import open_store
from tests.support.config import write_config


@pytest.mark.parametrize("fraction", [0.05, 0.125, 0.5, 0.9])
def test_is_held_out_is_deterministic_and_close_to_the_fraction(fraction: float) -> None:
    sample_ids = [f"step-{i // 100}-rollout-{i}" for i in range(10_000)]

    first = [is_held_out(s, fraction) for s in sample_ids]
    second = [is_held_out(s, fraction) for s in sample_ids]

    assert first == second
    assert sum(first) / len(first) == pytest.approx(fraction, abs=0.02)


def test_held_out_sets_grow_with_the_fraction() -> None:
    sample_ids = [f"sample-{i}" for i in range(2000)]
    small = {s for s in sample_ids if is_held_out(s, 0.1)}
    large = {s for s in sample_ids if is_held_out(s, 0.3)}
    assert small < large


def _rollouts(n: int) -> list[Rollout]:
    return [Rollout(f"s{i}", [1, 2, 3, 4 + i % 5], [0, 0, 1, 1], 0.0, 1) for i in range(n)]


def test_training_and_held_out_rollouts_partition_the_step() -> None:
    rows = _rollouts(200)
    train, held = training_rollouts(rows, 0.25), held_out_rollouts(rows, 0.25)
    assert {r.sample_id for r in train}.isdisjoint(r.sample_id for r in held)
    assert sorted(r.sample_id for r in train + held) == sorted(r.sample_id for r in rows)
    assert [r.sample_id for r in held] == [r.sample_id for r in rows if is_held_out(r.sample_id, 0.25)]


def test_prompts_and_sequences_are_the_first_held_out_rollouts(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path, {"eval": {"held_out_fraction": 0.25, "num_prompts": 3}}, pretrained=False))
    store = open_store(cfg)
    rows = _rollouts(40)
    write_rollouts_file(store, cfg.run, 1, rows)
    held = held_out_rollouts(rows, 0.25)[:3]

    prompts = held_out_prompts(store, cfg, 1)
    sequences, prompt_lens = held_out_sequences(store, cfg, 1)

    assert [p.tolist() for p in prompts] == [[1, 2]] * 3  # the tokens before the first response token
    assert [s.tolist() for s in sequences] == [r.input_ids for r in held]
    assert prompt_lens == [2, 2, 2]
    assert all(p.dtype == torch.int64 for p in prompts)


def test_a_step_without_held_out_rollouts_is_refused(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path, {"eval": {"held_out_fraction": 0.01}}, pretrained=False))
    store = open_store(cfg)
    rows = _rollouts(10)
    assert not held_out_rollouts(rows, 0.01)
    write_rollouts_file(store, cfg.run, 1, rows)
    with pytest.raises(ValueError, match=r"step 1: no held-out rollouts \(eval.held_out_fraction=0.01\)"):
        held_out_prompts(store, cfg, 1)
