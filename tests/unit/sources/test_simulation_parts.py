"""The simulated source's long-tailed lengths and its parts: most rollouts finish early, each part holds what
finished in its slice of the rollout window, and the committed step is the parts in part order."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from pipeline.config import load_config
from pipeline.data import parts as parts_lib
from pipeline.data.rollouts import read_rollouts
from pipeline.data.store import open_store
from pipeline.sources.simulation import SimulatedRL, finish_parts
from tests.support.config import write_config

LONG_TAIL = {"simulation": {"parts_per_step": 4, "response_len_sigma": 0.5, "response_len": 40,
                            "response_len_median": 0.3, "rollouts_per_step": 24}}


def test_lengths_are_lognormal_and_capped(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path, LONG_TAIL, pretrained=False))
    source = SimulatedRL(cfg.simulation, open_store(cfg), cfg.run, tmp_path / "cache")
    lengths = source.response_lengths(4000, torch.Generator().manual_seed(0))
    assert max(lengths) == 40  # the tail reaches the cap
    assert min(lengths) >= 1
    assert abs(statistics.median(lengths) - 12) <= 1  # 0.3 of 40
    assert statistics.mean(lengths) > statistics.median(lengths)  # long-tailed: the mean above the median


def test_a_step_is_published_in_parts_then_committed(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path, LONG_TAIL))
    store = open_store(cfg)
    source = SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache")
    generated = source.generate_step(1)
    slices = finish_parts(generated.rollouts, 4)
    sizes = [len(s) for s in slices]
    assert sum(sizes) == 24
    assert sizes[0] + sizes[1] > sizes[2] + sizes[3]  # most rollouts finish in the first half of the window
    for part, rows in enumerate(slices):  # a part holds the rollouts no longer than its slice's end
        assert all(sum(r.loss_mask) <= (part + 1) / 4 * 40 for r in rows)

    written = source.publish_parts(generated)  # what run_step hands over part by part while decoding
    assert written == [p for p, rows in enumerate(slices) if rows]
    assert parts_lib.commit_parts(store, cfg.run, 1) == written
    stored = read_rollouts(store, cfg.run, 1)
    assert [r.sample_id for r in stored] == [r.sample_id for rows in slices for r in rows]
    assert {r.sample_id: r for r in stored} == {r.sample_id: r for r in generated.rollouts}


def test_run_step_publishes_each_part_as_the_decoding_finishes_it(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path, LONG_TAIL))
    store = open_store(cfg)
    source = SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache")
    source.run_step(1, period_s=2.0)  # decoding paced over the step's period
    manifests = parts_lib.published_parts(store, cfg.run, 1)
    started = parts_lib.read_step_parts(store, cfg.run, 1).started_at
    times = [m.published_at for m in sorted(manifests, key=lambda m: m.part)]
    assert times == sorted(times)  # parts go out in decoding order
    assert times[-1] - started > 0.5  # spread over the period, not written at once
    assert parts_lib.committed_part_numbers(store, cfg.run, 1) == [m.part for m in manifests]
    assert sum(m.rows for m in manifests) == 24
