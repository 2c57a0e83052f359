"""Windows-only capture: what training reads is what it read when whole rollouts were stored."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.config import PipelineConfig, load_config
from pipeline.data import capture, shard_format, shards
from pipeline.data.buffer import select_buffer
from pipeline.data.held_out import training_rollouts
from pipeline.data.rollouts import read_policy_pointer, read_rollouts
from pipeline.data.shard_format import HiddenSample
from pipeline.data.store import ObjectStore, open_store
from pipeline.models import drafter as drafters
from pipeline.models import target as target_lib
from pipeline.sources import extract
from pipeline.sources.simulation import SimulatedRL
from pipeline.training.dataset import BufferDataset, iter_batches, plan_epoch
from tests.support.config import write_config

WINDOW = 10  # the tiny simulation's rollouts are 18 tokens (6 prompt, 12 response): windows [8, 18)


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> tuple[PipelineConfig, ObjectStore]:
    directory = tmp_path_factory.mktemp("capture")
    cfg = load_config(write_config(directory, {"train": {"window_tokens": WINDOW, "epochs": 3},
                                               "hidden_states": {"tokens_per_batch": 64}}))
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(1)
    return cfg, store


def _whole_rollouts(cfg: PipelineConfig, store: ObjectStore) -> tuple[torch.nn.Module, list[HiddenSample]]:
    """The training rollouts' states as they were stored before capture plans: whole rollouts."""
    policy = target_lib.load_policy(store, read_policy_pointer(store, cfg.run, 1).checkpoint_uri)
    train = training_rollouts(read_rollouts(store, cfg.run, 1), cfg.eval.held_out_fraction)
    layer_ids = extract.stored_layer_ids(cfg.drafter, policy.config.num_hidden_layers)
    samples = [replace(s, hidden=s.hidden.clone()) for s in extract.iter_hidden_states(
        policy, train, 1, tokens_per_batch=64, layer_ids=layer_ids)]
    return policy, samples


def _write(store: ObjectStore, run: str, samples: list[HiddenSample], layer_ids: list[int]) -> shard_format.Manifest:
    return shards.write_hidden_states(store, run, 1, samples, hidden_size=samples[0].hidden.shape[2],
                                      layer_ids=layer_ids, target={"model_id": "tiny"})


def test_windows_only_storage_gives_bit_identical_training_batches(step) -> None:
    cfg, store = step
    policy, whole = _whole_rollouts(cfg, store)
    plan = capture.plan_capture(read_rollouts(store, cfg.run, 1), 1, held_out_fraction=cfg.eval.held_out_fraction,
                                window_tokens=WINDOW)
    windows = plan.bounds()
    assert all(end - start == WINDOW < s.input_ids.shape[0] for s in whole for start, end in [windows[s.sample_id]])
    cut = [HiddenSample(s.sample_id, 1, s.input_ids[a:b], s.loss_mask[a:b], s.hidden[a:b], position_offset=a)
           for s in whole for a, b in [windows[s.sample_id]]]
    layer_ids = extract.stored_layer_ids(cfg.drafter, 2)
    before, after = _write(store, "whole", whole, layer_ids), _write(store, "windows", cut, layer_ids)
    assert after.hidden_bytes * 18 == before.hidden_bytes * WINDOW  # 10 of each rollout's 18 tokens
    assert [e.offset for e in after.samples] == [windows[e.sample_id][0] for e in after.samples]

    drafter = drafters.fresh_drafter(cfg.drafter, policy, torch.ones(cfg.simulation.vocab_size), seed=0)
    datasets = [BufferDataset(store, run, select_buffer([m], 1, 1, 10_000), lambda s: drafter.training_sample(s, 2))
                for run, m in (("whole", before), ("windows", after))]
    plans = [[b for e in range(cfg.train.epochs) for b in plan_epoch(d.lengths, cfg.train, e)] for d in datasets]
    assert plans[0] == plans[1]
    batches = 0
    for a, b in zip(*(iter_batches(d, plans[0], WINDOW) for d in datasets), strict=True):
        for name in ("input_ids", "loss_mask", "position_ids", "document_ids", "hidden_states", "target"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        batches += 1
    assert batches == len(plans[0]) > 3


def test_extraction_stores_each_window_with_its_offset_and_the_plan(step) -> None:
    cfg, store = step
    _, whole = _whole_rollouts(cfg, store)
    manifest = extract.extract_hidden_states(store, cfg, 1)
    plan = capture.read_plan(store, cfg.run, 1)
    assert plan is not None
    assert manifest.num_samples == plan.captured == len(whole)
    assert manifest.num_tokens == plan.stored_tokens == WINDOW * plan.captured
    by_id = {s.sample_id: s for s in whole}
    for sample in shards.iter_samples(store, cfg.run, manifest):
        a, b = plan.bounds()[sample.sample_id]
        full = by_id[sample.sample_id]
        assert sample.position_offset == a
        assert torch.equal(sample.input_ids, full.input_ids[a:b])
        assert torch.equal(sample.loss_mask, full.loss_mask[a:b])
        # a forward up to the window's end, in other padded batches: the same states to within bf16 rounding
        torch.testing.assert_close(sample.hidden.float(), full.hidden[a:b].float(), rtol=2**-7, atol=1e-5)


def test_capture_budget_limits_what_is_stored(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path, {"capture": {"max_samples": 5}}))
    store = open_store(cfg)
    SimulatedRL(cfg.simulation, store, cfg.run, cfg.data_path / "cache").run_step(1)
    manifest = extract.extract_hidden_states(store, cfg, 1)
    plan = capture.read_plan(store, cfg.run, 1)
    assert manifest.num_samples == plan.captured == 5
    assert plan.published == cfg.simulation.rollouts_per_step
    assert {e.sample_id for e in manifest.samples} == {s.sample_id for s in plan.samples}
